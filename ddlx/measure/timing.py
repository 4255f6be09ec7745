"""Per-epoch and per-step training time, measured the same way for every strategy.

Every rank times its own steps; at the end of each epoch the ranks agree on the slowest
rank's figures (a max-reduce through the strategy: an epoch is over when its last rank is
done), and rank 0 logs them. Single-process strategies reduce to themselves.
"""
from __future__ import annotations

import logging
import math
import time
from statistics import mean

import pytorch_lightning as pl
import torch

from ..compiling import CompileClock
from ..parallel.data_replicas import data_replicas

log = logging.getLogger(__name__)

EPOCH_METRICS = ("epoch_time_s", "data_wait_s", "compute_s", "step_time_s", "samples_per_s")


class EpochTimer(pl.Callback):
    """Logs per training epoch, validation excluded:

    - ``epoch_time_s``: first training batch requested -> last training batch done;
    - ``data_wait_s`` / ``compute_s``: that time split into waiting for the loader (and the copy
      to the device) vs forward, backward, synchronisation and optimizer step; they add up to
      ``epoch_time_s``, so a starved loader shows as a large ``data_wait_s``;
    - ``step_time_s``: mean time per step; ``samples_per_s``: global samples (every rank's) / s.

    An epoch's figures are taken at its last training step (before validation, and before the
    epoch-end checkpoint, which so holds them). At the end of training, ``mean_epoch_time_s`` and
    ``mean_samples_per_s`` average the epochs after the first ``warmup_epochs`` (the thesis
    reports the mean of 3 epochs). An epoch that ``trainer.max_steps`` or ``max_time`` stops
    within is no epoch's time: it is left out of both (the log says so).

    With ``compile.enable``, torch compiles at a step's first call of a new graph: those seconds
    (torch's compile callbacks, :class:`~ddlx.compiling.CompileClock`) are taken out of the step
    they fall in and logged as ``compile_s`` (the run's total so far, the slowest rank's;
    validation's compiles included), so the epoch times are the steady state's. Beside it,
    ``compile_cache_misses`` and ``compile_cache_hits``: the graphs inductor compiled and those it
    took from its on-disk cache (each the most of any rank), which say whether ``compile_s`` is
    what compiling costs or what a warm cache does; left out where a run resumed from a checkpoint
    that did not count them.

    Its state goes into every checkpoint: a run resumed mid-epoch adds the steps it times to those
    of the same epoch before the stop, so each epoch's figures cover all its steps once, and the
    means cover the epochs of every attempt.
    """

    def __init__(self, warmup_epochs: int = 0) -> None:
        self.warmup_epochs = warmup_epochs
        self.epoch_times: list[float] = []
        self.epoch_samples: list[int] = []
        self.epoch_steps: list[int] = []
        self.step_times: list[tuple[float, float]] = []  # (data wait, compute) of this rank, this epoch
        self._mark = 0.0
        self._batch_start = 0.0
        self._samples = 0
        self._replicas = 1  # processes training on different batches (set at the start of training)
        self._carried: tuple[list, int] | None = None  # the resumed epoch's steps timed before the stop
        self.clock = CompileClock()
        self.compile_s = 0.0  # every rank's compiling so far, the slowest's (at the last epoch's end)
        self._compile_before = 0.0  # compiled before a resume (its checkpoint's compile_s)
        # Inductor's cache (hits, misses) so far, each the most of any rank (at the last epoch's end),
        # and before a resume; None: not known (a checkpoint of compiled epochs that did not count them).
        self.cache: tuple[int, int] | None = (0, 0)
        self._cache_before: tuple[int, int] | None = (0, 0)
        self._compile_mark = 0.0

    def state_dict(self) -> dict:
        return {"epoch_times": self.epoch_times, "epoch_samples": self.epoch_samples, "epoch_steps": self.epoch_steps,
                "step_times": self.step_times, "samples": self._samples, "compile_s": self.compiled(),
                "compile_cache": self.cached()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch_times, self.epoch_samples = list(state["epoch_times"]), list(state["epoch_samples"])
        self.epoch_steps = list(state["epoch_steps"])
        self._carried = (list(state["step_times"]), int(state["samples"]))
        self._compile_before = self.compile_s = float(state.get("compile_s", 0.0))
        counted = state.get("compile_cache", None if self.compile_s > 0 else (0, 0))
        self._cache_before = self.cache = None if counted is None else (int(counted[0]), int(counted[1]))

    def compiled(self) -> float:
        """Compile seconds of the run: the slowest rank's at the last epoch end, or this rank's since."""
        return max(self.compile_s, self._compile_before + self.clock.now())

    def cached(self) -> tuple[int, int] | None:
        """Inductor's cache (hits, misses) of the run: the most of any rank at the last epoch end, or this rank's since."""
        mine = self._mine()
        return None if mine is None or self.cache is None else (max(self.cache[0], mine[0]), max(self.cache[1], mine[1]))

    def _mine(self) -> tuple[int, int] | None:
        """This rank's (hits, misses) of the run: before a resume and since."""
        if self._cache_before is None:
            return None
        hits, misses = self.clock.cache_counts()
        return self._cache_before[0] + hits, self._cache_before[1] + misses

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.clock.install()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.clock.remove()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resumed mid-epoch, Lightning goes on with the epoch without on_train_epoch_start.
        self.step_times, self._samples = self._carried or ([], 0)
        self._carried = None
        self._replicas = data_replicas(trainer.strategy)[0]  # a pipeline's stages share one batch
        self._mark = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step_times, self._samples = [], 0
        self._mark = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()
        self._compile_mark = self.clock.now()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        last = batch_idx + 1 >= trainer.num_training_batches
        if last or 0 <= trainer.max_steps <= trainer.global_step:  # the epoch's last step (max_steps cuts it short)
            wait_for_devices(pl_module)
        now = time.perf_counter()
        compiling = self.clock.now() - self._compile_mark  # not the step's: torch compiling a graph
        self.step_times.append((self._batch_start - self._mark, now - self._batch_start - compiling))
        self._mark = now
        self._samples += _batch_size(batch) * self._replicas
        if last:
            self._finish_epoch(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.step_times:  # an epoch cut short (trainer.max_steps, max_time) or of unknown length
            self._finish_epoch(trainer, pl_module, whole=not math.isfinite(trainer.num_training_batches))

    def _finish_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, whole: bool = True) -> None:
        """The slowest rank's figures (a collective: every rank calls it at the same step). An
        epoch cut short is no epoch's time: it is said, and left out of the epoch figures and means."""
        steps = len(self.step_times)
        local = torch.tensor(
            [sum(w for w, _ in self.step_times), sum(c for _, c in self.step_times), self._compile_before + self.clock.now(),
             *(self._mine() or (-1, -1))],
            dtype=torch.float64,
        )
        wait, compute, self.compile_s, hits, misses = trainer.strategy.reduce(local.to(pl_module.device), reduce_op="max").tolist()
        self.cache = None if hits < 0 else (int(hits), int(misses))
        elapsed, samples = wait + compute, self._samples
        self.step_times, self._samples = [], 0
        if not whole:
            if trainer.is_global_zero:
                log.info("epoch %d stopped after %d of its %d steps (trainer.max_steps or max_time): not an epoch's time, "
                         "left out of epoch_time_s and the means", trainer.current_epoch + 1, steps, trainer.num_training_batches)
            return
        if steps == 0 or elapsed <= 0:
            return
        self.epoch_times.append(elapsed)
        self.epoch_samples.append(samples)
        self.epoch_steps.append(steps)
        metrics = {
            "epoch_time_s": elapsed,
            "data_wait_s": wait,
            "compute_s": compute,
            "step_time_s": elapsed / steps,
            "samples_per_s": samples / elapsed,
            **compile_metrics(self.compile_s, self.cache),
        }
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        if trainer.is_global_zero and trainer.logger is not None:
            # Straight to the logger: logged through the module, they would reach it only at the
            # epoch's end, after validation, and a stop in between would lose them.
            trainer.logger.log_metrics(metrics, step=trainer.global_step)

    def summary(self) -> dict[str, float]:
        """Mean over the measured epochs (after warm-up; all epochs if there are no others)."""
        if not self.epoch_times:
            return {}
        skip = self.warmup_epochs if len(self.epoch_times) > self.warmup_epochs else 0
        times, samples = self.epoch_times[skip:], self.epoch_samples[skip:]
        compiled = self.compiled()
        return {
            "mean_epoch_time_s": mean(times),
            "mean_samples_per_s": sum(samples) / sum(times),
            "measured_epochs": float(len(times)),
            **compile_metrics(compiled, self.cached()),
        }

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and trainer.logger is not None and self.epoch_times:
            trainer.logger.log_metrics(self.summary(), step=trainer.global_step)


def compile_metrics(compile_s: float, cache: tuple[int, int] | None) -> dict[str, float]:
    """``compile_s`` and inductor's cache hits and misses (where known), where the run compiled."""
    if compile_s <= 0:
        return {}
    counts = {} if cache is None else {"compile_cache_hits": float(cache[0]), "compile_cache_misses": float(cache[1])}
    return {"compile_s": compile_s, **counts}


def wait_for_devices(module) -> None:
    """Wait until the GPUs holding ``module`` have run what the host has queued. A step returns to
    the host once its kernels are issued, and a GPU may still be running the last few steps' while
    the host goes on: an epoch is over when they are done, else its time leaves them out (they
    would fall in validation's, whose first read waits for them). Once an epoch: waiting every
    step would stop the host from issuing the next step while the GPU runs this one."""
    for device in {p.device for p in module.parameters()}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _batch_size(batch) -> int:
    images = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(images.shape[0])
