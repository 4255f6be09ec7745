"""What a pipeline stage's classifier costs per batch in micro-batches: autograd's weight gradient
per micro-batch against ddlx's one product per batch (ddlx/parallel/deferred_weight_grads.py).

    python benchmarks/weight_grads.py                          # VGG11 and AlexNet at 224 px, batch 32
    python benchmarks/weight_grads.py --models vgg16 --chunks 2 4 8 16

For each model, its layers from the first fully connected one on (the classifier, the last
stage's heaviest part) on one core: forward and backward of the whole batch, then of the batch in
m micro-batches with autograd's weight gradients, then with the weight gradients computed once
after the micro-batches. Median ms of a few rounds after a warm-up; the batch's gradients equal
in the three (float rounding apart).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddlx.allocator import AUTO, apply_allocator, resolve_allocator  # noqa: E402
from ddlx.models import build_model  # noqa: E402
from ddlx.parallel.deferred_weight_grads import DeferredWeightGrads  # noqa: E402


def classifier(arch: str, image_size: int, batch: int) -> tuple[nn.Sequential, torch.Tensor]:
    """The model's layers from its first Linear on, and a batch of their input."""
    model = build_model(arch, 3, 3, image_size)
    first = next(i for i, layer in enumerate(model) if isinstance(layer, nn.Linear))
    with torch.no_grad():
        x = model[:first](torch.randn(batch, 3, image_size, image_size))
    return nn.Sequential(*model[first:]), x


def step_ms(head: nn.Sequential, x: torch.Tensor, y: torch.Tensor, chunks: int, deferred: DeferredWeightGrads | None,
            rounds: int) -> float:
    times = []
    for round_ in range(rounds + 1):
        for p in head.parameters():
            p.grad = None
        start = time.perf_counter()
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            (nn.functional.cross_entropy(head(xs), ys) / chunks).backward()
        if deferred is not None:
            deferred.flush()
        if round_:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vgg11", "alexnet"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    apply_allocator(resolve_allocator(AUTO))  # train.py's heap
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{'model':10s} {'micro-batches':>13s} {'autograd ms':>12s} {'once per batch ms':>18s} {'ratio':>6s}")
    for arch in args.models:
        head, x = classifier(arch, args.image_size, args.batch_size)
        head.eval()  # no dropout: the three compute the same gradients
        y = torch.randint(0, 3, (args.batch_size,))
        whole = step_ms(head, x, y, 1, None, args.rounds)
        print(f"{arch:10s} {'1 (batch)':>13s} {whole:12.0f} {'':>18s} {'':>6s}")
        for chunks in args.chunks:
            plain = step_ms(head, x, y, chunks, None, args.rounds)
            deferred = DeferredWeightGrads([head])
            once = step_ms(head, x, y, chunks, deferred, args.rounds)
            deferred.close()
            print(f"{arch:10s} {chunks:13d} {plain:12.0f} {once:18.0f} {plain / once:5.2f}x")


if __name__ == "__main__":
    main()
