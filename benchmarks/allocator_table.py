"""The table of ``benchmarks/allocator.sh``: each setup's median epoch time and peak RAM with
``cpu_allocator=system`` (glibc's default) and ``cpu_allocator=keep_freed`` (every run in the
experiment "allocator" of the project's mlflow.db)."""
from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddlx.allocator import CHOICES  # noqa: E402
from ddlx.measure.report import load_runs  # noqa: E402


def main() -> None:
    runs = defaultdict(lambda: defaultdict(list))  # (workload, setup) -> allocator -> runs
    for run in load_runs(f"sqlite:///{ROOT / 'mlflow.db'}", ["allocator"]):
        if run.status == "FINISHED" and run.mean_epoch_time_s:
            workload = replace(run.workload, cpu_allocator="system").label
            runs[workload, run.setup][run.workload.cpu_allocator].append(run)
    system, kept = CHOICES
    print(f"| workload | setup | {system} s/epoch | {kept} s/epoch | {system} / {kept} | peak RAM MB {system} / {kept} | runs |")
    print("|---|---|---|---|---|---|---|")
    for (workload, setup), by in sorted(runs.items()):
        if len(by) < len(CHOICES):
            continue
        t = {a: median(r.mean_epoch_time_s for r in by[a]) for a in CHOICES}
        ram = {a: median(r.metrics.get("peak_ram_mb", float("nan")) for r in by[a]) for a in CHOICES}
        print(f"| {workload} | {setup} | {t[system]:.2f} | {t[kept]:.2f} | {t[system] / t[kept]:.2f}x "
              f"| {ram[system]:.0f} / {ram[kept]:.0f} | {len(by[system])} + {len(by[kept])} |")


if __name__ == "__main__":
    main()
