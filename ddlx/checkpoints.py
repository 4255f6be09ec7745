"""Checkpoints: what a run keeps (``checkpoint.save``, ``checkpoint.keep_best``), how a file is
written (whole or not at all), and what a checkpoint says about the run it belongs to, so
``ckpt_path=`` resumes that run.

Every checkpoint carries ``checkpoint["ddlx"]``: the MLflow run's id, store and experiment, and
the run's resolved config. Lightning restores the rest (weights, optimizer, loops, callbacks).
"""
from __future__ import annotations

import os
import random
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import AsyncCheckpointIO

from .epoch_batches import epoch_trained
from .errors import CheckpointNotWritten, ConfigError
from .preflight import checkpoint_path_problem

LAST = "last.ckpt"
# A plan's tags that no config key sets: how it was started (mpirun -np: ranks; the nodes srun or torchrun spread it over).
LAYOUT_TAGS = ("ranks", "nodes")
# Config keys a resumed run may change: where things are, and how long to train. Any other
# difference would record a run that is not what its params say.
MAY_CHANGE_ON_RESUME = ("ckpt_path", "paths.", "data.root", "data.synthetic_dir", "logger.", "trainer.max_epochs",
                        "trainer.max_steps", "trainer.max_time", "trainer.enable_progress_bar",
                        "trainer.enable_model_summary", "checkpoint.")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a local checkpoint to a temporary file beside it, synced, then renamed over the
    target: a write cut short (disk full, a kill) leaves the previous checkpoint, never a
    truncated file under a valid name. (Lightning's own writer stages the file in the system's
    temporary folder and, on another file system, copies it into place.) Remote paths
    (``s3://``...) go through Lightning's writer."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if "://" in str(path) or storage_options is not None:
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphaned_partials(path)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
        except BaseException as err:
            partial.unlink(missing_ok=True)
            if isinstance(err, Exception):  # torch reports a refused write as a RuntimeError of its zip writer
                raise CheckpointNotWritten(f"checkpoint {path} not written ({type(err).__name__}: {err}); the file system refused "
                              f"it (full, or over a size limit?); {path.name} is as it was before") from err
            raise
        _sync_folder(path.parent)


def _remove_orphaned_partials(path: Path) -> None:
    """The partial files of writes whose process was killed before it could remove them."""
    import psutil

    for partial in path.parent.glob(f".{path.name}.*.partial"):
        pid = partial.name[len(path.name) + 2 : -len(".partial")]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            partial.unlink(missing_ok=True)


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename is still atomic
    finally:
        os.close(fd)


def checkpoint_callbacks(save: str, keep_best: bool, folder: Path, every_minutes: float | None = None) -> list[ModelCheckpoint]:
    """``last.ckpt``, rewritten at each epoch end (after its validation) and, with ``every_minutes``,
    within an epoch once that many minutes of training have passed since the last one; with
    ``keep_best``, the best by ``val_acc`` beside it."""
    if save == "none":
        return []
    weights_only = save == "weights"
    # monitor=None with save_top_k=1 rewrites its one file at every epoch end. (Lightning 2.6's
    # save_last=True writes last.ckpt only when a top-k checkpoint is saved at the same step: with
    # save_top_k=0, never before training ends.) No version counter: a stop's checkpoint
    # (stopping.StopAtSignal) replaces last.ckpt too, and a resumed run goes on replacing it.
    # At the training epoch's end (its validation, where it has one, is over by then): Lightning
    # would save at validation's end instead, so with trainer.check_val_every_n_epoch > 1 or a
    # val_check_interval within the epoch, last.ckpt missed the epochs without validation.
    last = {"dirpath": folder, "filename": Path(LAST).stem, "monitor": None, "save_top_k": 1,
            "save_weights_only": weights_only, "enable_version_counter": False, "save_on_train_epoch_end": True}
    callbacks = [ModelCheckpoint(**last)]
    if every_minutes is not None:  # Lightning takes one trigger per callback: the time's is a second one
        callbacks.append(WithinEpochCheckpoint(**last, train_time_interval=timedelta(minutes=every_minutes)))
    if keep_best:
        callbacks.append(ModelCheckpoint(dirpath=folder, filename="best-epoch{epoch}-val_acc{val_acc:.4f}",  # no "=": ckpt_path=FILE as Hydra reads it
                                         auto_insert_metric_name=False, monitor="val_acc", mode="max", save_top_k=1,
                                         save_weights_only=weights_only, enable_version_counter=False))
    return callbacks


class WithinEpochCheckpoint(ModelCheckpoint):
    """Lightning's time-triggered checkpoint, within an epoch only: after an epoch's last batch it
    would write the state before that epoch's validation, from which Lightning resumes by counting
    the epoch done and skipping its validation and end (its figures never logged), and the
    epoch-end checkpoint follows anyway. Its minutes count from that epoch-end checkpoint."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args, **kwargs) -> None:
        if not epoch_trained(trainer):  # alike on every rank: Lightning's time check broadcasts
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._last_time_checked = time.monotonic()


def checkpoint_writer(background: bool) -> CheckpointIO:
    """How checkpoints reach the disk: :class:`AtomicCheckpointIO`, by the training thread or,
    with ``background``, by :class:`BackgroundCheckpointIO` from a snapshot."""
    return BackgroundCheckpointIO(AtomicCheckpointIO()) if background else AtomicCheckpointIO()


class BackgroundCheckpointIO(AsyncCheckpointIO):
    """Lightning's asynchronous writer (one thread; a write's error is raised at the next save or
    when training ends, where Lightning waits for the writes in flight), writing a snapshot taken
    in host memory: Lightning's own clones each tensor on its device, which on a GPU would hold a
    second copy of the weights and optimizer state in device memory for as long as the disk
    takes. The training step waits for that copy only, not for the disk."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        snapshot = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))
        self._ensure_setup()

        def write() -> None:
            try:
                self.checkpoint_io.save_checkpoint(snapshot, path, storage_options)
            except BaseException as err:  # noqa: BLE001 - raised on the training thread (AsyncCheckpointIO's way)
                self._error = err

        self._executor.submit(write)
        if self._error:
            raise self._error

    def wait(self) -> None:
        """Until the writes in flight are on disk (one thread: in order); a write's error is raised."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()
        if self._error:
            raise self._error


class RunInCheckpoint(pl.Callback):
    """Writes the run's identity and config into every checkpoint (``checkpoint["ddlx"]``), and
    keeps the random number generators' states, so a resumed run draws what it would have drawn
    (dropout masks, flips) had it not stopped."""

    def __init__(self, config: Mapping[str, Any], layout: Mapping[str, str] | None = None) -> None:
        self.config = dict(config)
        self.layout = dict(layout or {})  # how it was started (LAYOUT_TAGS): the config does not hold it
        self.run_id: str | None = None
        self.tracking_uri: str | None = None
        self.experiment: str | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["ddlx"] = {"mlflow_run_id": self.run_id, "tracking_uri": self.tracking_uri,
                              "experiment": self.experiment, "config": self.config, "layout": self.layout}

    def state_dict(self) -> dict[str, Any]:
        """This rank's generators and, with several ranks, every rank's under ``ranks``: a
        pipeline's stages draw apart (only the stages with dropout draw its masks), so rank 0's
        would give the others masks they never drew. Every rank writes the checkpoint (Lightning's
        save_checkpoint), so every rank takes part in gathering them."""
        own = _generators()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, own)
            return {**own, "ranks": ranks}
        return own

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import numpy

        ranks = state.get("ranks")
        if ranks and dist.is_available() and dist.is_initialized() and dist.get_world_size() == len(ranks):
            state = ranks[dist.get_rank()]
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
        cuda = state.get("cuda") or []
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _generators() -> dict[str, Any]:
    """This process's random number generators' states, as tensors and plain values: checkpoints
    load with torch.load(weights_only=True)."""
    import numpy

    kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


@dataclass
class SavedRun:
    """What a checkpoint says about the run that wrote it."""

    path: Path
    run_id: str | None
    tracking_uri: str | None
    experiment: str | None
    config: dict[str, Any]
    epoch: int
    global_step: int
    epochs_done: int = 0  # whole epochs trained (the epoch in progress at a stop within one not among them)
    layout: dict[str, str] = field(default_factory=dict)  # its LAYOUT_TAGS (none in checkpoints from before them)

    def layout_changed(self, now: Mapping[str, str]) -> str | None:
        """None, or how this job's ranks or nodes (``now``: its plan's :data:`LAYOUT_TAGS`) differ
        from those of the run that wrote the checkpoint, with the fix."""
        changed = {key: value for key, value in self.layout.items() if now.get(key, value) != value}
        if not changed:
            return None
        then = ", ".join(f"{key}={value}" for key, value in changed.items())
        return (f"ckpt_path={self.path} was written by a run of {then} (now "
                f"{', '.join(f'{key}={now[key]}' for key in changed)}): a resumed run keeps the ranks and nodes it was "
                f"started with, or its epochs would be timed on two layouts; start it as that run was started (mpirun "
                f"-np, srun --nodes and --ntasks, torchrun --nnodes and --nproc-per-node, or train.py alone where ddlx "
                f"started its processes), or start a new run without ckpt_path")

    def epoch_left_out(self, trainer) -> str | None:
        """None, or how the typed ``trainer`` config would close the run before the epoch its
        checkpoint was written within: FINISHED after fewer epochs than its weights trained."""
        if trainer.max_epochs in (None, -1) or self.epoch != self.epochs_done or self.epochs_done < trainer.max_epochs:
            return None
        return (f"ckpt_path={self.path} was written within epoch {self.epoch + 1}, whose steps its weights hold; "
                f"trainer.max_epochs={trainer.max_epochs} would close the run after {trainer.max_epochs} epoch(s) without "
                f"them; resume with trainer.max_epochs={self.epochs_done + 1} or more")

    def nothing_left(self, trainer) -> str | None:
        """None, or how the typed ``trainer`` config leaves nothing to train after this checkpoint, with the fix."""
        max_epochs = trainer.max_epochs
        if max_epochs is None and trainer.max_steps == -1 and trainer.max_time is None:
            max_epochs = 1000  # Lightning's default then (with max_time set: no limit of epochs)
        spent = []
        if max_epochs not in (None, -1) and self.epochs_done >= max_epochs:
            spent.append((f"trainer.max_epochs={max_epochs}", f"its {self.epochs_done} epoch(s)",
                          f"trainer.max_epochs={self.epochs_done + 1}"))
        if trainer.max_steps > 0 and self.global_step >= trainer.max_steps:
            spent.append((f"trainer.max_steps={trainer.max_steps}", f"its {self.global_step} step(s)",
                          f"trainer.max_steps={self.global_step + 1}"))
        if not spent:
            return None
        return (f"{' and '.join(s for s, _, _ in spent)} leave(s) nothing to train after {' and '.join(d for _, d, _ in spent)}; "
                f"raise {'them' if len(spent) > 1 else 'it'} to train on (e.g. {' '.join(f for _, _, f in spent)})")


def read_saved_run(path: str | os.PathLike) -> SavedRun:
    """The run a checkpoint belongs to, read without loading its tensors; a :class:`ConfigError`
    when it cannot resume one (missing, unreadable or cut short, weights only)."""
    problem = checkpoint_path_problem(path)
    if problem:
        raise ConfigError(problem)
    path = Path(path).expanduser().resolve()
    fix = "give the path of a run's checkpoints/last.ckpt"
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise ConfigError(f"ckpt_path={path} cannot be read as a checkpoint ({type(err).__name__}: {err}); "
                          f"it may be cut short or damaged: {fix}") from None
    if "optimizer_states" not in checkpoint or "loops" not in checkpoint:
        raise ConfigError(f"ckpt_path={path} holds the model's weights only (checkpoint.save=weights), not the "
                          f"optimizer and loop state a run resumes from; resume from a checkpoint written with "
                          f"checkpoint.save=full")
    meta = checkpoint.get("ddlx") or {}
    epoch = int(checkpoint.get("epoch", 0))
    progress = checkpoint["loops"].get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    return SavedRun(path, meta.get("mlflow_run_id"), meta.get("tracking_uri"), meta.get("experiment"),
                    dict(meta.get("config") or {}), epoch, int(checkpoint.get("global_step", 0)),
                    int(progress.get("processed", epoch)), dict(meta.get("layout") or {}))


def _as_override(text: str | None) -> str:
    """A flattened config value (``str()`` of it) as a Hydra override on a shell's command line writes it."""
    text = str(text)
    if text in ("None", "True", "False"):
        return {"None": "null", "True": "true", "False": "false"}[text]
    if text.startswith("[") and text.endswith("]"):  # a list: Hydra's own form, without spaces
        return text.replace(" ", "").replace("'", "")
    return shlex.quote(text)


