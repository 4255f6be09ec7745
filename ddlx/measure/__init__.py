"""Measurement: timing and resource-monitor callbacks, the speedup report."""
from .resources import ResourceMonitor
from .timing import EpochTimer

__all__ = ["EpochTimer", "ResourceMonitor"]
