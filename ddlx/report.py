"""Speedup report from the MLflow runs: ``python -m ddlx.report [--sweep-id latest] [...]``.

Prints the table, writes ``speedup.md``, ``speedup.csv`` and ``speedup.png`` (where a row has a speedup) under ``--out``
and logs them as one run of the MLflow experiment ``reports``; for a sweep, also the link that
shows its runs side by side in the MLflow UI.
"""
from __future__ import annotations

import argparse
from collections import Counter
import sys
import time
from pathlib import Path

from .command_line import shell_words
from .measure import speedup_table as report
from .records import not_measured
from .tracking import check_tracking_uri, load_runs, log_result_run, sqlite_path
from .ui import compare_page, logged_as, open_command


DEFAULT_STORE = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "ddlx"


def command(sweep_id: str, tracking_uri: str, experiment: str) -> str:
    """The command that reports on sweep ``sweep_id`` of ``experiment`` at ``tracking_uri``, run
    from the current folder: the options at their defaults left out."""
    words = ["python", "-m", "ddlx.report", "--sweep-id", sweep_id]
    path = sqlite_path(tracking_uri)
    if path is None or path.resolve() != sqlite_path(DEFAULT_STORE).resolve():
        words += ["--tracking-uri", tracking_uri]
    if experiment != DEFAULT_EXPERIMENT:
        words += ["--experiment", experiment]
    return shell_words(*words)


def sweep_end(sweep_id: str, tracking_uri: str, experiment: str) -> list[str]:
    """What sweep ``sweep_id``'s runs came to, as the report will count them, and the command
    that reports on them: said at the end of a sweep."""
    runs = load_runs(tracking_uri, [experiment], sweep_id)
    left_out = Counter(why[0] for why in map(not_measured, runs) if why is not None)
    counted = len(runs) - sum(left_out.values())
    reasons = f" (left out: {', '.join(f'{n} {why}' for why, n in left_out.items())})" if left_out else ""
    return [f"ddlx: sweep {sweep_id} ended: {len(runs)} run(s); the report counts {counted}{reasons}",
            f"  compare them: {command(sweep_id, tracking_uri, experiment)}"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ddlx.report", description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default=DEFAULT_STORE,
                        help=f"MLflow store holding the runs (default: {DEFAULT_STORE}, train.py's default store when run from the project folder)")
    parser.add_argument("--experiment", action="append", default=None,
                        help=f"experiment(s) to read (repeatable; default: {DEFAULT_EXPERIMENT})")
    parser.add_argument("--sweep-id", default=None,
                        help="only runs of this sweep (their sweep_id tag, e.g. multirun/2026-11-21/10-00-00); 'latest' = the newest sweep")
    parser.add_argument("--out", type=Path, default=None, help="folder for the files (default: reports/<time>)")
    parser.add_argument("--no-log", action="store_true", help="do not log the report to MLflow")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    experiments = args.experiment or [DEFAULT_EXPERIMENT]
    out = args.out or Path("reports") / time.strftime("%Y-%m-%d_%H-%M-%S")
    try:
        check_tracking_uri(args.tracking_uri, setting="--tracking-uri", write=not args.no_log, read_only_option="--no-log")
        check_out(out)
        runs = load_runs(args.tracking_uri, experiments, args.sweep_id)
        if not runs:  # a table of no rows, logged as a report, would say nothing
            raise ValueError(f"experiment(s) {', '.join(map(repr, experiments))} at {args.tracking_uri} hold no runs: "
                             f"train first (python train.py ...), or pass the --experiment that holds them")
    except ValueError as err:  # StoreError (a ConfigError) among them: no store, a damaged one
        print(f"ddlx.report: error: {err}", file=sys.stderr)
        return 2
    built = report.build_report(runs)
    print(report.to_text(built))
    files = report.write(built, out)
    print(f"\nwrote {', '.join(str(f) for f in files)}")
    if not any(f.suffix == ".png" for f in files):
        print("no speedup.png: no counted run has a speedup (a setup's speedup needs the one-device run of its "
              "workload, counted too); the notes above say which runs were left out and why")
    if args.sweep_id is not None:
        compare = compare_page(experiment_ids(args.tracking_uri, experiments), [r.run_id for r in runs])
        print(f"the sweep's {len(runs)} runs side by side: {open_command(args.tracking_uri, compare)}")
    if not args.no_log:
        sweep = args.sweep_id if args.sweep_id != "latest" else next((r.sweep_id for r in runs), "")
        logged = log_result_run(args.tracking_uri, "reports", "speedup-report", files=files,
                                tags={"experiments": ",".join(experiments), "sweep_id": sweep})
        print(logged_as(args.tracking_uri, "reports", *logged))
    return 0


def check_out(out: Path) -> None:
    """A ValueError, before any run is read, when the report's folder cannot be made (run from a
    folder the user can only read, as a shared results folder)."""
    from .preflight import folder_problem

    problem = folder_problem(out, "--out", "pass --out with a folder you can write (e.g. --out ~/reports)")
    if problem:
        raise ValueError(problem)


def experiment_ids(tracking_uri: str, names: list[str]) -> list[str]:
    """The ids of experiments that exist (:func:`load_runs` and :func:`log_result_run` made sure)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    return [client.get_experiment_by_name(name).experiment_id for name in names]


if __name__ == "__main__":
    from .process import ended_by_ctrl_c, exit_without_collecting

    exit_without_collecting()
    raise SystemExit(ended_by_ctrl_c("python -m ddlx.report", main))
