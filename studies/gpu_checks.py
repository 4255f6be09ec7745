"""Every GPU path of ddlx on one GPU, and the measurements the GPU time model needs (issue 44).

    python studies/gpu_checks.py --out DIR [--only paths compile_layers layers feed overhead] [--budget-s 480]
    python studies/gpu_checks.py --out DIR --only paths --paths "pipe torch" fsdp   # the paths naming these words

One command for a lent GPU machine, whose time is short: each step writes its results under
``--out`` as it goes, and a step that fails or runs out of its share of ``--budget-s`` does not
stop the next.

- ``paths`` (paths.csv, paths.log): train.py with ``trainer=gpu`` on small images for each GPU
  path a user can run on one GPU: sequential in fp32, bf16-mixed and 16-mixed; ``ddp_nccl`` and
  ``fsdp`` with one process; ``split`` and fairscale's ``pipe`` with both stages on ``cuda:0``;
  ``pipe engine=torch`` with each schedule on one GPU (one process: torch's pipelining takes a
  GPU per process); ``compile.enable=true``; a run killed with SIGKILL in its second epoch and
  resumed from its ``last.ckpt``. Per run: exit code, MLflow status, mean epoch seconds,
  samples/s, peak GPU memory.
- ``compile_layers`` (compile_layers.csv, compile_layers.log): what compiling layer by layer gains
  where a step is the GPU's, ResNet-50 bf16-mixed at 224 px, batch 128: ``sequential`` (the whole
  model compiled) and ``fsdp processes=1`` (each block compiled), each eager and compiled.
- ``layers`` (layers.csv, memory.csv): ``benchmarks/gpu_layers.py`` over the seven networks.
- ``feed`` (feed.txt): the whole pipeline, train.py with ResNet-50 bf16-mixed at 224 px, each
  epoch's data wait and compute (decoded images kept in memory and not); then
  ``benchmarks/dataloader.py`` (the loader against the model on in-memory tensors) and
  ``benchmarks/epoch_start.py`` (the wait at each epoch's start).
- ``overhead`` (overhead.txt): ``benchmarks/overhead.py`` on the GPU, ResNet-50 and AlexNet.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")])),
       "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "PYTHONUNBUFFERED": "1"}
SMALL = ["trainer=gpu", "model=resnet18", "data=firesmall", "data.image_size=64", "data.synthetic_size=[72,96]",
         "data.num_images=640", "data.batch_size=64", "data.num_workers=4", "trainer.max_epochs=2",
         "measure.warmup_epochs=1", "trainer.enable_progress_bar=false", "cpu_allocator=system"]
KILL_IMAGES = 12800  # epochs of seconds on one GPU at 64 px, so that the kill lands inside one
ONE_GPU = "strategy.devices=[cuda:0,cuda:0]"
PATHS = {
    "sequential fp32": ["strategy=sequential"],
    "sequential bf16-mixed": ["strategy=sequential", "trainer.precision=bf16-mixed"],
    "sequential 16-mixed": ["strategy=sequential", "trainer.precision=16-mixed"],
    "ddp_nccl processes=1": ["strategy=ddp_nccl", "strategy.processes=1"],
    "ddp_nccl processes=1 bf16-mixed": ["strategy=ddp_nccl", "strategy.processes=1", "trainer.precision=bf16-mixed"],
    "fsdp processes=1": ["strategy=fsdp", "strategy.processes=1"],
    "fsdp processes=1 bf16-mixed": ["strategy=fsdp", "strategy.processes=1", "trainer.precision=bf16-mixed"],
    "split on cuda:0 twice": ["strategy=split", ONE_GPU],
    "pipe fairscale on cuda:0 twice": ["strategy=pipe", ONE_GPU],
    "pipe fairscale bf16-mixed": ["strategy=pipe", ONE_GPU, "trainer.precision=bf16-mixed"],
    **{f"pipe torch {s} on cuda:0": ["strategy=pipe", "strategy.engine=torch", f"strategy.schedule={s}",
                                     "strategy.devices=[cuda:0]"]
       for s in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")},
    "sequential compile.enable=true bf16-mixed": ["strategy=sequential", "compile.enable=true", "trainer.precision=bf16-mixed"],
    "fsdp processes=1 compile.enable=true bf16-mixed": ["strategy=fsdp", "strategy.processes=1", "compile.enable=true",
                                                        "trainer.precision=bf16-mixed"],
    "pipe torch gpipe compile.enable=true bf16-mixed": ["strategy=pipe", "strategy.engine=torch", "strategy.schedule=gpipe",
                                                        "strategy.devices=[cuda:0]", "compile.enable=true",
                                                        "trainer.precision=bf16-mixed"],
}
PATH_FIELDS = ["path", "exit", "status", "wall_s", "mean_epoch_time_s", "mean_samples_per_s", "peak_gpu_mem_mb",
               "compile_s", "note"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="+", default=["paths", "layers", "feed", "overhead"])
    parser.add_argument("--budget-s", type=float, default=480, help="the whole command's seconds")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ddlx-gpu-checks"))
    parser.add_argument("--paths", nargs="+", default=None,
                        help="paths: only the paths whose names contain one of these words (the kill and resume always)")
    return parser.parse_args()


class Budget:
    """Each step's share of the seconds left: a step that overruns is stopped, the next still runs."""

    SHARES = {"paths": 0.40, "compile_layers": 0.55, "layers": 0.27, "feed": 0.18, "overhead": 0.15}

    def __init__(self, seconds: float, steps: list[str]) -> None:
        self.end = time.monotonic() + seconds
        self.steps = steps

    def left(self) -> float:
        return self.end - time.monotonic()

    def for_step(self, step: str) -> float:
        todo = self.steps[self.steps.index(step):]
        return max(10.0, self.left() * self.SHARES[step] / sum(self.SHARES[s] for s in todo))


