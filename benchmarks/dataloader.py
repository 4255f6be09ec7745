"""Can the data loader keep up? Images/s the fire datamodule delivers vs images/s AlexNet trains.

    python benchmarks/dataloader.py                        # firesmall at 224x224, batch 32
    python benchmarks/dataloader.py --workers 0 1 2 4 --threads 1 2 --batches 20
    python benchmarks/dataloader.py --model resnet50 --device cuda --precision bf16-mixed --batch-size 256 \
        --workers 15 --cache none auto --pin-memory --num-images 6400 --synthetic-size 300 500   # a GPU node

Delivery: the datamodule's training loader (JPEG decode, resize, normalise, flip, as in every
run) for each loader-worker count, timed on its own: the first batch (worker start-up) apart,
then the batches the workers could have made ahead while the first was awaited (2 per worker,
the loader's prefetch) skipped, then the steady rate over ``--batches`` more. Consumption: AlexNet's training step (hand-written loop,
benchmarks/handloop.py) on in-memory tensors of the same shape, for each thread count. The
last table divides the two: below 1.0 the loader starves the model (training waits on data,
as ``data_wait_s`` shows in the runs). On a machine with few cores, loader workers and
compute threads share the cores: the two are measured apart, so the ratio is the best case.
On a GPU (``--device cuda``) the model trains on tensors already on the GPU, under the run's
``--precision``, and each delivered batch is copied to the GPU (from pinned memory with
``--pin-memory``, as ``data.pin_memory=true`` does); ``--cache`` compares decoding every epoch
(``none``) with the decoded images kept in memory (``auto``, :mod:`ddlx.data.cache`).
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

from handloop import AUTOCAST, hand_written_epoch, sgd  # noqa: E402


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
    parser.add_argument("--cache", nargs="+", default=["none"], help="data.cache values to compare")
    parser.add_argument("--pin-memory", action="store_true")
    parser.add_argument("--synthetic-size", type=int, nargs=2, default=None, help="data.synthetic_size: shortest, longest side")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="32-true", choices=sorted(AUTOCAST))
    return parser.parse_args()


def data_config(args: argparse.Namespace, workers: int, cache: str):
    from hydra import compose, initialize_config_dir

    from ddlx.config_check import typed_config
    from ddlx.entry import register_config

    register_config(ROOT)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            f"data={args.data}", f"data.image_size={args.image_size}", f"data.batch_size={args.batch_size}",
            f"data.num_images={args.num_images}", f"data.num_workers={workers}", f"data.cache={cache}",
            f"data.pin_memory={str(args.pin_memory).lower()}",
            *([f"data.synthetic_size=[{args.synthetic_size[0]},{args.synthetic_size[1]}]"] if args.synthetic_size else []),
        ])
    return typed_config(cfg).data


def delivery(args: argparse.Namespace, workers: int, cache: str) -> tuple[float, float]:
    """(seconds to the first batch, images/s over the following batches, each copied to the device)."""
    from ddlx.data.datamodule import build_datamodule

    device = torch.device(args.device)
    dm = build_datamodule(data_config(args, workers, cache))
    dm.prepare_data()
    dm.setup("fit")
    loader = dm.train_dataloader()
    ahead = 2 * workers  # DataLoader's prefetch_factor per worker: ready before the timing starts
    if len(loader) < 1 + ahead + args.batches:
        raise SystemExit(f"--num-images={args.num_images} gives {len(loader)} training batches; {workers} workers need "
                         f"1 + {ahead} + --batches={args.batches}: raise --num-images or lower --batches")
    wanted = args.batches
    start = time.perf_counter()
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - start
    for _ in range(ahead):
        next(batches)
    start, images = time.perf_counter(), 0
    for _ in range(wanted):
        batch = next(batches)[0].to(device, non_blocking=True)
        images += len(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    dm.end_workers()
    return first, images / seconds


def consumption(args: argparse.Namespace, threads: int) -> float:
    """Images/s of the model's training step at ``threads`` intra-op threads."""
    from ddlx.models import build_model

    torch.set_num_threads(threads)
    device = torch.device(args.device)
    model = build_model(args.model, 3, 3, args.image_size, None).to(device)
    steps = 6 if device.type == "cpu" else 20
    images = torch.randn(args.batch_size * steps, 3, args.image_size, args.image_size, device=device)
    loader = DataLoader(TensorDataset(images, torch.randint(0, 3, (len(images),), device=device)), batch_size=args.batch_size)
    opt = sgd(model)
    step = dict(device=device, autocast=AUTOCAST[args.precision])
    hand_written_epoch(model, [next(iter(loader))] * 3, opt, **step)  # warm-up steps
    seconds, steps = hand_written_epoch(model, loader, opt, **step)
    return steps * args.batch_size / seconds


def main() -> None:
    args = parse_args()
    threads_before = torch.get_num_threads()
    delivered = {(w, c): delivery(args, w, c) for c in args.cache for w in args.workers}
    consumed = {t: consumption(args, t) for t in args.threads}
    torch.set_num_threads(threads_before)

    print(f"\n{args.data} at {args.image_size}x{args.image_size}, batch {args.batch_size}; {args.model} training step "
          f"on {args.device}, {args.precision}; pinned memory {args.pin_memory}\n")
    print("| loader workers | data.cache | first batch s | images/s delivered |")
    print("|---|---|---|---|")
    for (w, c), (first, rate) in delivered.items():
        print(f"| {w} | {c} | {first:.2f} | {rate:.1f} |")
    print(f"\n| {args.model} threads | images/s consumed |")
    print("|---|---|")
    for t, rate in consumed.items():
        print(f"| {t} | {rate:.1f} |")
    print("\ndelivered / consumed (below 1.0: the loader starves training)\n")
    print("| loader workers | data.cache | " + " | ".join(f"{t} thread(s)" for t in args.threads) + " |")
    print("|---|---|" + "---|" * len(args.threads))
    for (w, c), (_, rate) in delivered.items():
        print(f"| {w} | {c} | " + " | ".join(f"{rate / consumed[t]:.2f}" for t in args.threads) + " |")


if __name__ == "__main__":
    main()
