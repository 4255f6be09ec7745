"""Per-epoch training time and throughput, measured the same way for every strategy."""
from __future__ import annotations

import time

import pytorch_lightning as pl


class EpochTimer(pl.Callback):
    """Logs ``epoch_time_s`` (training batches only, validation excluded) and ``samples_per_s``.

    The clock starts when the training epoch starts and stops at the end of its last training
    batch, so waiting for data is included and validation (which Lightning runs before
    ``on_train_epoch_end``) is not. Samples are counted for the global batch: every rank's share.
    """

    def __init__(self) -> None:
        self.epoch_times: list[float] = []
        self._start = 0.0
        self._last_batch_end = 0.0
        self._samples = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._samples = 0
        self._start = self._last_batch_end = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._samples += _batch_size(batch) * trainer.world_size
        self._last_batch_end = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        elapsed = self._last_batch_end - self._start
        if elapsed <= 0:
            return
        self.epoch_times.append(elapsed)
        pl_module.log("epoch_time_s", elapsed, on_epoch=True, rank_zero_only=True)
        pl_module.log("samples_per_s", self._samples / elapsed, on_epoch=True, rank_zero_only=True)


def _batch_size(batch) -> int:
    images = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(images.shape[0])
