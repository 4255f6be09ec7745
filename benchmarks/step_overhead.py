"""The host's time a training step in ddlx's loop beyond the hand-written loop's, one sitting.

    python benchmarks/step_overhead.py                 # 300 steps a round, 8 rounds
    python benchmarks/step_overhead.py --steps 100 --rounds 3

On a model of one linear layer over 16-px images, batch 4, one thread, the step is nothing but the
loop around it: Lightning's hooks, ddlx's module (loss, accuracy) and callbacks, the optimizer
call. That time overlaps the device's work while the device is slower; on a GPU whose step is
short (a compiled ResNet-50 step on an H200 took 23 ms, docs/gpu.md) it is what the device waits
for. ddlx's runner is benchmarks/overhead.py's (a fresh Trainer a round, as train.py builds it);
the two loops alternate in rotating order, ms a step are medians over the rounds.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

IMAGE_SIZE, BATCH = 16, 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps a round")
    parser.add_argument("--rounds", type=int, default=8)
    return parser.parse_args()


def main() -> None:
    import torch
    from handloop import hand_written_epoch, interleaved_rounds, premade_batches, second_of_two, sgd
    from overhead import DdlxRunner, compose
    from torch import nn

    args = parse_args()
    torch.set_num_threads(1)
    loader = premade_batches(args.steps, BATCH, IMAGE_SIZE, torch.device("cpu"))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Flatten(), nn.Linear(3 * IMAGE_SIZE * IMAGE_SIZE, 3))
    hand_model = copy.deepcopy(base)
    hand_optimizer = sgd(hand_model)
    settings = argparse.Namespace(image_size=IMAGE_SIZE, batch_size=BATCH, threads=1, precision="32-true", device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        # compose names a registry model for the config; the runner trains the model it is given
        ddlx = DdlxRunner(compose("alexnet", settings, Path(tmp), False, "optim.lr=0.001"), copy.deepcopy(base), Path(tmp))
        runners = {"hand": lambda: second_of_two(lambda: hand_written_epoch(hand_model, loader, hand_optimizer)),
                   "ddlx": lambda: ddlx.epoch(loader)}
        seconds = interleaved_rounds(runners, args.rounds, "linear")[0]
    times = {key: [1000 * s for s in values] for key, values in seconds.items()}
    hand, ours = statistics.median(times["hand"]), statistics.median(times["ddlx"])
    extra = [d - h for d, h in zip(times["ddlx"], times["hand"])]
    print(f"\none linear layer, {IMAGE_SIZE} px, batch {BATCH}, 1 thread, {args.steps} steps a round, {args.rounds} rounds\n")
    print("| hand ms/step | ddlx ms/step | ddlx's extra host ms/step [range over rounds] |")
    print("|---|---|---|")
    print(f"| {hand:.3f} | {ours:.3f} | {statistics.median(extra):.3f} [{min(extra):.3f}-{max(extra):.3f}] |")


if __name__ == "__main__":
    main()
