"""Re-run the faults of issue 18 ("Runs you can trust") against train.py as a user would, and print
a table: fault | expected | observed. Each fault runs in its own scratch project folder.

    python studies/faults.py [--keep DIR]

About 6 minutes on 2 cores (most of it train.py starting: torch, Lightning, MLflow).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
TINY = ["data.image_size=32", "data.synthetic_size=[40,64]", "data.num_images=48", "data.batch_size=8",
        "data.num_workers=0", "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
ENV = {**os.environ, "PYTHONPATH": str(PROJECT), "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
ROWS: list[tuple[str, str, str]] = []


def train_py(root: Path, *overrides: str, multirun: bool = False, wait: bool = True, **kwargs):
    cmd = [sys.executable, str(PROJECT / "train.py"), *(["-m"] if multirun else []), *overrides, f"paths.root={root}"]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=root)
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=root, timeout=600, **kwargs)


def runs(root: Path):
    from mlflow.tracking import MlflowClient

    from ddlx.tracking import store_lock

    uri = f"sqlite:///{root / 'mlflow.db'}"
    if not (root / "mlflow.db").exists():
        return []
    with store_lock(uri):
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("ddlx")
        return [] if exp is None else client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def described(found) -> str:
    return "; ".join(f"{r.info.status}" + (f" ({r.data.tags['error'][:90]})" if r.data.tags.get("error") else "")
                     for r in found) or "no run"


def wait_for(predicate, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return False


def an_epoch_done(root: Path) -> bool:
    return any("epoch_time_s" in r.data.metrics for r in runs(root))


def row(fault: str, expected: str, observed: str) -> None:
    ROWS.append((fault, expected, observed))
    print(f"| {fault} | {expected} | {observed} |", flush=True)


def same_second(scratch: Path) -> None:
    root = scratch / "same_second"
    root.mkdir()
    jobs = [[*TINY, "strategy=ddp_gloo", "seed=11", "optim.lr=0.01"], [*TINY, "strategy=ddp_gloo", "seed=22", "optim.lr=0.02"]]
    procs = [train_py(root, *job, wait=False) for job in jobs]
    outs = [p.communicate()[0] for p in procs]
    seeds = [sorted(set(re.findall(r"Seed set to (\d+)", o))) for o in outs]
    found = runs(root)
    folders = sorted(Path(r.data.tags["output_dir"]).name for r in found)
    row("two ddp_gloo runs started at once (seeds 11, 22)", "own folder, config and ranks each",
        f"folders {folders}; seeds per run's ranks {seeds}; {described(found)}")
    procs = [train_py(root, *TINY, f"seed={s}", multirun=True, wait=False) for s in (33, 44)]
    [p.communicate() for p in procs]
    sweeps = sorted({r.data.tags["sweep_id"] for r in runs(root) if "sweep_id" in r.data.tags})
    row("two sweeps started at once", "a sweep_id each", f"{sweeps}")


def killed(scratch: Path) -> None:
    for strategy in ("sequential", "ddp_gloo"):
        root = scratch / f"kill9_{strategy}"
        root.mkdir()
        proc = train_py(root, *TINY, f"strategy={strategy}", "trainer.max_epochs=100", wait=False)
        wait_for(lambda: an_epoch_done(root))
        import psutil

        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)]
        proc.kill()
        proc.wait()
        time.sleep(2)
        left = [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
        before = described(runs(root))
        train_py(root, *TINY, "trainer.fast_dev_run=true")  # the next start against the store
        row(f"kill -9 of train.py ({strategy})", "not RUNNING: FAILED at the next start, no process left",
            f"before: {before}; processes left: {left}; after the next start: {described(runs(root)[:1])}")


def build_errors(scratch: Path) -> None:
    for fault, overrides in (("trainer=gpu without CUDA", ["trainer=gpu"]),
                             ("a typo in a trainer.* value (trainer.precision=bf17)", ["trainer.precision=bf17"]),
                             ("a trainer.* value Lightning refuses (trainer.max_time=abc)", ["trainer.max_time=abc"]),
                             ("+trainer.ckpt_path=x.ckpt", ["+trainer.ckpt_path=x.ckpt"]),
                             ("+trainer.fast_dev_run=true", ["+trainer.fast_dev_run=true"])):
        root = scratch / re.sub(r"\W+", "_", fault)[:40]
        root.mkdir()
        proc = train_py(root, *TINY, *overrides)
        error = next((line for line in proc.stderr.splitlines() if line.startswith("ddlx: error")), "")[:110]
        row(fault, "a clear error; any opened run FAILED", f"exit {proc.returncode}: {error!r}; {described(runs(root))}")
    root = scratch / "fast_dev_run"
    root.mkdir()
    proc = train_py(root, *TINY, "trainer.fast_dev_run=true")
    (run,) = runs(root)
    row("trainer.fast_dev_run=true", "FINISHED, not counted as a measurement",
        f"exit {proc.returncode}; {run.info.status}, measured={run.data.tags.get('measured')}")


def signals(scratch: Path) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        root = scratch / f"signal_{signum.name}"
        root.mkdir()
        job = [*TINY, "strategy=ddp_gloo", "trainer.max_epochs=4", "trainer.limit_train_batches=1.0", "data.num_images=96"]
        proc = train_py(root, *job, wait=False)
        wait_for(lambda: an_epoch_done(root))
        proc.send_signal(signum)
        out = proc.communicate()[0]
        checkpoint = re.search(r"ckpt_path=(\S+)$", out, re.M)
        row(f"{signum.name} to rank 0 of ddp_gloo", f"exit {128 + signum}, KILLED, a checkpoint",
            f"exit {proc.returncode}; {described(runs(root))}; checkpoint {'written' if checkpoint else 'none'}")
        if signum == signal.SIGTERM and checkpoint:
            resumed = train_py(root, *job, f"ckpt_path={checkpoint.group(1)}")
            (run,) = runs(root)
            row("resume it with ckpt_path=", "the same MLflow run goes on to FINISHED",
                f"exit {resumed.returncode}; 1 run, {run.info.status}, resumes={run.data.tags.get('resumes')}, "
                f"measured_epochs={run.data.metrics.get('measured_epochs')}")


def disk_full(scratch: Path) -> None:
    import resource

    root = scratch / "disk_full"
    root.mkdir()

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 2**20, 20 * 2**20))

    proc = train_py(root, *TINY, "model=resnet18", preexec_fn=limit)
    files = [p.name for p in root.glob("outputs/*/*/checkpoints/*")]
    row("the file system refuses the checkpoint past 20 MB", "no truncated file under a valid name",
        f"exit {proc.returncode}; {described(runs(root))}; files in checkpoints/: {files}")


def concurrent(scratch: Path) -> None:
    for attempt in range(3):
        root = scratch / f"concurrent_{attempt}"
        root.mkdir()
        procs = [train_py(root, *TINY, f"seed={s}", "checkpoint.save=none", wait=False) for s in range(4)]
        codes = [p.wait() for p in procs]
        new = f"{len(runs(root))} of 4 recorded, exits {codes}"
        procs = [train_py(root, *TINY, f"seed={s}", "checkpoint.save=none", wait=False) for s in range(4)]
        codes = [p.wait() for p in procs]
        row(f"4 runs at once against a new store, then 4 more (try {attempt + 1})", "all recorded",
            f"new store: {new}; existing: {len(runs(root))} of 8 recorded, exits {codes}")


def checkpoint_size(scratch: Path) -> None:
    root = scratch / "sizes"
    root.mkdir()
    train_py(root, "model=alexnet", "data.num_images=64", "data.batch_size=8", "data.num_workers=0",
             "trainer.limit_train_batches=1", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false")
    files = {p.name: f"{p.stat().st_size / 2**20:.0f} MiB" for p in root.glob("outputs/*/*/checkpoints/*")}
    row("checkpoints of one AlexNet run at 224 px", "one last.ckpt (435 MiB, the README's table)", f"{files}")


def config_errors(scratch: Path) -> None:
    for override in ("seed=abc", "data.image_size=abc", "optim.lr=-1", "data.batch_size=0", "data.batchsize=8",
                     "+data.batchsize=8"):
        start = time.monotonic()
        proc = train_py(scratch, override)
        seconds = time.monotonic() - start
        error = next((line for line in proc.stderr.splitlines() if line.startswith("ddlx: error")), proc.stderr[-200:])
        row(override, "exit 2, key, expected value and fix, no traceback, about a second",
            f"exit {proc.returncode} in {seconds:.1f} s: {error[:120]!r}{' TRACEBACK' if 'Traceback' in proc.stderr else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="scratch folder to use and keep (default: a temporary one)")
    args = parser.parse_args()
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="ddlx-faults-"))
    scratch.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(PROJECT))
    print("| fault | expected | observed |\n|---|---|---|", flush=True)
    for study in (config_errors, same_second, build_errors, killed, signals, disk_full, concurrent, checkpoint_size):
        study(scratch)


if __name__ == "__main__":
    main()
