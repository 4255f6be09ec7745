"""Re-run the faults of issues 18 ("Runs you can trust") and 40 ("A run survives what the machine
does to it") against train.py as a user would, and print a table: fault | expected | observed.
Each fault runs in its own scratch project folder.

    python studies/faults.py [--keep DIR] [--only NAME ...]

About 12 minutes on 2 cores (most of it train.py starting: torch, Lightning, MLflow).
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


# ---- issue 40 -----------------------------------------------------------------------------------


def noise(text: str) -> str:
    """What a run printed that a user did not ask for: Lightning's srun hint, OpenMPI's banner, tracebacks."""
    found = {"srun hint": text.count("The `srun` command is available"), "MPI_ABORT": text.count("MPI_ABORT was invoked"),
             "Traceback": text.count("Traceback (most recent call last)")}
    return ", ".join(f"{k} x{v}" for k, v in found.items() if v) or "none"


def alive(processes) -> list:
    import psutil

    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def kill_9_and_resume(scratch: Path) -> None:
    """1, 3 and 9: a checkpoint at every epoch end; every process of the run ends with rank 0; the
    run is closed without another command; no orted beside a run that is not MPI."""
    import psutil
    import torch

    for strategy in ("sequential", "ddp_gloo"):
        root = scratch / f"i40_kill9_{strategy}"
        root.mkdir()
        job = [*TINY, "checkpoint.save=full", f"strategy={strategy}", "data.num_workers=2", "data.num_images=96",
               "trainer.limit_train_batches=1.0", "trainer.max_epochs=20"]
        proc = train_py(root, *job, wait=False)
        wait_for(lambda: len(runs(root)) and sum("epoch_time_s" in r.data.metrics for r in runs(root)) and
                 next(root.glob("outputs/*/*/checkpoints/last.ckpt"), None) is not None)
        time.sleep(3)  # into the next epochs
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = sorted(p.name() for p in tree)
        watch = [p for p in tree if "ddlx.run_watch" in " ".join(p.cmdline())]
        others = [p for p in tree if p not in watch]
        proc.kill()
        killed_at = time.monotonic()
        proc.wait()
        wait_for(lambda: not alive(others), 15)
        gone_s = time.monotonic() - killed_at
        wait_for(lambda: runs(root) and runs(root)[0].info.status != "RUNNING", 60)
        closed_s = time.monotonic() - killed_at
        status = described(runs(root))
        checkpoint = next(root.glob("outputs/*/*/checkpoints/last.ckpt"))
        epoch = torch.load(checkpoint, map_location="cpu", weights_only=True)["epoch"]
        row(f"kill -9 of train.py ({strategy}, 2 loader workers) in its epoch {epoch + 1}",
            "every process gone within 5 s; run FAILED without another command; last.ckpt of the last epoch end",
            f"{len(others)} processes ({', '.join(names)}) gone after {gone_s:.1f} s; {status} after {closed_s:.1f} s; "
            f"last.ckpt holds epoch {epoch}")
        resumed = train_py(root, *job[:-1], f"trainer.max_epochs={epoch + 2}", f"ckpt_path={checkpoint}")
        (run,) = runs(root)
        row(f"resume it with ckpt_path= ({strategy})", "the same run goes on to FINISHED",
            f"exit {resumed.returncode}; 1 run, {run.info.status}, resumes={run.data.tags.get('resumes')}; "
            f"noise: {noise(resumed.stdout + resumed.stderr)}")


def stop_in_validation(scratch: Path) -> None:
    """2: SIGTERM to the whole process group (timeout, Ctrl-C, a scheduler) during validation."""
    for attempt in range(3):
        root = scratch / f"i40_validation_{attempt}"
        root.mkdir()
        sent = root / "sent"
        cmd = [sys.executable, str(PROJECT / "tests" / "train_signalled.py"), "validation", "SIGTERM", *TINY,
               "checkpoint.save=full", "data.num_workers=2", "trainer.max_epochs=4", f"paths.root={root}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, "DDLX_SIGNAL_SENT": str(sent)}, cwd=root,
                              timeout=600, start_new_session=True)
        took = time.time() - float(sent.read_text()) if sent.exists() else float("nan")
        row(f"SIGTERM to the process group during validation, 2 loader workers (try {attempt + 1})",
            "exit 143 within 10 s, KILLED, a checkpoint",
            f"exit {proc.returncode} {took:.1f} s after the signal; {described(runs(root))}; "
            f"checkpoint {'written' if 'ckpt_path=' in proc.stderr else 'none'}")
    root = scratch / "i40_timeout"
    root.mkdir()
    start = time.monotonic()
    proc = subprocess.run(["timeout", "40", sys.executable, str(PROJECT / "train.py"), *TINY, "checkpoint.save=full",
                           "data.num_workers=2", "trainer.max_epochs=-1", "trainer.limit_train_batches=1.0",
                           f"paths.root={root}"], capture_output=True, text=True, env=ENV, cwd=root, timeout=600)
    row("timeout 40 python train.py trainer.max_epochs=-1 (workers 2)", "exit 124 (timeout's) soon after 40 s, KILLED",
        f"exit {proc.returncode} after {time.monotonic() - start:.1f} s; {described(runs(root))}")


def error_lines(scratch: Path) -> None:
    """4, 5, 6, 7: one line where a user needs one."""
    root = scratch / "i40_errors"
    root.mkdir()
    (root / "mlflow.db").write_bytes(os.urandom(5000))
    proc = subprocess.run([sys.executable, "-m", "ddlx.report", "--tracking-uri", f"sqlite:///{root / 'mlflow.db'}"],
                          capture_output=True, text=True, env=ENV, cwd=root)
    row("python -m ddlx.report on a damaged mlflow.db", "exit 2, one line", f"exit {proc.returncode}: {proc.stderr.strip()[:150]!r}")
    for fault, overrides in (("hydra.run.dir where no folder can be made", ["hydra.run.dir=/proc/ddlx-run"]),
                             ("ckpt_path= a run's folder", [f"ckpt_path={root}"])):
        proc = train_py(root, *TINY, *overrides)
        row(fault, "exit 2, one line", f"exit {proc.returncode}: {proc.stderr.strip()[:150]!r}")
    for override in ("hw=nosuch", "model=nosuch", "hw=schema"):
        proc = subprocess.run([sys.executable, str(PROJECT / "recommend.py"), override, f"paths.root={root}"],
                              capture_output=True, text=True, env=ENV, cwd=root)
        row(f"recommend.py {override}", "exit 2, one line with the options", f"exit {proc.returncode}: {proc.stderr.strip()[:150]!r}")
    data = root / "folders"
    from PIL import Image

    for name in ("good", "corrupt"):
        for label in ("a", "b"):
            (data / name / label).mkdir(parents=True)
            for i in range(12):
                Image.new("RGB", (40, 40), (i * 20, 0, 0) if label == "a" else (0, i * 20, 0)).save(data / name / label / f"{i}.png")
    (data / "corrupt" / "a" / "0.png").write_bytes(b"not a png")
    sweep = root / "sweep"
    sweep.mkdir()
    proc = train_py(sweep, *TINY, "data=imagefolder", f"data.root={data / 'corrupt'},{data / 'good'}", multirun=True)
    row("-m data.root=<corrupt folder>,<good folder>", "one line for the refused job, its FAILED run, exit 1",
        f"exit {proc.returncode}; {described(runs(sweep))}; noise: {noise(proc.stdout + proc.stderr)}; "
        f"lines saying ddlx: error: {proc.stderr.count('ddlx: error:')}")
    import resource

    full = root / "disk_full"
    full.mkdir()
    proc = train_py(full, *TINY, "model=resnet18", "checkpoint.save=full",
                    preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 2**20, 20 * 2**20)))
    error = next((line for line in proc.stderr.splitlines() if line.startswith("ddlx: error")), "")[:130]
    row("a checkpoint the file system refuses (past 20 MB)", "exit 1, one line, FAILED run, no truncated file",
        f"exit {proc.returncode}: {error!r}; noise: {noise(proc.stdout + proc.stderr)}; {described(runs(full))}; "
        f"files: {[p.name for p in full.glob('outputs/*/*/checkpoints/*')]}")


def refused_fast(scratch: Path) -> None:
    """8: config-only errors before torch loads."""
    for override in ("trainer.max_epochs=0", "trainer=gpu", "strategy=ddp_gloo strategy.processes=99",
                     "strategy=cpu_mp strategy.processes=99"):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(PROJECT / "train.py"), *override.split(), f"paths.root={scratch}"],
                              capture_output=True, text=True, env={**ENV, "CUDA_VISIBLE_DEVICES": ""}, cwd=scratch)
        row(f"{override} (no GPU)", "refused in about a second, before torch loads",
            f"exit {proc.returncode} in {time.monotonic() - start:.1f} s: {proc.stderr.strip()[:110]!r}")


def quiet_run(scratch: Path) -> None:
    """9: a sequential run prints no srun hint, starts no orted."""
    import psutil

    root = scratch / "i40_quiet"
    root.mkdir()
    proc = train_py(root, *TINY, "trainer.max_epochs=3", wait=False)
    seen: set[str] = set()
    while proc.poll() is None:
        try:
            seen |= {p.name() for p in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.Error:
            pass
        time.sleep(0.2)
    out = proc.stdout.read()
    row("a sequential run with slurm-wlm and OpenMPI installed", "no srun hint, no orted, no MPI banner",
        f"exit {proc.returncode}; noise: {noise(out)}; child processes seen: {sorted(seen) or 'none'}")


STUDIES = (config_errors, same_second, build_errors, killed, signals, disk_full, concurrent, checkpoint_size,
           kill_9_and_resume, stop_in_validation, error_lines, refused_fast, quiet_run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="scratch folder to use and keep (default: a temporary one)")
    parser.add_argument("--only", nargs="*", choices=[s.__name__ for s in STUDIES], help="these studies only")
    args = parser.parse_args()
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="ddlx-faults-"))
    scratch.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(PROJECT))
    print("| fault | expected | observed |\n|---|---|---|", flush=True)
    for study in STUDIES:
        if not args.only or study.__name__ in args.only:
            study(scratch)


if __name__ == "__main__":
    main()
