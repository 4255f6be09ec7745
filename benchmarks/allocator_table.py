"""The table of ``benchmarks/allocator.sh``: each setup's median epoch time and peak RAM under
glibc's default allocator and under one that keeps freed memory (every run in the experiments
allocator-default and allocator-no-mmap of the project's mlflow.db)."""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddlx.measure.report import load_runs  # noqa: E402

ALLOCATORS = ("default", "no-mmap")


def main() -> None:
    runs = defaultdict(lambda: defaultdict(list))  # (workload, setup) -> allocator -> runs
    for allocator in ALLOCATORS:
        for run in load_runs(f"sqlite:///{ROOT / 'mlflow.db'}", [f"allocator-{allocator}"]):
            if run.status == "FINISHED" and run.mean_epoch_time_s:
                runs[run.workload.label, run.setup][allocator].append(run)
    print("| workload | setup | default s/epoch | no-mmap s/epoch | default / no-mmap | peak RAM MB default / no-mmap | runs |")
    print("|---|---|---|---|---|---|---|")
    for (workload, setup), by in sorted(runs.items()):
        if len(by) < len(ALLOCATORS):
            continue
        t = {a: median(r.mean_epoch_time_s for r in by[a]) for a in ALLOCATORS}
        ram = {a: median(r.metrics.get("peak_ram_mb", float("nan")) for r in by[a]) for a in ALLOCATORS}
        print(f"| {workload} | {setup} | {t['default']:.2f} | {t['no-mmap']:.2f} | {t['default'] / t['no-mmap']:.2f}x "
              f"| {ram['default']:.0f} / {ram['no-mmap']:.0f} | {len(by['default'])} + {len(by['no-mmap'])} |")


if __name__ == "__main__":
    main()
