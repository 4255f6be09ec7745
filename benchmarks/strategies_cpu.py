"""Epoch time of the CPU strategies on one model and dataset, measured in one sitting.

    python benchmarks/strategies_cpu.py                       # AlexNet 224x224, firesmall, batch 32
    python benchmarks/strategies_cpu.py --model vgg11 --epochs 2 --num-images 400
    python benchmarks/strategies_cpu.py --model resnet18 --image-size 128
    python benchmarks/strategies_cpu.py --neighbour --only "sequential threads=1" "cpu_mp processes=2" \
        "cpu_mp processes=2 pin_cores=false"            # beside a process that keeps one core busy
    python benchmarks/strategies_cpu.py --model vgg11 --num-images 80 --pipe-balance auto --only \
        "sequential threads=1" "sequential threads=2" "pipe chunks=4 [cpu,cpu]" "pipe torch gpipe chunks=4" ...

Each setup is one ``train.py`` run (its own MLflow run in the ``benchmark-strategies``
experiment of ``--tracking-uri``, by default the project's mlflow.db). The table gives the mean ``epoch_time_s`` over the
epochs after the first (warm-up) one and the speedup over the one-core sequential baseline of
the same sitting (the Lerat et al. entry, section 2: mean baseline time / mean setup time). This machine is
shared and noisy: compare the ratios, and repeat with --rounds to see the spread.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "benchmark-strategies"

SETUPS = {
    "sequential threads=1": ["strategy=sequential", "strategy.threads=1"],
    "sequential threads=2": ["strategy=sequential", "strategy.threads=2"],
    "threads k=2": ["strategy=threads", "strategy.threads=2"],
    "cpu_mp processes=2": ["strategy=cpu_mp", "strategy.processes=2"],
    "cpu_mp processes=2 split_linear=never": ["strategy=cpu_mp", "strategy.processes=2", "strategy.split_linear=never"],
    "cpu_mp processes=2 pin_cores=false": ["strategy=cpu_mp", "strategy.processes=2", "strategy.pin_cores=false"],
    "ddp_gloo processes=2": ["strategy=ddp_gloo", "strategy.processes=2"],
    "pipe chunks=4 [cpu,cpu]": ["strategy=pipe", "strategy.chunks=4"],  # fairscale: one worker thread for both stages
    # PyTorch's pipelining: one process per stage, one core each.
    **{f"pipe torch {schedule} chunks={chunks}": ["strategy=pipe", "strategy.engine=torch", f"strategy.schedule={schedule}",
                                                  f"strategy.chunks={chunks}"]
       for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble") for chunks in (4, 8, 16)},
}


def run_setup(name: str, overrides: list[str], args: argparse.Namespace, sweep: str) -> tuple[list[float], float]:
    """Epoch times (after the first) of one train.py run of ``name``, and its peak RAM (MB)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    if args.pipe_balance and "strategy=pipe" in overrides:
        overrides = [*overrides, f"strategy.balance={args.pipe_balance}"]
    cmd = [
        sys.executable, str(ROOT / "train.py"), *overrides,
        f"model={args.model}", f"data={args.data}", f"data.num_images={args.num_images}",
        f"data.batch_size={args.batch_size}", f"data.cache={args.cache}",
        *([f"data.num_workers={args.num_workers}"] if args.num_workers is not None else []),
        *([f"data.image_size={args.image_size}"] if args.image_size else []),
        f"trainer.max_epochs={args.epochs}", f"measure.warmup_epochs={int(args.epochs > 1)}",  # as the table: runs for the report
        "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
        "checkpoint.save=none", f"logger.experiment_name={EXPERIMENT}",
        f"+logger.tags.bench_round={sweep}", f"+logger.tags.bench_setup={slug}", *args.set,
        f"logger.tracking_uri={args.tracking_uri}",  # after --set: the store the runs are read back from
    ]
    neighbour = start_neighbour() if args.neighbour else None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{name} failed")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(args.tracking_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    (run,) = client.search_runs([exp.experiment_id], f"tags.bench_round = '{sweep}' and tags.bench_setup = '{slug}'")
    history = sorted(client.get_metric_history(run.info.run_id, "epoch_time_s"), key=lambda m: m.step)
    times = [m.value for m in history]
    return (times[1:] if len(times) > 1 else times), run.data.metrics.get("peak_ram_mb", float("nan"))


def start_neighbour() -> subprocess.Popen:
    """What shares a user's node with a run: one process keeping one core busy (a loader, a
    monitoring agent, another job), placed wherever the OS puts it, for the whole run."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--data", default="firesmall")
    parser.add_argument("--num-images", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, help="data.image_size (default: the dataset's, 224 for firesmall)")
    parser.add_argument("--num-workers", type=int, help="loader workers per process (0: load in the training process; "
                        "default: the dataset's own, as train.py runs it)")
    parser.add_argument("--cache", default="auto", choices=("auto", "none"),
                        help="data.cache: auto keeps the decoded images in memory when they fit; none decodes them every epoch")
    parser.add_argument("--epochs", type=int, default=2, help="the first is warm-up when there are several")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every setup, interleaved, this many times")
    parser.add_argument("--only", nargs="*", help="names from: " + "; ".join(SETUPS))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more train.py overrides, for every setup (e.g. optim.lr=0.001)")
    parser.add_argument("--neighbour", action="store_true",
                        help="run every setup beside a process that keeps one core busy (a shared node)")
    parser.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlflow.db'}",
                        help="the MLflow store the runs are logged to and read back from (default: train.py's, the project's mlflow.db)")
    parser.add_argument("--pipe-balance", help="strategy.balance of the pipe setups (auto: by profiled time; "
                        "default: the model's split point)")
    args = parser.parse_args()

    chosen = {k: v for k, v in SETUPS.items() if not args.only or k in args.only}
    sweep = time.strftime("%Y%m%d-%H%M%S")
    times: dict[str, list[float]] = {name: [] for name in chosen}
    peaks: dict[str, list[float]] = {name: [] for name in chosen}
    for r in range(args.rounds):
        for name, overrides in chosen.items():
            epochs, peak = run_setup(name, overrides, args, f"{sweep}-{r}")
            times[name] += epochs
            peaks[name].append(peak)
            print(f"  round {r + 1}: {name}: {statistics.mean(times[name]):.2f} s/epoch", file=sys.stderr)

    base = statistics.mean(times.get("sequential threads=1") or [float("nan")])
    print(f"\n{args.model} {args.data} {_size(args)} ({args.num_images} images, batch {args.batch_size}, {_workers(args)} loader workers, "
          f"data.cache={args.cache}) on {_cores()} cores{', beside one busy process' if args.neighbour else ''}")
    print(f"{'setup':28s} {'epoch s':>9s} {'min':>7s} {'max':>7s} {'speedup':>8s} {'peak RAM MB':>12s}")
    for name, values in times.items():
        mean = statistics.mean(values)
        print(f"{name:28s} {mean:9.2f} {min(values):7.2f} {max(values):7.2f} {base / mean:8.2f}x {max(peaks[name]):12.0f}")


def _size(args: argparse.Namespace) -> str:
    return f"{args.image_size} px" if args.image_size else "at its own size"


def _workers(args: argparse.Namespace) -> str:
    return str(args.num_workers) if args.num_workers is not None else f"the {args.data} default"


def _cores() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