# Groups whose option the config names as <group>.name: another option is given back as the option.
NAMED_GROUPS = ("strategy", "model", "data")


def _fix_words(refused: Mapping[str, str], flat_then: Mapping[str, str], flat_now: Mapping[str, str],
               option_params: Callable[[str], Mapping[str, str] | None] | None,
               command_keys: frozenset[str] | None) -> tuple[list[str], list[str], list[str]]:
    """(the differences as said, the command's options the words replace, the overrides that give
    the checkpoint's run back its settings ``refused``). Another option of a group
    (``data=cifar10`` for ``firesmall``) is said and given back as the option, with those of its
    keys that the run had set otherwise or this command sets (``command_keys``: the keys its
    overrides name; None: those that differ from the option's). ``option_params``: the values an
    option sets; where they cannot be composed (None, or the option is gone), every key of the
    group is given, with ``model.name``/``data.name`` for the option. Other keys as they were."""
    said, replaced, words = [], [], []
    switched = [g for g in NAMED_GROUPS if f"{g}.name" in refused]
    for group in switched:
        then, now = flat_then[f"{group}.name"], refused[f"{group}.name"]
        of_then = option_params(f"{group}={then}") if option_params else None
        # (the command's own keys, where known, say what it set: no second composition then)
        of_now = option_params(f"{group}={now}") if option_params and command_keys is None and now != "(unset)" else None
        said.append(f"{group}={then} (now {now})")
        if now != "(unset)":
            replaced.append(f"{group}={now}")
        # strategy=: each strategy has its own keys; models and datasets share theirs.
        words.append(f"{group}={then}" if of_then is not None or group == "strategy" else f"{group}.name={then}")
        for key in sorted(k for k in flat_then if k.startswith(f"{group}.") and k != f"{group}.name"):
            set_then = of_then is None or of_then.get(key) != flat_then[key]
            set_now = key in refused and (key in command_keys if command_keys is not None
                                          else of_now is None or of_now.get(key) != flat_now.get(key))
            if set_then and not key.startswith(MAY_CHANGE_ON_RESUME) or set_now:
                words.append(f"{key}={_as_override(flat_then[key])}")
            if key in refused and (set_then or set_now):
                said.append(f"{key}={flat_then[key]} (now {refused[key]})")
    others = sorted(k for k in refused if not k.startswith(tuple(f"{g}." for g in switched)))
    said += [f"{k}={flat_then.get(k)} (now {refused[k]})" for k in others]
    words += [f"{k}={_as_override(flat_then.get(k))}" for k in others]
    return said, replaced, words


