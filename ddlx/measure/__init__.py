"""Measurement: timing and resource-monitor callbacks (``timing``, ``resources``), the speedup
report (``report``). Nothing is imported here, so the report and the recommender start without
importing Lightning (2-4 s)."""