def run(cmd: list[str], log: Path, timeout: float, cwd: Path | None = None) -> tuple[int, float, str]:
    """(exit code, seconds, last lines); 124 when stopped at ``timeout``."""
    start = time.monotonic()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                                  cwd=cwd or PROJECT, timeout=max(1.0, timeout), start_new_session=True)
            code, text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as err:
            code, text = 124, (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        out.write(text)
    tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
    return code, time.monotonic() - start, tail


def latest_run(root: Path):
    from ddlx.tracking import load_runs

    try:
        return load_runs(f"sqlite:///{root / 'mlflow.db'}", ["ddlx"])[0]
    except (ValueError, IndexError):
        return None


def path_row(name: str, code: int, wall: float, tail: str, root: Path) -> dict:
    found = latest_run(root)
    metrics = found.metrics if found else {}
    peaks = [v for k, v in metrics.items() if k.startswith("peak_gpu_mem_mb")]
    return {"path": name, "exit": code, "status": found.status if found else "no run", "wall_s": f"{wall:.1f}",
            "mean_epoch_time_s": f"{metrics.get('mean_epoch_time_s', float('nan')):.3f}",
            "mean_samples_per_s": f"{metrics.get('mean_samples_per_s', float('nan')):.1f}",
            "peak_gpu_mem_mb": f"{max(peaks):.0f}" if peaks else "", "compile_s": f"{metrics.get('compile_s', 0):.1f}",
            "note": "" if code == 0 else tail[-300:]}


def train_py(root: Path, overrides: list[str], log: Path, timeout: float, data_dir: Path | None = None):
    root.mkdir(parents=True, exist_ok=True)
    return run([sys.executable, str(PROJECT / "train.py"), *overrides, f"paths.root={root}",
                f"paths.data_dir={data_dir or root.parent / 'data'}"], log, timeout, cwd=root)


def paths(args, seconds: float) -> None:
    end = time.monotonic() + seconds
    log, table = args.out / "paths.log", args.out / "paths.csv"
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, PATH_FIELDS)
        writer.writeheader()
        jobs = [(name, overrides) for name, overrides in PATHS.items()
                if args.paths is None or any(word in name for word in args.paths)]
        for i, (name, overrides) in enumerate(jobs):
            left = end - time.monotonic() - 40  # keep time for the kill and resume
            if left < 10:
                writer.writerow({"path": name, "note": "not run: out of time"})
                continue
            root = args.work / f"path{i}"
            code, wall, tail = train_py(root, [*SMALL, *overrides], log, min(left, 120))
            writer.writerow(path_row(name, code, wall, tail, root))
            f.flush()
        for row in kill_and_resume(args, log, end):
            writer.writerow(row)


