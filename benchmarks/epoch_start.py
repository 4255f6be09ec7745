"""The wait for data at each epoch's start: the training loader, whose workers read the next
epoch ahead (ddlx/data/spanning.py), against a plain DataLoader with the same workers.

    python benchmarks/epoch_start.py                                  # firesmall 224 px, batch 32, 1 worker
    python benchmarks/epoch_start.py --workers 15 --batch-size 256 --step-ms 105 --num-images 16000 \
        --synthetic-size 300 500 --cache auto                         # a GPU node: ResNet-50 bf16 on an H200

The consumer is a step of ``--step-ms`` in which the host does nothing (as it waits for a GPU),
so the loader's workers have the cores: pick it at or above the time the workers take for a
batch (benchmarks/dataloader.py), or every step waits, read ahead or not. Both loaders come from
the same datamodule (same samples, order, flips), both with persistent workers; they alternate
over ``--rounds``, each round ``--epochs`` epochs. Per loader, medians over the epochs after each
round's first: the wait for an epoch's first batch, the wait over the whole epoch, and the share
of the epoch that was steps (1.0: data never waited for).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="firesmall")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-images", type=int, default=400)
    parser.add_argument("--synthetic-size", type=int, nargs=2, default=None, help="data.synthetic_size: shortest, longest side")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cache", default="none", help="data.cache")
    parser.add_argument("--pin-memory", action="store_true")
    parser.add_argument("--step-ms", type=float, default=400.0, help="the consumer's step, host idle")
    parser.add_argument("--epochs", type=int, default=4, help="epochs a round; the first is left out")
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args()


def epochs(loader, count: int, step_s: float) -> list[tuple[float, float, float]]:
    """(first batch's wait, whole epoch's wait, epoch seconds) per epoch, as Lightning's loop
    asks: the sampler's epoch set, then ``iter()``, then every batch."""
    out = []
    for epoch in range(count):
        loader.batch_sampler.sampler.set_epoch(epoch)
        start = time.perf_counter()
        waits, batches = [], iter(loader)
        while True:
            asked = time.perf_counter()
            try:
                next(batches)
            except StopIteration:
                break
            waits.append(time.perf_counter() - asked)
            time.sleep(step_s)
        out.append((waits[0], sum(waits), time.perf_counter() - start))
    return out


def main() -> None:
    args = parse_args()
    from dataloader import data_config

    from ddlx.data.datamodule import build_datamodule

    dm = build_datamodule(data_config(args, args.workers, args.cache))
    dm.prepare_data()
    dm.setup("fit")
    step_s = args.step_ms / 1000
    loaders = {
        "reads ahead (training loader)": lambda: dm.train_dataloader(),
        "plain DataLoader": lambda: dm._loader(dm.train_set, shuffle=dm.data.shuffle, resumable=False),
    }
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in loaders}
    steps = None
    for _ in range(args.rounds):
        for name, make in loaders.items():
            loader = make()
            steps = len(loader)
            results[name] += epochs(loader, args.epochs, step_s)[1:]
            dm.end_workers()
    print(f"\n{args.data} at {args.image_size} px, batch {args.batch_size}, {args.workers} worker(s), data.cache={args.cache}, "
          f"{steps} steps an epoch of {args.step_ms:.0f} ms (host idle); medians over {args.rounds} x {args.epochs - 1} epochs "
          f"(each round's first left out)\n")
    print("| loader | first batch wait s | epoch wait s | epoch s | steps' share of the epoch |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        first, wait, seconds = (statistics.median(column) for column in zip(*rows))
        print(f"| {name} | {first:.3f} | {wait:.3f} | {seconds:.2f} | {steps * step_s / seconds:.3f} |")


if __name__ == "__main__":
    main()
