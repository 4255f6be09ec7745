"""What a training run says on the console: a line per epoch when the output is not a terminal
(CI, nohup, a log file: no progress bar redraws there), and a summary at its end that says how it
went and how to open it; known third-party noise silenced, each by its own message."""
from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytorch_lightning as pl

from .ui import open_command, run_page

log = logging.getLogger(__name__)

# (logger, start of a message) that tell a ddlx user nothing: Lightning advertising its cloud logger.
NOISE_LOGS = (("pytorch_lightning.utilities.rank_zero", "💡 Tip:"),)
# (message, category): Lightning 2.6's own use of a torch pytree class that torch deprecated; its
# hint to start with srun wherever srun is installed (ddlx decides who starts the ranks: docs/multi-node.md);
# its hint to log steps more often than an epoch of few batches has (ddlx logs once an epoch: a user of a
# small folder was told to lower log_every_n_steps "to see logs for the training epoch", which are there).
NOISE_WARNINGS = ((r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
                  (r"The `srun` command is available on your system but is not used", Warning),
                  (r"The number of training batches \(\d+\) is smaller than the logging interval", Warning))
# Within a long epoch, a progress line at most this often (seconds).
PROGRESS_EVERY_S = 60.0


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def silence_known_noise() -> None:
    for name, prefix in NOISE_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropMessages(prefix))
    for message, category in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def is_terminal() -> bool:
    # OpenMPI's mpirun gives its ranks a pseudo-terminal whether its own output is one or a batch
    # job's log file, which then filled with the progress bar's redraws.
    return sys.stdout.isatty() and "OMPI_COMM_WORLD_SIZE" not in os.environ


class EpochLines(pl.Callback):
    """A log line at each epoch's end (its time, losses and accuracy), and within a long epoch
    one every :data:`PROGRESS_EVERY_S`: progress that a file or a pipe shows as it happens."""

    def __init__(self, every_s: float = PROGRESS_EVERY_S) -> None:
        self.every_s = every_s
        self._epoch_start = self._last_line = 0.0
        self._ended: tuple[int, float, bool] | None = None  # the epoch ended, its time and whether validated, not yet said
        self._validated = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resumed mid-epoch, Lightning goes on with the epoch without on_train_epoch_start.
        self._epoch_start = self._last_line = time.perf_counter()
        self._validated = False

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._say_ended(trainer)
        self._epoch_start = self._last_line = time.perf_counter()
        self._validated = False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validated = self._validated or not trainer.sanity_checking

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if trainer.is_global_zero and now - self._last_line >= self.every_s:
            self._last_line = now
            log.info("epoch %d/%s: step %d/%d, %.0f s", trainer.current_epoch + 1, _of(trainer.max_epochs),
                     batch_idx + 1, trainer.num_training_batches, now - self._epoch_start)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Said when the next epoch starts or training ends: Lightning gathers the epoch's metrics
        # after its callbacks' epoch-end hooks.
        self._ended = (trainer.current_epoch + 1, time.perf_counter() - self._epoch_start, self._validated)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._say_ended(trainer)

    def _say_ended(self, trainer: pl.Trainer) -> None:
        if self._ended is not None and trainer.is_global_zero:
            epoch, seconds, validated = self._ended
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            shown = ", ".join(f"{k} {metrics[k]:.3f}" for k in ("train_loss", "train_acc", "val_loss", "val_acc") if k in metrics)
            log.info("epoch %d/%s done, %.1f s%s: %s", epoch, _of(trainer.max_epochs), seconds,
                     " with validation" if validated else "", shown)
        self._ended = None


def _of(max_epochs: int | None) -> str:
    return str(max_epochs) if max_epochs not in (None, -1) else "?"


@dataclass
class RunSummary:
    status: str  # FINISHED, KILLED, FAILED
    run_id: str | None
    experiment_id: str | None
    tracking_uri: str
    epochs: int
    measured: dict[str, float]  # EpochTimer.summary()
    metrics: dict[str, float]  # the trainer's last callback metrics
    checkpoint: Path | None
    output_dir: Path
    not_counted: str | None = None  # why the report and recommend.py leave its times out (records.not_measured)
    diverged: str | None = None  # where its train_loss stopped being finite, and the fix (run.diverged_line)

    def lines(self) -> list[str]:
        out = [f"ddlx: run {self.status} after {self.epochs} epoch(s); its folder: {self.output_dir}"]
        if self.measured:
            out.append(f"  mean epoch {self.measured['mean_epoch_time_s']:.2f} s over {self.measured['measured_epochs']:.0f} "
                       f"measured epoch(s), {self.measured['mean_samples_per_s']:.1f} samples/s")
        if self.not_counted:
            out.append(f"  not counted by the report or recommend.py: {self.not_counted}")
        if self.measured.get("compile_s"):
            graphs = (f": {self.measured['compile_cache_misses']:.0f} graph(s) compiled, "
                      f"{self.measured['compile_cache_hits']:.0f} from inductor's cache" if "compile_cache_hits" in self.measured else "")
            out.append(f"  compiling took {self.measured['compile_s']:.1f} s, kept out of the epoch times (compile_s){graphs}")
        scores = ", ".join(f"{k} {self.metrics[k]:.3f}" for k in ("val_acc", "val_loss", "train_loss") if k in self.metrics)
        if scores:
            out.append(f"  final {scores}")
        if self.diverged:
            out.append(f"  {self.diverged}")
        if self.checkpoint is not None and self.checkpoint.exists():
            out.append(f"  checkpoint: {self.checkpoint}")
        if self.run_id:
            out.append(f"  MLflow run {self.run_id}: {open_command(self.tracking_uri, run_page(self.experiment_id, self.run_id))}")
        return out
