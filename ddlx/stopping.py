"""Stop signals: SIGINT (Ctrl-C), SIGTERM (SLURM, Kubernetes, ``timeout``), and SIGUSR1 and
SIGUSR2 (SLURM's warning before a job's end: ``sbatch --signal=USR1@90``; submitit's is USR2).

From the moment a run's MLflow run is open until training starts, these raise :class:`Stopped`
at once, so the run is recorded as KILLED and the process exits 128 + the signal's number. While
training, they are deferred to the end of the current step instead: the ranks agree that one of
them was signalled, write a checkpoint of the state after that step, and all stop, so a
pre-empted job resumes where it stopped (``ckpt_path=``). A second Ctrl-C stops at once. Once
training is done, one is noted only: the run ends FINISHED and the process exits 128 + its number.

Lightning's own SIGTERM handling is switched off (:func:`disable_lightning_signal_handlers`):
it signals the other ranks from inside the handler, broadcasts from there, and ends the process
with status 0 and no checkpoint.
"""
from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import pytorch_lightning as pl
import torch

from .checkpoints import BackgroundCheckpointIO
from .epoch_batches import epoch_trained
from .errors import Stopped
from .run_logger import RunLogger
from .tracking import end_logged_run

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopSignals:
    """Installs the stop-signal handlers (main thread only) for the ``with`` block; restores the
    previous ones after it.

    Immediate (the default): a signal raises :class:`Stopped`. Deferred (while training): it is
    noted, and :class:`StopAtSignal` stops at the end of the step; a second Ctrl-C then stops at
    once, but never while the stop's checkpoint is being written. Once a stop is under way,
    further signals are only noted, so the run's record and checkpoint are completed.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.elsewhere: int | None = None  # one that reached another rank, known when training ended
        self.deferred = False
        self.stopping = False
        self.at_once = Stopped  # what a stop at once raises: while training, where it was and the last checkpoint
        self.checkpointing = False  # whether a deferred stop writes a checkpoint (checkpoint.save is not none)
        self._previous: dict[int, object] = {}

    @property
    def stopped_by(self) -> int | None:
        """The signal that stopped the run, this rank's or another's."""
        return self.received or self.elsewhere

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            log.warning("%s received: already stopping", name)
            return
        again = self.received is not None
        self.received = self.received or signum
        if not self.deferred or (again and signum == signal.SIGINT):
            self.stopping = True
            raise self.at_once(signum)
        log.warning("%s received: stopping after this step%s", name, ", with a checkpoint" if self.checkpointing else "")


def disable_lightning_signal_handlers(trainer: pl.Trainer) -> None:
    """Keep Lightning from installing its SIGTERM / SLURM-requeue handlers at fit start: ddlx's
    (:class:`StopSignals`, :class:`StopAtSignal`) handle these signals on every rank alike."""
    trainer._signal_connector.register_signal_handlers = lambda: None  # noqa: SLF001 - see the module docstring


class StopAtSignal(pl.Callback):
    """Defers the stop signals while training, and stops every rank at the end of the step in
    which one of them was signalled (or at the end of a validation that one arrived in), after
    writing ``checkpoint`` (None: no checkpoint; ``weights_only``: one that cannot resume). A
    signal in an epoch's last step, or in its own validation, stops once that epoch has ended; in
    the last epoch's, training ends and the run is FINISHED (the process still exits as stopped)."""

    def __init__(self, signals: StopSignals, checkpoint: Path | None, weights_only: bool = False) -> None:
        self.signals, self.checkpoint, self.weights_only = signals, checkpoint, weights_only

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.signals.at_once = lambda signum: self._stopped_at_once(signum, trainer)
        self.signals.checkpointing = self.checkpoint is not None
        self.signals.deferred = True
        self._stop_if_signalled(trainer)  # a signal between the run's start and here

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        # Not after the epoch's last batch: resumed from there, Lightning counts the epoch done and
        # skips its validation and end, so its figures were never logged. The epoch ends first, and
        # the next one's start stops (the last epoch's: training is done, the run ends finished).
        if not epoch_trained(trainer):
            self._stop_if_signalled(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not mid-validation: a run resumed from there would skip the rest of that validation. Not
        # after the epoch's own validation either: Lightning logs the epoch's training metrics
        # after its epoch-end hooks, so a stop here lost them; the next epoch's start stops instead.
        if not trainer.sanity_checking and not epoch_trained(trainer):
            self._stop_if_signalled(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The state of the epoch-end checkpoint just written (ModelCheckpoint, save_on_train_epoch_end):
        # a stop here resumes from it, without writing another.
        # Not at the first epoch of a fit, whose state no epoch end wrote: its first step's end stops.
        if self.checkpoint is None or self._written(trainer, at_this_step=True):
            self._stop_if_signalled(trainer, written=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Training is done: a signal from now on is only noted, the run is closed FINISHED, and the
        # process then exits as stopped (ddlx.run.train raises Stopped(after_training=True)). One
        # that reached another rank only in the last epoch's last step or validation is every
        # rank's: rank 0, which says how the process ended, would otherwise exit 0.
        signalled = torch.tensor(self.signals.received or 0, device=trainer.strategy.root_device)
        signalled = int(trainer.strategy.reduce(signalled, reduce_op="max"))  # a collective, on every rank
        if signalled:
            self.signals.elsewhere = signalled  # not this rank's: a first Ctrl-C here is not a second
            log.warning("training had finished when the stop signal came: the run ends as finished")

    def _written(self, trainer: pl.Trainer, at_this_step: bool = False) -> bool:
        """Whether a checkpoint callback wrote ``checkpoint`` in this fit (in the background too:
        the write may still be under way); with ``at_this_step``, at this step. Known by the file's
        name, not its path: Lightning resolves the folder on rank 0 (it may be under a link, which
        each node may resolve apart), and where the answer decides a collective, every rank's must
        be the same. (keep_best's file has another name.)"""
        return any(c.best_model_path and Path(c.best_model_path).name == self.checkpoint.name
                   and (not at_this_step or c._last_global_step_saved == trainer.global_step)  # noqa: SLF001 - no public record of it
                   for c in trainer.checkpoint_callbacks)

    def _stopped_at_once(self, signum: int, trainer: pl.Trainer) -> Stopped:
        """A second Ctrl-C: no checkpoint of this point, but the last one written (an epoch's end,
        checkpoint.every_minutes) still resumes, from where it was written."""
        kept = self.checkpoint if self.checkpoint is not None and (self.checkpoint.is_file() or self._written(trainer)) \
            else None
        return Stopped(signum, kept, trainer.global_step, resumable=kept is not None and not self.weights_only, at_once=True)

    def _stop_if_signalled(self, trainer: pl.Trainer, written: bool = False) -> None:
        # A collective: every rank calls it at the same point of every step (a no-op for one process).
        if not trainer.strategy.reduce_boolean_decision(self.signals.received is not None, all=False):
            return
        self.signals.stopping = True  # nothing interrupts the checkpoint from here
        if self.checkpoint is not None and not written:
            trainer.save_checkpoint(self.checkpoint, weights_only=self.weights_only)  # every rank: it has a barrier
        raise Stopped(self.signals.received or signal.SIGTERM, self.checkpoint, trainer.global_step,
                      resumable=self.checkpoint is not None and not self.weights_only)


class RecordStop(pl.Callback):
    """A stop's record (KILLED, the signal, its checkpoint) as soon as the stop leaves training:
    first of the callbacks' exception hooks (the resource monitor's plots and artifacts come after)
    and before Lightning's teardown (the loader workers, the process group), since mpirun sends
    SIGKILL 1 s after the SIGTERM it turns Ctrl-C into (OpenMPI's odls_base_sigkill_timeout). The
    checkpoint it names is on disk first (a background write finished); a write that failed leaves
    the record to :func:`ddlx.tracking.recorded` (FAILED, with the error)."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not (isinstance(exception, Stopped) and isinstance(trainer.logger, RunLogger)):  # rank 0's logger
            return
        if isinstance(trainer.strategy.checkpoint_io, BackgroundCheckpointIO):
            try:
                trainer.strategy.checkpoint_io.wait()
            except Exception:  # noqa: BLE001 - raised again by Lightning's teardown, and recorded
                return
        end_logged_run(trainer.logger, "KILLED", f"{exception}")
