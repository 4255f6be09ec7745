"""Where a cpu_mp step's time goes, for the shared-weights design and the one it replaced.

    python benchmarks/cpu_mp_step.py                                   # AlexNet and VGG11 at 224, ResNet18 and MobileNetV2 at 128
    python benchmarks/cpu_mp_step.py --models alexnet --steps 12

On in-memory tensors (no image decoding), global batch 32, SGD with momentum, each setup in its
own processes, in one sitting, for every model:

- ``sequential threads=1`` / ``threads=2``: one process, the whole batch, forward, backward and
  the optimizer step;
- ``cpu_mp old``: the design before (commit 38c48c3): 2 ranks, one core each, each with its own
  weights and optimizer; each copies its gradient into its shared slot, sums its half of the
  slots, then steps the optimizer over the whole model in its own copy;
- ``cpu_mp shared``: ``ddlx.parallel.shared_memory.SharedWeights`` with every layer data
  parallel (``strategy.split_linear=never``): one shared copy of the weights, each rank reduces
  and steps its half;
- ``cpu_mp split``: as ``strategy=cpu_mp`` runs by default: the same, with the wide fully
  connected layers split by rows between the ranks (``ddlx.parallel.split_linear``);
- ``ranks apart``: the ceiling of any design with 2 ranks on this machine: the same 2 pinned
  ranks, each training its own model on its half of the batch, exchanging nothing. What it
  lacks of 2x is what the two cores lose to each other (shared caches, memory bandwidth, a
  host's neighbours), not what cpu_mp does.

Per step (median over the steps after the first few): compute (forward and backward, without
the split layers' collectives), exchange (those collectives), reduce (gradient into the slot and
the slice's sum), step (the optimizer), waiting (in the two barriers: for the slower rank), and
the total; the speedup is over ``sequential threads=1``. Timings on this shared machine swing:
compare the ratios of one sitting. Every process runs with the heap train.py would use
(``cpu_allocator=auto``, docs/allocator.md).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddlx.allocator import AUTO, apply_allocator, resolve_allocator  # noqa: E402
from ddlx.models import build_model  # noqa: E402
from ddlx.parallel.shared_weight_ranks import CpuMultiProcessStrategy  # noqa: E402
from ddlx.parallel.pinning import core_share  # noqa: E402
from ddlx.parallel import split_linear  # noqa: E402
from ddlx.parallel.shared_memory import SharedWeights  # noqa: E402

MODELS = {"alexnet": 224, "vgg11": 224, "resnet18": 128, "mobilenet_v2": 128}
PHASES = ("compute", "exchange", "reduce", "step", "waiting")


class Clock:
    """Seconds per phase of the current step; time spent in a phase timed inside another (the
    barriers inside a reduce) counts for the inner one only."""

    def __init__(self) -> None:
        self.now = dict.fromkeys(PHASES, 0.0)
        self.steps: list[dict[str, float]] = []
        self._nested = [0.0]

    def timed(self, phase: str, fn, *args, **kwargs):
        self._nested.append(0.0)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        spent = time.perf_counter() - start
        inner = self._nested.pop()
        self.now[phase] += spent - inner
        self._nested[-1] += spent
        return out

    def end_step(self) -> None:
        self.steps.append(self.now)
        self.now = dict.fromkeys(PHASES, 0.0)


def _setup(model: str, size: int, batch: int, seed: int = 0):
    torch.manual_seed(seed)
    net = build_model(model, 10, 3, size, None)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
    return net, x, y, opt


def _forward_backward(net, x, y) -> None:
    torch.nn.functional.cross_entropy(net(x), y).backward()


def one_process(model: str, size: int, threads: int, steps: int) -> list[dict[str, float]]:
    torch.set_num_threads(threads)
    net, x, y, opt = _setup(model, size, 32)
    clock = Clock()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        clock.timed("compute", _forward_backward, net, x, y)
        clock.timed("step", opt.step)
        clock.end_step()
    return clock.steps


class OldAverager:
    """The design before: each rank's own weights and optimizer, gradients averaged through shared slots."""

    def __init__(self, params, rank, world, barrier, name) -> None:
        self.params, self.rank, self.world, self.barrier = list(params), rank, world, barrier
        self.numel = sum(p.numel() for p in self.params)
        self.offsets = [sum(p.numel() for p in self.params[:i]) for i in range(len(self.params))]
        buffer = torch.from_file(name, shared=True, size=(world + 1) * self.numel, dtype=torch.float32)
        self.slots, self.result = buffer[: world * self.numel].view(world, self.numel), buffer[world * self.numel :]
        chunk = -(-self.numel // world)
        self.slice = slice(rank * chunk, min((rank + 1) * chunk, self.numel))
        self.views = [self.result[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]

    def average(self, clock: Clock) -> None:
        mine = self.slots[self.rank]
        clock.timed("reduce", lambda: [mine[o : o + p.numel()].copy_(p.grad.reshape(-1)) for p, o in zip(self.params, self.offsets)])
        self.barrier()
        s = self.slice
        clock.timed("reduce", lambda: torch.sum(self.slots[:, s], dim=0, out=self.result[s]).div_(self.world))
        self.barrier()
        for p, view in zip(self.params, self.views):
            p.grad = view


def rank_main(rank: int, world: int, design: str, model: str, size: int, steps: int, name: str, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    os.sched_setaffinity(0, core_share(sorted(os.sched_getaffinity(0)), world, rank))
    torch.set_num_threads(1)
    net, x, y, opt = _setup(model, size, 32)
    x, y = x[rank::world], y[rank::world]
    clock = Clock()
    barrier = lambda: clock.timed("waiting", dist.barrier)  # noqa: E731
    if design in ("shared", "split"):
        layers = split_linear.split_linears(net, 32, rank, world) if design == "split" else []
        owned = {p: rows for layer in layers for p, rows in layer.owned_rows().items()}
        shared = SharedWeights(list(net.parameters()), rank, world, dist.barrier, CpuMultiProcessStrategy._broadcast_name,
                               owned_rows=owned)
        for layer in layers:
            layer.rows = [shared.rows(p) for p in layer.owned_rows()]
        shared.barrier = barrier
        for name in ("_all_gather", "_reduce_scatter", "_all_to_all"):  # the split layers' collectives, timed apart
            collective = getattr(split_linear, name)
            setattr(split_linear, name, lambda *a, _c=collective, **kw: clock.timed("exchange", _c, *a, **kw))
    elif design == "old":
        averager = OldAverager(net.parameters(), rank, world, barrier, name)
    dist.barrier()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        clock.timed("compute", _forward_backward, net, x, y)
        if design in ("shared", "split"):
            clock.timed("reduce", shared.reduce)
            clock.timed("step", shared.step, opt)
        elif design == "old":
            averager.average(clock)
            clock.timed("step", opt.step)
        else:  # apart: each rank its own model, nothing exchanged
            clock.timed("step", opt.step)
        clock.end_step()
    out.put((rank, clock.steps))
    dist.destroy_process_group()


def multi_process(design: str, model: str, size: int, steps: int, port: int) -> list[dict[str, float]]:
    world = 2
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    name = f"/dev/shm/ddlx-bench-{os.getpid()}-{port}"
    numel = sum(p.numel() for p in build_model(model, 10, 3, size, None).parameters())
    with open(name, "wb") as f:
        f.truncate((world + 1) * numel * 4)
    procs = [ctx.Process(target=rank_main, args=(r, world, design, model, size, steps, name, port, out)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        results = dict(out.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    finally:
        os.unlink(name)
    # A step takes as long as its slower rank: per step, the rank with the larger total.
    return [max((results[r][i] for r in range(world)), key=lambda s: sum(s.values())) for i in range(steps)]


SETUPS = ("sequential threads=1", "sequential threads=2", "cpu_mp old", "cpu_mp shared", "cpu_mp split", "ranks apart")


def measure(setup: str, model: str, size: int, steps: int, port: int) -> list[dict[str, float]]:
    if setup.startswith("sequential"):
        return one_process(model, size, int(setup[-1]), steps)
    return multi_process(setup.split()[-1], model, size, steps, port)  # old, shared, split, apart


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--size", type=int, help="image size for every model (default: 224 AlexNet/VGG11, 128 the others)")
    parser.add_argument("--steps", type=int, default=10, help="steps per setup and round; the first 3 are warm-up")
    parser.add_argument("--rounds", type=int, default=1, help="every setup this many times, interleaved; the steps pooled")
    parser.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    args = parser.parse_args()
    if args.steps <= 3:
        parser.error(f"--steps {args.steps}: the first 3 steps of each setup are warm-up; give --steps 4 or more")
    allocator = resolve_allocator(AUTO)
    apply_allocator(allocator)  # train.py's heap, here and, through the environment, in the ranks
    print(f"cpu_allocator={allocator}, {args.rounds} round(s) of {args.steps} steps per setup\n")
    print("| model | setup | ms/step | speedup | " + " | ".join(PHASES) + " |\n|---|---|---|---|" + "---|" * len(PHASES))
    port = 29700 + os.getpid() % 1000
    for model in args.models:
        size = args.size or MODELS[model]
        pooled: dict[str, list[dict[str, float]]] = {setup: [] for setup in args.setups}
        for _ in range(args.rounds):
            for setup in args.setups:
                port += 1
                pooled[setup] += measure(setup, model, size, args.steps, port)[3:]
        base = None
        for setup, steps in pooled.items():
            med = {k: 1e3 * statistics.median(s[k] for s in steps) for k in PHASES}
            total = 1e3 * statistics.median(sum(s.values()) for s in steps)
            base = base or total
            print(f"| {model} {size}px | {setup} | {total:.0f} | {base / total:.2f}x | "
                  + " | ".join(f"{med[k]:.0f}" for k in PHASES) + " |", flush=True)


if __name__ == "__main__":
    main()
