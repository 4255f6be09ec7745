"""Speedup report from the MLflow runs: ``python -m ddlx.report [--sweep-id latest] [...]``.

Prints the table, writes ``speedup.md``, ``speedup.csv`` and ``speedup.png`` under ``--out``
and logs them as one run of the MLflow experiment ``reports``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .measure import report
from .tracking import load_runs, log_result_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ddlx.report", description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db",
                        help="MLflow store holding the runs (default: sqlite:///mlflow.db, train.py's default store when run from the project folder)")
    parser.add_argument("--experiment", action="append", default=None,
                        help="experiment(s) to read (repeatable; default: ddlx)")
    parser.add_argument("--sweep-id", default=None,
                        help="only runs of this sweep (their sweep_id tag, e.g. multirun/2026-11-21/10-00-00); 'latest' = the newest sweep")
    parser.add_argument("--out", type=Path, default=None, help="folder for the files (default: reports/<time>)")
    parser.add_argument("--no-log", action="store_true", help="do not log the report to MLflow")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    experiments = args.experiment or ["ddlx"]
    try:
        runs = load_runs(args.tracking_uri, experiments, args.sweep_id)
    except ValueError as err:
        print(f"ddlx.report: error: {err}", file=sys.stderr)
        return 2
    built = report.build_report(runs)
    print(report.to_text(built))
    out = args.out or Path("reports") / time.strftime("%Y-%m-%d_%H-%M-%S")
    files = report.write(built, out)
    print(f"\nwrote {', '.join(str(f) for f in files)}")
    if not args.no_log:
        sweep = args.sweep_id if args.sweep_id != "latest" else next((r.sweep_id for r in runs), "")
        run_id = log_result_run(args.tracking_uri, "reports", "speedup-report", files=files,
                                tags={"experiments": ",".join(experiments), "sweep_id": sweep})
        print(f"logged as MLflow run {run_id} in experiment 'reports'")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
