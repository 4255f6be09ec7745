"""Where a two-stage CPU pipeline's time goes: each stage's busy time per micro-batch, measured
layer by layer on one core, and the step time a perfect schedule would take with them; then
PyTorch's schedules themselves, without ddlx, one process per core, against one core.

    python benchmarks/pipeline_stages.py --model vgg11 --balance auto --chunks 4 8
    python benchmarks/pipeline_stages.py --model alexnet --chunks 4 8      # the model's split point

First, one core trains the whole batch (the baseline, with its SGD step). Then, for each
micro-batch count m: the slowest stage's time per micro-batch (measured layer by layer on one
core), the GPipe/1F1B schedule time (m + W - 1) x that (Eq. 6.1 with unequal stages), and the
ceiling, baseline / schedule: the speedup a pipeline could reach if sending activations cost
nothing. What it loses is split into the bubble (W - 1 of m + W - 1 slots), the imbalance of the
stages, and the micro-batch tax: the m micro-batches through every layer on one core against
the whole batch (smaller matrix products, each stage's weights read and its gradients written
again per micro-batch). Dividing a measured epoch ratio (benchmarks/strategies_cpu.py) by the
ceiling gives what the transfers, the schedule's bookkeeping and the data loading cost on top.
The second table times ``torch.distributed.pipelining`` alone (in-memory batch, gloo, each
stage pinned to one core, SGD step) against the baseline: what the engine reaches before ddlx's
loop, data loading and logging are added. The third says where the engine's distance to the
ceiling goes: each stage's forward and backward per micro-batch alone and while the other core
runs its own stage at the same time (no transfers: what sharing the machine's memory system
costs), and one micro-batch's activation and gradient sent through gloo and back.

Every process runs with the heap train.py would use (``cpu_allocator=auto``, docs/allocator.md):
glibc's default maps the one-core baseline's large activations afresh each step, which makes it
slower and a pipeline look better than it is against ddlx's sequential runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddlx.allocator import AUTO, apply_allocator, resolve_allocator  # noqa: E402
from ddlx.models import build_model  # noqa: E402
from ddlx.parallel.balance import layer_times  # noqa: E402
from ddlx.parallel.cuts import contiguous_balance  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg11")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--balance", default=None, help="auto (by profiled time, as strategy.balance=auto) or a,b; default: the split point")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b"], help="timed without ddlx (none: skip)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up one")
    args = parser.parse_args()

    allocator = resolve_allocator(AUTO)
    apply_allocator(allocator)  # here and, through the environment, in the stages
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model, args.classes, 3, args.image_size)
    one = statistics.median(_one_core_steps(model, args))
    print(f"{args.model} at {args.image_size} px, batch {args.batch_size}, 2 stages of one core each, "
          f"cpu_allocator={allocator}; one core trains the whole batch in {one:.2f} s/step\n")
    print("| micro-batches | balance | stage 1 s/mb | stage 2 s/mb | micro-batches on one core s | schedule s/batch "
          "| ceiling | bubble | imbalance | micro-batch tax |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    balances = {}
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
        in_micro_batches = m * sum(stages)  # each stage's weights read again per micro-batch, at a smaller batch
        schedule = (m + 1) * max(stages)
        balanced = (m + 1) * sum(stages) / 2
        print(f"| {m} | {balance} | {stages[0]:.3f} | {stages[1]:.3f} | {in_micro_batches:.2f} | {schedule:.2f} "
              f"| {one / schedule:.2f}x | {1 / m:.0%} | {schedule / balanced - 1:.0%} | {in_micro_batches / one - 1:.0%} |")
        balances[m] = balance
    if not args.schedules:
        return
    print(f"\nPyTorch's schedules alone, median s/step of {args.steps} (one core: {one:.2f} s/step)\n")
    print("| schedule | micro-batches | balance | s/step | speedup over one core |")
    print("|---|---|---|---|---|")
    for schedule in args.schedules:
        for m in args.chunks:
            out = mp.get_context("spawn").SimpleQueue()
            mp.spawn(_stage, args=(args, schedule, m, balances[m], out), nprocs=2)
            step = out.get()
            print(f"| {schedule} | {m} | {balances[m]} | {step:.2f} | {one / step:.2f}x |")
    print("\nBoth cores busy: each stage's s/mb (forward and backward) alone, the other core idle, and while the "
          "other stage computes on the other core; send+recv: one micro-batch's activation forward and its gradient "
          "back through gloo; the ceilings are the first table's with these times\n")
    print("| micro-batches | stage 1 s/mb alone / busy | stage 2 s/mb alone / busy | send+recv s/mb | ceiling, both busy | with send+recv |")
    print("|---|---|---|---|---|---|")
    for m in args.chunks:
        out = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_busy_stage, args=(args, m, balances[m], out), nprocs=2)
        t = dict(out.get() for _ in range(5))
        slowest = max(t["stage 1 busy"], t["stage 2 busy"])
        print(f"| {m} | {t['stage 1 alone']:.3f} / {t['stage 1 busy']:.3f} | {t['stage 2 alone']:.3f} / "
              f"{t['stage 2 busy']:.3f} | {t['send+recv']:.3f} | {one / ((m + 1) * slowest):.2f}x "
              f"| {one / ((m + 1) * (slowest + t['send+recv'])):.2f}x |")


def _batch(args):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g),
            torch.randint(0, args.classes, (args.batch_size,), generator=g))


def _one_core_steps(model, args) -> list[float]:
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, [min(cores)])
    x, y = _batch(args)
    times = _timed_steps(lambda: nn.functional.cross_entropy(model(x), y).backward(), model, args.steps)
    os.sched_setaffinity(0, cores)  # the stages started next inherit it
    return times


def _timed_steps(forward_backward, model, steps: int, settle=lambda: None) -> list[float]:
    """Seconds of each SGD step (forward_backward, the update, then ``settle``) after a warm-up one."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        forward_backward()
        optimizer.step()
        settle()
        times.append(time.perf_counter() - start)
    return times[1:]


