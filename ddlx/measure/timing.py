"""Per-epoch and per-step training time, measured the same way for every strategy.

Every rank times its own steps; at the end of each epoch the ranks agree on the slowest
rank's figures (a max-reduce through the strategy: an epoch is over when its last rank is
done), and rank 0 logs them. Single-process strategies reduce to themselves.
"""
from __future__ import annotations

import time
import warnings
from statistics import mean

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.warnings import PossibleUserWarning

EPOCH_METRICS = ("epoch_time_s", "data_wait_s", "compute_s", "step_time_s", "samples_per_s")


class EpochTimer(pl.Callback):
    """Logs per training epoch, validation excluded:

    - ``epoch_time_s``: first training batch requested -> last training batch done;
    - ``data_wait_s`` / ``compute_s``: that time split into waiting for the loader (and the copy
      to the device) vs forward, backward, synchronisation and optimizer step; they add up to
      ``epoch_time_s``, so a starved loader shows as a large ``data_wait_s``;
    - ``step_time_s``: mean time per step; ``samples_per_s``: global samples (every rank's) / s.

    At the end of training, ``mean_epoch_time_s`` and ``mean_samples_per_s`` average the epochs
    after the first ``warmup_epochs`` (the thesis reports the mean of 3 epochs).
    """

    def __init__(self, warmup_epochs: int = 0) -> None:
        self.warmup_epochs = warmup_epochs
        # These figures are already reduced across ranks (the slowest rank's, below): Lightning's
        # advice to sync them again does not apply, and would repeat in every distributed run.
        warnings.filterwarnings("ignore", message=rf"It is recommended to use `self.log\('({'|'.join(EPOCH_METRICS)})'",
                                category=PossibleUserWarning)
        self.epoch_times: list[float] = []
        self.epoch_samples: list[int] = []
        self.step_times: list[tuple[float, float]] = []  # (data wait, compute) of this rank, this epoch
        self._mark = 0.0
        self._batch_start = 0.0
        self._samples = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._samples = 0
        self.step_times = []
        self._mark = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        self.step_times.append((self._batch_start - self._mark, now - self._batch_start))
        self._mark = now
        self._samples += _batch_size(batch) * trainer.world_size

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = len(self.step_times)
        local = torch.tensor(
            [sum(w for w, _ in self.step_times), sum(c for _, c in self.step_times)], dtype=torch.float64
        )
        wait, compute = trainer.strategy.reduce(local.to(pl_module.device), reduce_op="max").tolist()
        elapsed = wait + compute
        if steps == 0 or elapsed <= 0:
            return
        self.epoch_times.append(elapsed)
        self.epoch_samples.append(self._samples)
        metrics = {
            "epoch_time_s": elapsed,
            "data_wait_s": wait,
            "compute_s": compute,
            "step_time_s": elapsed / steps,
            "samples_per_s": self._samples / elapsed,
        }
        for name, value in metrics.items():
            pl_module.log(name, value, on_epoch=True, rank_zero_only=True)

    def summary(self) -> dict[str, float]:
        """Mean over the measured epochs (after warm-up; all epochs if there are no others)."""
        if not self.epoch_times:
            return {}
        skip = self.warmup_epochs if len(self.epoch_times) > self.warmup_epochs else 0
        times, samples = self.epoch_times[skip:], self.epoch_samples[skip:]
        return {
            "mean_epoch_time_s": mean(times),
            "mean_samples_per_s": sum(samples) / sum(times),
            "measured_epochs": float(len(times)),
        }

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and trainer.logger is not None and self.epoch_times:
            trainer.logger.log_metrics(self.summary(), step=trainer.global_step)


def _batch_size(batch) -> int:
    images = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(images.shape[0])
