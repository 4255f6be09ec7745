"""Can the data loader keep up? Images/s the fire datamodule delivers vs images/s AlexNet trains.

    python benchmarks/dataloader.py                        # firesmall at 224x224, batch 32
    python benchmarks/dataloader.py --workers 0 1 2 4 --threads 1 2 --batches 20

Delivery: the datamodule's training loader (JPEG decode, resize, normalise, flip, as in every
run) for each loader-worker count, timed on its own: the first batch (worker start-up) apart,
then the steady rate over the rest. Consumption: AlexNet's training step (hand-written loop,
benchmarks/handloop.py) on in-memory tensors of the same shape, for each thread count. The
last table divides the two: below 1.0 the loader starves the model (training waits on data,
as ``data_wait_s`` shows in the runs). On a machine with few cores, loader workers and
compute threads share the cores: the two are measured apart, so the ratio is the best case.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from handloop import hand_written_epoch, sgd  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="firesmall")
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-images", type=int, default=400)
    parser.add_argument("--batches", type=int, default=10, help="batches timed per loader setting")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    return parser.parse_args()


def data_config(args: argparse.Namespace, workers: int):
    from hydra import compose, initialize_config_dir

    from ddlx.cli import register_config

    register_config(ROOT)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            f"data={args.data}", f"data.image_size={args.image_size}", f"data.batch_size={args.batch_size}",
            f"data.num_images={args.num_images}", f"data.num_workers={workers}",
        ])
    return cfg.data


def delivery(args: argparse.Namespace, workers: int) -> tuple[float, float]:
    """(seconds to the first batch, images/s over the following batches)."""
    from ddlx.run import build_datamodule

    dm = build_datamodule(data_config(args, workers))
    dm.prepare_data()
    dm.setup("fit")
    loader = dm.train_dataloader()
    available = len(loader) - 1
    if available < 2:
        raise SystemExit(f"--num-images={args.num_images} gives {available + 1} training batches; need 3 or more")
    wanted = min(args.batches, available)
    start = time.perf_counter()
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - start
    start, images = time.perf_counter(), 0
    for _ in range(wanted):
        images += len(next(batches)[0])
    return first, images / (time.perf_counter() - start)


def consumption(args: argparse.Namespace, threads: int) -> float:
    """Images/s of the model's training step at ``threads`` intra-op threads."""
    from ddlx.models import build_model

    torch.set_num_threads(threads)
    model = build_model(args.model, 3, 3, args.image_size, None)
    images = torch.randn(args.batch_size * 6, 3, args.image_size, args.image_size)
    loader = DataLoader(TensorDataset(images, torch.randint(0, 3, (len(images),))), batch_size=args.batch_size)
    opt = sgd(model)
    hand_written_epoch(model, [next(iter(loader))], opt)  # warm-up step
    seconds, steps = hand_written_epoch(model, loader, opt)
    return steps * args.batch_size / seconds


def main() -> None:
    args = parse_args()
    threads_before = torch.get_num_threads()
    delivered = {w: delivery(args, w) for w in args.workers}
    consumed = {t: consumption(args, t) for t in args.threads}
    torch.set_num_threads(threads_before)

    print(f"\n{args.data} at {args.image_size}x{args.image_size}, batch {args.batch_size}; {args.model} training step\n")
    print("| loader workers | first batch s | images/s delivered |")
    print("|---|---|---|")
    for w, (first, rate) in delivered.items():
        print(f"| {w} | {first:.2f} | {rate:.1f} |")
    print(f"\n| {args.model} threads | images/s consumed |")
    print("|---|---|")
    for t, rate in consumed.items():
        print(f"| {t} | {rate:.1f} |")
    print("\ndelivered / consumed (below 1.0: the loader starves training)\n")
    print("| loader workers | " + " | ".join(f"{t} thread(s)" for t in args.threads) + " |")
    print("|---|" + "---|" * len(args.threads))
    for w, (_, rate) in delivered.items():
        print(f"| {w} | " + " | ".join(f"{rate / consumed[t]:.2f}" for t in args.threads) + " |")


if __name__ == "__main__":
    main()
