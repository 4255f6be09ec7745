"""Framework overhead: ddlx's per-step time against a hand-written PyTorch loop.

    python benchmarks/overhead.py                          # AlexNet and ResNet18 at 64x64, batch 32, 1 thread
    python benchmarks/overhead.py --models resnet18 --threads 2 --rounds 8
    python benchmarks/overhead.py --models resnet50 alexnet --image-size 224 --batch-size 64 --device cuda --precision bf16-mixed

In one process, on the same model (same initial weights), batch, thread count and in-memory
data (one loader over batches made beforehand, so neither decoding nor collation is in either figure), it
alternates, round after round and in rotating order:

- ``hand``: the loop of benchmarks/handloop.py (zero_grad, forward, loss, backward, step,
  loss and accuracy tracked), two epochs a round, timed in the second (``handloop.second_of_two``);
- ``ddlx``: ddlx's Trainer as train.py builds it (ClassifierModule, sequential strategy,
  EpochTimer, ResourceMonitor at its default interval, MLflow logging to a scratch store), one
  fit of two epochs per round, timed in its second; the optimizer is kept across fits (as in one
  multi-epoch run) so that both sides are in steady state;
- ``ddlx no monitor``: the same without the resource monitor, to isolate the monitor's cost.

Per-step time = training-epoch time / steps, measured from the first batch request to the last
step done in both (ddlx's own ``epoch_time_s``). The first round is a warm-up and is dropped.
Ratios are medians of the per-round ratios (each round's figures were taken seconds apart), which
is robust to the drift of a shared machine. Goal: ddlx within 3% of the hand-written loop.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from handloop import AUTOCAST, hand_written_epoch, interleaved_rounds, premade_batches, second_of_two, sgd  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["alexnet", "resnet18"])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds (plus one warm-up)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: ddlx with trainer=gpu")
    parser.add_argument("--precision", default="32-true", choices=sorted(AUTOCAST))
    return parser.parse_args()


def compose(model: str, args: argparse.Namespace, root: Path, monitor: bool, *extra: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ddlx.entry import register_config

    register_config(ROOT)
    overrides = [
        f"model={model}", "model.dropout=0", f"data.image_size={args.image_size}", f"data.batch_size={args.batch_size}",
        "strategy=sequential", f"strategy.threads={args.threads}", "trainer.max_epochs=2", "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "checkpoint.save=none",
        f"measure.monitor={str(monitor).lower()}", f"paths.root={root}", f"logger.tracking_uri=sqlite:///{root / 'mlflow.db'}",
        "logger.experiment_name=benchmark-overhead", f"trainer.precision={args.precision}",
        *(["trainer=gpu"] if args.device == "cuda" else []), *extra,
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


class DdlxRunner:
    """ddlx's training path for one model, as in a run of train.py: a fresh Trainer a round, timed
    in its second epoch. Its first pays what a run pays once, not every epoch: on a GPU, Lightning
    moves the model and optimizer state to the device at a fit's start and back at its end, and
    empties the CUDA allocator's cache at both, so the first steps of a fit allocate again (a
    cudaMalloc in ResNet-50's compiled step on an H200)."""

    def __init__(self, cfg, model: torch.nn.Module, root: Path) -> None:
        from dataclasses import asdict

        from ddlx.config_check import typed_config
        from ddlx.module import ClassifierModule
        from ddlx.run import layered_model_meta
        from ddlx.strategies import build_strategy
        from ddlx.tracking import make_logger

        from ddlx.console import silence_known_noise

        silence_known_noise()  # as train.py: Lightning's cloud-logger tip and srun hint once a round are noise
        cfg = typed_config(cfg)  # as ddlx.run.train reads it
        self.cfg, self.root = cfg, root
        self.plan = build_strategy(cfg.strategy, cfg.trainer.accelerator, layered_model_meta(cfg), cfg.data)
        class SteadyStateModule(ClassifierModule):
            """Keeps one optimizer across the fits of the rounds, as one multi-epoch run does: a new
            SGD per fit would pay its momentum-buffer allocation (a parameter-sized clone) again."""

            def configure_optimizers(self):
                if not hasattr(self, "_optimizer"):
                    self._optimizer = super().configure_optimizers()
                return self._optimizer

        self.module = SteadyStateModule(model, cfg.data.num_classes, **asdict(cfg.optim),
                                        channels_last=cfg.model.memory_format == "channels_last")
        self.logger = make_logger(cfg.logger.tracking_uri, cfg.logger.experiment_name, cfg.logger.run_name,
                                  {"bench": "overhead"}, cfg.logger.artifact_location)

    def epoch(self, loader, *extra_callbacks) -> tuple[float, int]:
        from ddlx.run import build_trainer, measurement_callbacks

        callbacks = measurement_callbacks(self.cfg)
        # extra_callbacks first: a profiler's start is then outside the timer's epoch
        trainer = build_trainer(self.cfg, self.plan, self.logger, self.root / "run", [*extra_callbacks, *callbacks])
        trainer.fit(self.module, train_dataloaders=loader)
        self.timer = callbacks[0]  # the run's timer (its compile_s too)
        return self.timer.epoch_times[-1], self.timer.epoch_steps[-1]


def measure_model(name: str, args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    from ddlx.models import build_model

    device = torch.device(args.device)
    loader = premade_batches(args.steps, args.batch_size, args.image_size, device)
    base = build_model(name, 3, 3, args.image_size, 0.0)

    hand_model = copy.deepcopy(base).to(device)
    hand_opt = sgd(hand_model)
    with_monitor = DdlxRunner(compose(name, args, root, monitor=True), copy.deepcopy(base), root)
    without_monitor = DdlxRunner(compose(name, args, root, monitor=False), copy.deepcopy(base), root)
    runners = {
        "hand": lambda: second_of_two(lambda: hand_written_epoch(hand_model, loader, hand_opt, device, AUTOCAST[args.precision])),
        "ddlx": lambda: with_monitor.epoch(loader),
        "ddlx no monitor": lambda: without_monitor.epoch(loader),
    }
    return interleaved_rounds(runners, args.rounds, name, args.threads)[0]


def paired_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def main() -> None:
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            t = measure_model(name, args, Path(tmp))
            rows.append((
                name, statistics.median(t["hand"]), statistics.median(t["ddlx"]), statistics.median(t["ddlx no monitor"]),
                paired_ratio(t["ddlx"], t["hand"]), paired_ratio(t["ddlx no monitor"], t["hand"]),
                paired_ratio(t["ddlx"], t["ddlx no monitor"]),
                (max(t["hand"]) - min(t["hand"])) / statistics.median(t["hand"]),
            ))
    print(f"\n{args.device}, {args.precision}, {args.image_size}x{args.image_size}, batch {args.batch_size}, "
          f"{args.threads} thread(s), {args.steps} steps "
          f"per epoch, median of {args.rounds} rounds; ratios are medians of per-round ratios (goal: ddlx/hand <= 1.03)\n")
    header = ("model", "hand ms/step", "ddlx ms/step", "ddlx no-mon ms/step", "ddlx/hand", "no-mon/hand",
              "monitor cost", "hand spread")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, hand, ddlx, nomon, ratio, ratio_nomon, monitor, spread in rows:
        print(f"| {name} | {1000 * hand:.1f} | {1000 * ddlx:.1f} | {1000 * nomon:.1f} | {ratio:.3f} | {ratio_nomon:.3f} | "
              f"{100 * (monitor - 1):+.1f}% | {100 * spread:.1f}% |")


if __name__ == "__main__":
    main()
