"""torch.compile: eager against compiled, in ddlx and in the hand-written loop, one sitting.

    python benchmarks/compile.py                                   # MobileNetV2 and ResNet18, 64 px, batch 32, 1 thread
    python benchmarks/compile.py --models alexnet --threads 2 --rounds 6
    python benchmarks/compile.py --models resnet50 --image-size 224 --batch-size 128 --device cuda --precision bf16-mixed

In one process, on the same model (same initial weights), batch, thread count and in-memory data,
four runners alternate round after round, in rotating order:

- ``hand eager`` / ``hand compiled``: the loop of benchmarks/handloop.py on the model, and on
  ``torch.compile(model)`` applied by hand;
- ``ddlx eager`` / ``ddlx compiled``: ddlx's Trainer as train.py builds it (benchmarks/overhead.py's
  runner), without and with ``compile.enable=true`` (ddlx's :func:`ddlx.compiling.compile_model`).

Per-step time = training-epoch time / steps, each runner timed in the second of two epochs a
round (ddlx's own ``epoch_time_s`` of a two-epoch fit, which leaves the compile seconds out; the
hand loop's first round holds its compile, and the first round is dropped for all four).
Ratios are medians of the per-round ratios, with their range over the rounds. The
compile seconds: ddlx's ``compile_s`` (torch's compile callbacks), and the hand loop's first round
less its two steady epochs; inductor's cache is a fresh folder, so the first of the two compiles is
cold and the second may reuse its kernels (each figure says how many graphs inductor compiled
and how many it took from its cache). Break-even: the
epochs of ``--epoch-images`` images after which compiling has paid for itself
(compile seconds / the seconds it saves an epoch), "never" where compiled is not faster.
Goals: ddlx compiled within 3% of the hand-compiled step; the gain reported with its spread.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytorch_lightning as pl  # noqa: E402
from handloop import AUTOCAST, hand_written_epoch, interleaved_rounds, premade_batches, second_of_two, sgd  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mobilenet_v2", "resnet18"])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (plus one with the compiles)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--epoch-images", type=int, default=10000, help="the epoch the break-even is counted in")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: ddlx with trainer=gpu")
    parser.add_argument("--precision", default="32-true", choices=sorted(AUTOCAST))
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, one more epoch of each runner under torch.profiler: where its step goes")
    return parser.parse_args()


def measure_model(name: str, args: argparse.Namespace, root: Path) -> dict:
    import torch
    from overhead import DdlxRunner, compose

    from ddlx.compiling import WHOLE_MODEL, compile_model, inductor_cache_counts
    from ddlx.models import build_model

    torch.set_num_threads(args.threads)
    device, autocast = torch.device(args.device), AUTOCAST[args.precision]
    loader = premade_batches(args.steps, args.batch_size, args.image_size, device)
    base = build_model(name, 3, 3, args.image_size, 0.0)

    hand_eager = copy.deepcopy(base).to(device)
    hand_eager_opt = sgd(hand_eager)
    hand_model = copy.deepcopy(base).to(device)
    hand_compiled = torch.compile(hand_model)
    hand_compiled_opt = sgd(hand_model)
    extra = ("optim.lr=0.001",)
    ddlx_eager = DdlxRunner(compose(name, args, root, False, *extra), copy.deepcopy(base), root)
    compiled_model = copy.deepcopy(base)
    compile_model(compiled_model, WHOLE_MODEL)
    ddlx_compiled = DdlxRunner(compose(name, args, root, False, *extra, "compile.enable=true"), compiled_model, root)
    compile_s: dict[str, float] = {}
    graphs: dict[str, tuple[int, int]] = {}  # inductor's cache (hits, misses) at each runner's compile

    def ddlx_epoch(runner, key):
        def run(profiler=None):
            timed = runner.epoch(loader, *([ProfiledSteps(profiler)] if profiler else []))
            if key not in compile_s and runner.timer.compiled() > 0:
                compile_s[key] = runner.timer.compiled()
                graphs[key] = runner.timer.cached()
            elif runner.timer.compiled() > 0:  # each round is a new Trainer: torch must not compile again
                print(f"  {key} compiled again for {runner.timer.compiled():.1f} s (kept out of its step)", file=sys.stderr)
            return timed
        return run

    def hand_epoch(model, optimizer):
        def run(profiler=None):
            return second_of_two(lambda: hand_written_epoch(model, loader, optimizer, device, autocast), profiler)
        return run

    def hand_compiled_epoch(profiler=None):
        before = inductor_cache_counts()
        timed = hand_epoch(hand_compiled, hand_compiled_opt)(profiler)
        graphs.setdefault("hand compiled", inductor_cache_counts(since=before))
        return timed

    runners = {
        "hand eager": hand_epoch(hand_eager, hand_eager_opt),
        "hand compiled": hand_compiled_epoch,
        "ddlx eager": ddlx_epoch(ddlx_eager, "ddlx eager"),
        "ddlx compiled": ddlx_epoch(ddlx_compiled, "ddlx compiled"),
    }
    step_times, first_round = interleaved_rounds(runners, args.rounds, name, args.threads)
    steady_hand = statistics.median(step_times["hand compiled"]) * args.steps
    compile_s["hand compiled"] = first_round["hand compiled"] - 2 * steady_hand  # its first call: two epochs
    profiles = {key: profile_epoch(run) for key, run in runners.items()} if args.profile else {}
    return {"steps": step_times, "compile_s": compile_s, "graphs": graphs,
            "profiles": profiles}


def profile_epoch(run) -> dict:
    """One epoch of ``run`` under torch.profiler, over its steps only (ddlx's Trainer, new each
    round, moves the model and optimizer state to the GPU at its start and back at its end: not
    a step's cost): per step, its wall time, the time the device ran kernels and copies (the sum
    of the device's own events: an operator's device time is that of the kernels it launched,
    and a user annotation's device-side span holds kernels too, so either would count them twice;
    below the wall time by what the device idled, waiting for the host),
    and the host operations that took the most of the host's own time (a user annotation's own
    time is the Python run inside it: Lightning's training step runs inside ``Optimizer.step``)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    seconds, steps = run(prof)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {"wall_ms": 1000 * seconds / steps, "device_ms": device_us / 1000 / steps,
            "host_top": [(e.key, e.self_cpu_time_total / 1000 / steps) for e in top]}


