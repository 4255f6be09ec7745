"""Where ddlx's training makes the host wait for the GPU: every synchronizing CUDA call
(``torch.cuda.set_sync_debug_mode``) in one fit of ddlx's Trainer (benchmarks/overhead.py's runner:
two epochs), eager and compiled, counted inside a step (from a batch's start to its end) and
elsewhere, with the Python stack that made each; and whether each batch reached the device
transfer in pinned memory.

    python studies/gpu_sync_check.py                    # ResNet-50, 224 px, batch 128, bf16-mixed, on cuda
    python studies/gpu_sync_check.py --device cpu --image-size 32 --batch-size 4   # a dry run (no device to wait for)

A call inside a step stops the host every step until the GPU has caught up (what
tests/test_training_step.py rules out on CPU); one at an epoch's end, or in the fit's setup and
teardown, costs once. Printed per runner: a line of counts, then each distinct stack once with
its count, innermost frames last, those inside a step first.
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

from ddlx.compiling import WHOLE_MODEL, compile_model  # noqa: E402
from ddlx.models import build_model  # noqa: E402


class InStep(pl.Callback):
    """Whether the loop is between a batch's start and its end."""

    def __init__(self) -> None:
        self.inside = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.inside = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.inside = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6, help="steps an epoch")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    args = parser.parse_args()
    args.threads = 1
    cuda = args.device == "cuda"

    batches: collections.Counter = collections.Counter()
    transfer = pl.strategies.Strategy.batch_to_device

    def batch_to_device(self, batch, *a, **k):
        batches["pinned" if cuda and batch[0].is_pinned() else "not_pinned"] += 1
        return transfer(self, batch, *a, **k)

    pl.strategies.Strategy.batch_to_device = batch_to_device
    step = InStep()
    stacks: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message).lower() and "prototype" not in str(message):
            frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                      for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
            stacks[(step.inside, tuple(frames[-10:]))] += 1

    warnings.showwarning = record
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        loader = premade_batches(args.steps, args.batch_size, args.image_size, torch.device(args.device))
        for compiled in (False, True):
            model = build_model(args.model, 3, 3, args.image_size, 0.0)
            if compiled:  # as benchmarks/compile.py: the runner trains the model it is given
                compile_model(model, WHOLE_MODEL)
            extra = ("compile.enable=true",) if compiled else ()
            runner = DdlxRunner(compose(args.model, args, root, False, "optim.lr=0.001", *extra), model, root)
            runner.epoch(loader)  # compiles; its own fit, not recorded
            compile_s = runner.timer.compiled()
            batches.clear(), stacks.clear()
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            runner.epoch(loader, step)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            inside = sum(n for (in_step, _), n in stacks.items() if in_step)
            print(f"\nddlx {'compiled' if compiled else 'eager'}: compile_s={compile_s:.1f} "
                  f"pinned={batches['pinned']} not_pinned={batches['not_pinned']} "
                  f"syncs_in_step={inside} syncs_elsewhere={sum(stacks.values()) - inside}")
            for (in_step, frames), count in sorted(stacks.items(), key=lambda s: (not s[0][0], -s[1])):
                print(f"-- {count}x {'in a step' if in_step else 'elsewhere'}\n   " + "\n   ".join(frames))


if __name__ == "__main__":
    main()
