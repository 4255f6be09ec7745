"""Where a two-stage CPU pipeline's time goes: each stage's busy time per micro-batch, measured
layer by layer on one core, and the step time a perfect schedule would take with them.

    python benchmarks/pipeline_stages.py --model vgg11 --balance auto --chunks 4 8
    python benchmarks/pipeline_stages.py --model alexnet --chunks 4 8      # the model's split point

For each micro-batch count m it prints the one-core time of the batch (m micro-batches through
every layer: it includes re-reading each stage's weights per micro-batch), the slowest stage's
time per micro-batch, and the GPipe/1F1B schedule time (m + W - 1) x that (Eq. 6.1 with unequal
stages): the speedup a pipeline could reach if sending activations cost nothing. Dividing a
measured epoch ratio (benchmarks/strategies_cpu.py) by this ceiling gives what the transfers,
the schedule's bookkeeping and the data loading cost on top.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddlx.models import build_model  # noqa: E402
from ddlx.parallel.balance import contiguous_balance, layer_times  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg11")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--balance", default=None, help="auto (by profiled time, as strategy.balance=auto) or a,b; default: the split point")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model, args.classes, 3, args.image_size)
    print(f"{args.model} at {args.image_size} px, batch {args.batch_size}, 2 stages of one core each\n")
    print("| micro-batches | balance | stage 1 s/mb | stage 2 s/mb | one core s/batch | schedule s/batch | ceiling | of which bubble | of which imbalance |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in args.chunks:
        micro = args.batch_size // m
        times = layer_times(model, torch.randn(micro, 3, args.image_size, args.image_size), rounds=args.rounds)
        if args.balance == "auto":
            balance = contiguous_balance(times, 2)
        elif args.balance:
            balance = [int(x) for x in args.balance.split(",")]
        else:
            balance = [model.split_index, len(model) - model.split_index]
        stages = [sum(times[: balance[0]]), sum(times[balance[0]:])]
        one_core = m * sum(stages)
        schedule = (m + 1) * max(stages)
        balanced = (m + 1) * sum(stages) / 2
        print(f"| {m} | {balance} | {stages[0]:.3f} | {stages[1]:.3f} | {one_core:.2f} | {schedule:.2f} | {one_core / schedule:.2f}x "
              f"| {1 / m:.0%} | {schedule / balanced - 1:.0%} |")


if __name__ == "__main__":
    main()