def kill_and_resume(args, log: Path, end: float) -> list[dict]:
    """SIGKILL to train.py in its second epoch (its first epoch's last.ckpt on disk), then ckpt_path=."""
    root = args.work / "kill"
    root.mkdir(parents=True, exist_ok=True)
    job = [*(o for o in SMALL if not o.startswith(("trainer.max_epochs=", "data.num_images="))), "strategy=sequential",
           "trainer.max_epochs=6", f"data.num_images={KILL_IMAGES}", "checkpoint.background=false"]
    cmd = [sys.executable, str(PROJECT / "train.py"), *job, f"paths.root={root}", f"paths.data_dir={root.parent / 'data'}"]
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}  (killed)\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=root, start_new_session=True)
    started = time.monotonic()
    checkpoint = None
    while time.monotonic() < end - 25 and proc.poll() is None:
        checkpoint = next(root.glob("outputs/*/*/checkpoints/last.ckpt"), None)
        if checkpoint is not None:
            break
        time.sleep(0.2)
    if checkpoint is None or proc.poll() is not None:
        proc.kill()
        return [{"path": "kill -9 in epoch 2", "exit": proc.wait(), "note": "no last.ckpt before the end or the time"}]
    time.sleep(1.0)  # into the next epoch
    os.killpg(proc.pid, 9)
    killed = {"path": "kill -9 in epoch 2", "exit": proc.wait(), "wall_s": f"{time.monotonic() - started:.1f}"}
    time.sleep(6)  # ddlx.run_watch marks the run FAILED
    found = latest_run(root)
    killed["status"] = found.status if found else "no run"
    code, wall, tail = train_py(root, [*job, f"ckpt_path={checkpoint}"], log, max(10, end - time.monotonic()))
    resumed = path_row("resumed with ckpt_path=", code, wall, tail, root)
    resumed["note"] = (resumed["note"] + f" runs in store: {count_runs(root)}").strip()
    return [killed, resumed]


BIG = ["trainer=gpu", "model=resnet50", "data=firesmall", "data.image_size=224", "data.synthetic_size=[72,96]",
       "data.num_images=2560", "data.batch_size=128", "data.cache=auto", "trainer.precision=bf16-mixed",
       "trainer.max_epochs=4", "measure.warmup_epochs=1", "trainer.limit_val_batches=0",
       "trainer.enable_progress_bar=false", "checkpoint.save=none", "cpu_allocator=system"]
COMPILE_PAIRS = {"sequential eager": ["strategy=sequential"],
                 "fsdp processes=1 eager": ["strategy=fsdp", "strategy.processes=1"],
                 "sequential compiled": ["strategy=sequential", "compile.enable=true"],
                 "fsdp processes=1 compiled (each block)": ["strategy=fsdp", "strategy.processes=1", "compile.enable=true"]}


def compile_layers(args, seconds: float) -> None:
    """Eager against compiled where the GPU sets the step: the whole model, and each block under fsdp.
    The eager runs first (they also make the data), the compiled after: a compile that runs out of
    time still leaves both eager figures."""
    end = time.monotonic() + seconds
    log, table = args.out / "compile_layers.log", args.out / "compile_layers.csv"
    workers = max(1, (os.cpu_count() or 2) - 1)
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, PATH_FIELDS)
        writer.writeheader()
        for i, (name, overrides) in enumerate(COMPILE_PAIRS.items()):
            left = end - time.monotonic()
            if left < 20:
                writer.writerow({"path": name, "note": "not run: out of time"})
                continue
            root = args.work / f"compile{i}"
            lines_before = log.read_text().count("\n") if log.exists() else 0
            code, wall, tail = train_py(root, [*BIG, f"data.num_workers={workers}", *overrides], log, left)
            row = path_row(name, code, wall, tail, root)
            eager_layers = sum("recompile" in line for line in log.read_text().splitlines()[lines_before:])
            row["note"] = (row["note"] + f" lines naming recompile: {eager_layers}").strip()
            writer.writerow(row)
            f.flush()


def count_runs(root: Path) -> int:
    from ddlx.tracking import load_runs

    return len(load_runs(f"sqlite:///{root / 'mlflow.db'}", ["ddlx"]))


def layers(args, seconds: float) -> None:
    code, wall, tail = run([sys.executable, str(PROJECT / "benchmarks" / "gpu_layers.py"), "--out",
                            str(args.out / "layers.csv"), "--memory-out", str(args.out / "memory.csv")],
                           args.out / "checks.log", seconds)
    print(f"layers: exit {code} after {wall:.0f} s {tail if code else ''}", flush=True)


FEED_IMAGES, FEED_SIZE, FEED_BATCH = 16000, (300, 500), 256
FEED_DATA = ["data=firesmall", f"data.num_images={FEED_IMAGES}", f"data.synthetic_size=[{FEED_SIZE[0]},{FEED_SIZE[1]}]",
             f"data.batch_size={FEED_BATCH}"]