class ProfiledSteps(pl.Callback):
    """Runs ``profiler`` over ddlx's last epoch, the one its runner times: from its start to its
    end (after its last step and the timer's wait for the device)."""

    def __init__(self, profiler) -> None:
        self.profiler = profiler

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == trainer.max_epochs - 1:
            self.profiler.start()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == trainer.max_epochs - 1:
            self.profiler.stop()


def ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def main() -> None:
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # a cold cache for the first compile
        for name in args.models:
            rows.append((name, measure_model(name, args, Path(tmp))))
    print(f"\n{args.device}, {args.precision}, {args.image_size}x{args.image_size}, batch {args.batch_size}, {args.threads} thread(s), {args.steps} steps "
          f"a round, {args.rounds} rounds after the compiling one; ratios: median of per-round ratios [min-max]; "
          f"break-even in epochs of {args.epoch_images} images\n")
    header = ("model", "eager ms/step", "compiled ms/step", "gain (eager/compiled)", "ddlx/hand compiled",
              "hand gain", "ddlx compile s", "hand compile s", "break-even epochs")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    steps_per_epoch = args.epoch_images / args.batch_size
    for name, r in rows:
        t, c = r["steps"], r["compile_s"]
        gain = ratios(t["ddlx eager"], t["ddlx compiled"])
        hand_gain = ratios(t["hand eager"], t["hand compiled"])
        vs_hand = ratios(t["ddlx compiled"], t["hand compiled"])
        saved = (statistics.median(t["ddlx eager"]) - statistics.median(t["ddlx compiled"])) * steps_per_epoch
        ddlx_c = c.get("ddlx compiled", 0.0)
        even = f"{ddlx_c / saved:.2f}" if saved > 0 else "never"
        cached = lambda key: " ({1} compiled, {0} cached)".format(*r["graphs"].get(key, ("?", "?")))  # noqa: E731
        print(f"| {name} | {1000 * statistics.median(t['ddlx eager']):.1f} | {1000 * statistics.median(t['ddlx compiled']):.1f} | "
              f"{statistics.median(gain):.3f} [{min(gain):.3f}-{max(gain):.3f}] | "
              f"{statistics.median(vs_hand):.3f} [{min(vs_hand):.3f}-{max(vs_hand):.3f}] | "
              f"{statistics.median(hand_gain):.3f} | {ddlx_c:.1f}{cached('ddlx compiled')} | "
              f"{c['hand compiled']:.1f}{cached('hand compiled')} | {even} |")
    for name, r in rows:
        for key, p in r["profiles"].items():
            print(f"\nprofile, {name} {key}: {p['wall_ms']:.1f} ms a step (under the profiler), device kernels "
                  f"{p['device_ms']:.1f} ms; host's own time a step, largest: "
                  + ", ".join(f"{op} {ms:.2f} ms" for op, ms in p["host_top"]))


if __name__ == "__main__":
    main()