def check_resumable(saved: SavedRun, flat_now: Mapping[str, str], flatten, option_params=None,
                    command_keys: frozenset[str] | None = None) -> dict[str, str]:
    """The settings a resumed run changes (``MAY_CHANGE_ON_RESUME``); any other difference from
    the checkpoint's run is a :class:`ConfigError` naming it and the overrides that undo it
    (``option_params``, ``command_keys``: see :func:`_fix_words`)."""
    if not saved.config:
        return {}
    flat_then = flatten(saved.config)
    changed = {k: v for k, v in flat_now.items() if k in flat_then and flat_then[k] != v}
    changed.update({k: "(unset)" for k in flat_then if k not in flat_now})
    refused = {k: v for k, v in changed.items() if not k.startswith(MAY_CHANGE_ON_RESUME)}
    synthetic_then, synthetic_now = (flat.get("data.root", "None") == "None" for flat in (flat_then, flat_now))
    if not synthetic_then and not synthetic_now:  # a folder's data.name is its folder's: it moves with data.root
        refused.pop("data.name", None)
    if synthetic_then != synthetic_now:  # a moved folder may change; the images trained on may not
        then = "synthetic images" if synthetic_then else f"the images of data.root={flat_then['data.root']}"
        now = "synthetic images" if synthetic_now else f"the images of data.root={flat_now['data.root']}"
        raise ConfigError(f"ckpt_path={saved.path} was written by a run on {then}, and this one would train on {now}: "
                          f"one run of two datasets; resume on the same data, or start a new run without ckpt_path")
    if refused:
        said, replaced, words = _fix_words(refused, flat_then, flat_now, option_params, command_keys)
        instead = f"in place of {' '.join(replaced)}, " if replaced else ""
        raise ConfigError(f"ckpt_path={saved.path} was written by a run with {', '.join(said)}: a resumed run keeps its "
                          f"settings; {instead}resume with {' '.join(words)}, or start a new run without ckpt_path")
    return {k: v for k, v in changed.items() if k != "ckpt_path"}
