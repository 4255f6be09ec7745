"""Where ddlx's training makes the host wait for the GPU: every synchronizing CUDA call in one
steady epoch of ddlx's Trainer (benchmarks/overhead.py's runner), eager and compiled, with the
Python stack that made it (``torch.cuda.set_sync_debug_mode``), and whether each batch reached the
device transfer in pinned memory.

    python studies/gpu_sync_check.py                    # ResNet-50, 224 px, batch 128, bf16-mixed, on cuda
    python studies/gpu_sync_check.py --device cpu --image-size 32 --batch-size 4   # a dry run

A call between a batch's start and its end would stop the host each step until the GPU caught up
(what tests/test_training_step.py rules out on CPU); one at an epoch's end or in the fit's setup
and teardown costs once. Printed: each distinct stack once, with its count, the innermost frames
last.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from handloop import premade_batches  # noqa: E402
from overhead import DdlxRunner, compose  # noqa: E402

from ddlx.models import build_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    args = parser.parse_args()
    args.threads = 1
    cuda = args.device == "cuda"

    pinned: collections.Counter = collections.Counter()
    transfer = pl.strategies.Strategy.batch_to_device

    def batch_to_device(self, batch, *a, **k):
        pinned[batch[0].is_pinned() if cuda else "cpu run"] += 1
        return transfer(self, batch, *a, **k)

    pl.strategies.Strategy.batch_to_device = batch_to_device
    stacks: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message).lower() and "prototype" not in str(message):
            frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                      for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
            stacks[tuple(frames[-8:])] += 1

    warnings.showwarning = record
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        loader = premade_batches(args.steps, args.batch_size, args.image_size, torch.device(args.device))
        for extra in ((), ("compile.enable=true",)):
            model = build_model(args.model, 3, 3, args.image_size, 0.0)
            runner = DdlxRunner(compose(args.model, args, root, False, "optim.lr=0.001", *extra), model, root)
            runner.epoch(loader)  # compiles, and warms the allocator
            pinned.clear(), stacks.clear()
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            runner.epoch(loader)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            print(f"\n== ddlx {'compiled' if extra else 'eager'}: batches pinned at the transfer: {dict(pinned)}; "
                  f"{sum(stacks.values())} synchronizing call(s)")
            for frames, count in stacks.most_common():
                print(f"-- {count}x\n   " + "\n   ".join(frames))


if __name__ == "__main__":
    main()
