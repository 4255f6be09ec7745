"""Each setup's median epoch time and peak RAM with ``cpu_allocator=system`` (glibc's default)
against every other allocator measured on the same workload, from one experiment of the
project's mlflow.db:

    python studies/cpu-2core/allocator_table.py              # "allocator", as studies/cpu-2core/allocator.sh writes it
    python studies/cpu-2core/allocator_table.py ddlx         # e.g. cpu_study.sh's sets measured with keep_freed too
"""
from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ddlx.allocator import SYSTEM  # noqa: E402
from ddlx.tracking import load_runs  # noqa: E402


def main(argv: list[str]) -> None:
    experiment = argv[0] if argv else "allocator"
    runs = defaultdict(lambda: defaultdict(list))  # (workload, setup) -> allocator -> runs
    for run in load_runs(f"sqlite:///{ROOT / 'mlflow.db'}", [experiment]):
        if run.status == "FINISHED" and run.mean_epoch_time_s:
            workload = replace(run.workload, cpu_allocator=SYSTEM).label
            runs[workload, run.setup][run.workload.cpu_allocator].append(run)
    for other in sorted({a for by in runs.values() for a in by} - {SYSTEM}):
        print(f"| workload | setup | {SYSTEM} s/epoch | {other} s/epoch | {SYSTEM} / {other} "
              f"| peak RAM MB {SYSTEM} / {other} | runs |")
        print("|---|---|---|---|---|---|---|")
        for (workload, setup), by in sorted(runs.items()):
            if not (by[SYSTEM] and by[other]):
                continue
            t = {a: median(r.mean_epoch_time_s for r in by[a]) for a in (SYSTEM, other)}
            ram = {a: median(r.metrics.get("peak_ram_mb", float("nan")) for r in by[a]) for a in (SYSTEM, other)}
            print(f"| {workload} | {setup} | {t[SYSTEM]:.2f} | {t[other]:.2f} | {t[SYSTEM] / t[other]:.2f}x "
                  f"| {ram[SYSTEM]:.0f} / {ram[other]:.0f} | {len(by[SYSTEM])} + {len(by[other])} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