FEED_ARGS = ["--num-images", str(FEED_IMAGES), "--synthetic-size", *map(str, FEED_SIZE), "--batch-size", str(FEED_BATCH)]


def feed(args, seconds: float) -> None:
    """The whole pipeline first (train.py, decoded images kept and not), then the loader and the
    model apart (benchmarks/dataloader.py), then each epoch's start (benchmarks/epoch_start.py).
    One synthetic set for all three: the benchmarks' default data folder."""
    end = time.monotonic() + seconds
    out = args.out / "feed.txt"
    workers = max(1, (os.cpu_count() or 2) - 1)
    data_dir = PROJECT / "data"
    # the first run also generates the 16000 images (about 50 s on the H200): the fifth sitting's 0.35
    # of 290 s stopped it in its last epoch
    for cache, share in (("auto", 0.42), ("none", 0.18)):
        overrides = ["trainer=gpu", "model=resnet50", *FEED_DATA, f"data.num_workers={workers}", "data.pin_memory=true",
                     f"data.cache={cache}", "trainer.precision=bf16-mixed", "trainer.max_epochs=4",
                     "measure.warmup_epochs=1", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
                     "checkpoint.save=none", "cpu_allocator=system"]
        root = args.work / f"feed_{cache}"
        code, wall, tail = train_py(root, overrides, out, seconds * share, data_dir=data_dir)
        with open(out, "a") as f:
            f.write(f"\nwhole pipeline, data.cache={cache}, {workers} workers: exit {code}, {wall:.0f} s\n")
            f.write(epoch_figures(root))
    left = end - time.monotonic()
    code, wall, tail = run([sys.executable, str(PROJECT / "benchmarks" / "dataloader.py"), "--model", "resnet50",
                            "--device", "cuda", "--precision", "bf16-mixed", "--workers", str(workers), "--threads", "1",
                            "--cache", "none", "auto", "--pin-memory", "--batches", "16", *FEED_ARGS], out, left * 0.6)
    print(f"feed loader: exit {code} after {wall:.0f} s", flush=True)
    # a 105 ms step with the host idle: ResNet-50 bf16-mixed's at batch 256 on an H200 (2428 images/s)
    code, wall, tail = run([sys.executable, str(PROJECT / "benchmarks" / "epoch_start.py"), "--workers", str(workers), *FEED_ARGS,
                            "--cache", "auto", "--pin-memory", "--step-ms", "105", "--epochs", "3", "--rounds", "1"],
                           out, end - time.monotonic())
    print(f"feed epoch start: exit {code} after {wall:.0f} s", flush=True)


def epoch_figures(root: Path) -> str:
    """Each epoch's time, data wait, compute and samples/s of the run in ``root``'s store."""
    found = latest_run(root)
    if found is None:
        return "  no run recorded\n"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    keys = ("epoch_time_s", "data_wait_s", "compute_s", "samples_per_s")
    history = {key: [m.value for m in sorted(client.get_metric_history(found.run_id, key), key=lambda m: m.step)]
               for key in keys}
    lines = [f"  {found.status}; mean_samples_per_s {found.metrics.get('mean_samples_per_s', float('nan')):.1f}"]
    lines += [f"  epoch {i + 1}: " + ", ".join(f"{key} {history[key][i]:.3f}" for key in keys if i < len(history[key]))
              for i in range(max(map(len, history.values()), default=0))]
    return "\n".join(lines) + "\n"


def overhead(args, seconds: float) -> None:
    code, wall, tail = run([sys.executable, str(PROJECT / "benchmarks" / "overhead.py"), "--models", "resnet50", "alexnet",
                            "--image-size", "224", "--batch-size", "128", "--device", "cuda", "--precision",
                            "bf16-mixed", "--steps", "20", "--rounds", "3"], args.out / "overhead.txt", seconds)
    print(f"overhead: exit {code} after {wall:.0f} s", flush=True)


STEPS = {"paths": paths, "compile_layers": compile_layers, "layers": layers, "feed": feed, "overhead": overhead}


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s, args.only)
    for step in args.only:
        seconds = budget.for_step(step)
        started = time.monotonic()
        try:
            STEPS[step](args, seconds)
        except Exception as err:  # noqa: BLE001 -- the next step still runs; the error is in the output
            print(f"{step}: {type(err).__name__}: {err}", flush=True)
        print(f"{step}: {time.monotonic() - started:.0f} s of {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