def _stage(rank: int, args, schedule: str, m: int, balance: list[int], out) -> None:
    from torch.distributed import pipelining

    from ddlx.parallel.schedules import SCHEDULES

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, [cores[rank % len(cores)]])
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PIPELINE_PORT", "29631"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = build_model(args.model, args.classes, 3, args.image_size)
    part = model[: balance[0]] if rank == 0 else model[balance[0] :]
    if getattr(part[0], "inplace", False):
        part[0].inplace = False
    stage = pipelining.PipelineStage(part, rank, 2, torch.device("cpu"))
    runner = getattr(pipelining, SCHEDULES[schedule].torch_class)(
        stage, n_microbatches=m, loss_fn=lambda o, t: nn.functional.cross_entropy(o, t) / m, scale_grads=False)
    x, y = _batch(args)

    def step() -> None:
        runner.step(x) if rank == 0 else runner.step(target=y, losses=[])

    times = _timed_steps(step, part, args.steps, settle=dist.barrier)  # a step ends when both stages have stepped
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def _busy_stage(rank: int, args, m: int, balance: list[int], out) -> None:
    """This rank's stage, forward and backward of ``m`` micro-batches, while the other rank runs
    its own at the same time on the other core (no transfers); then the boundary's activation
    sent to the second stage and its gradient back, per micro-batch."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, [cores[rank % len(cores)]])
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PIPELINE_PORT", "29631"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = build_model(args.model, args.classes, 3, args.image_size)
    x, y = (t[: args.batch_size // m] for t in _batch(args))
    with torch.no_grad():
        boundary = model[: balance[0]](x)
    part, inputs = (model[: balance[0]], x) if rank == 0 else (model[balance[0] :], boundary.requires_grad_())
    if getattr(part[0], "inplace", False):
        part[0].inplace = False

    def micro_batches() -> None:
        for _ in range(m):
            output = part(inputs)
            output.backward(torch.ones_like(output)) if rank == 0 else nn.functional.cross_entropy(output, y).backward()

    def transfers() -> None:
        for _ in range(m):
            if rank == 0:
                dist.send(boundary, 1)
                dist.recv(boundary, 1)
            else:
                dist.recv(boundary, 0)
                dist.send(boundary, 0)

    def timed(work, runs: bool) -> float:
        times = []
        for _ in range(args.steps + 1):
            dist.barrier()  # the ranks start together
            start = time.perf_counter()
            if runs:
                work()
            times.append((time.perf_counter() - start) / m)
        return statistics.median(times[1:])

    for turn in (0, 1):  # each stage alone, the other core idle
        alone = timed(micro_batches, runs=rank == turn)
        if rank == turn:
            out.put((f"stage {rank + 1} alone", alone))
    out.put((f"stage {rank + 1} busy", timed(micro_batches, runs=True)))
    transfer = timed(transfers, runs=True)
    if rank == 0:
        out.put(("send+recv", transfer))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
