"""What a job is refused for before torch, Lightning or MLflow load (about a second, not ten):
the config's consistency across keys (each key's own type and range is :mod:`.config_check`'s),
the paths it names, and what the machine's description says (a GPU job on a machine without
one). train.py checks every job of its command line so before Hydra starts one; ddlx.run.train
checks again for callers that skip train.py. Nothing here imports torch.
"""
from __future__ import annotations

import glob
import os
import sys
import tempfile
from operator import attrgetter
from pathlib import Path
from typing import Callable

from .config import TrainConfig
from .costmodel.numerics import CPU_FP16
from .epoch_batches import process_batches, trainer_batch_problems
from .data.statistics import standard_statistics
from .errors import ConfigError, missing_data_root, unset_data_root
from .job import (batch_split_problems, precision_of, split_too_small, synthetic_count_problem, validation_images,
                  worker_batch)
from .strategies import STRATEGIES


def check_before_torch(cfg: TrainConfig) -> None:
    """Every problem of the typed train config ``cfg`` found without torch, as one :class:`ConfigError`."""
    problems = [*consistency_problems(cfg), *path_problems(cfg), *machine_problems(cfg)]
    if problems:
        raise ConfigError("; ".join(problems))


def data_problems(data) -> list[str]:
    """Values of the data config (:class:`~ddlx.config.DataConfig`) its keys' ranges cannot say."""
    problems = []
    for key, standard in zip(("mean", "std"), standard_statistics(data.channels or 3)):  # (null: the folder's)
        values = getattr(data, key)
        if values is not None and data.channels is not None and len(values) != data.channels:
            problems.append(f"data.{key}={list(values)} has {len(values)} value(s) for data.channels={data.channels}; "
                            f"give one per channel, e.g. data.{key}=[{','.join(map(str, standard))}]")
    if data.classes is not None and data.num_classes is not None and len(data.classes) != data.num_classes:
        problems.append(f"data.classes lists {len(data.classes)} names but data.num_classes={data.num_classes}: give as many "
                        f"names as classes, or data.classes=null (for your own folder: data=imagefolder)")
    if data.std is not None and any(value <= 0 for value in data.std):
        problems.append(f"data.std={list(data.std)}: every pixel is divided by it; give values > 0, one per channel")
    sizes = list(data.synthetic_size)
    if len(sizes) != 2 or not 1 <= sizes[0] <= sizes[1]:
        problems.append(f"data.synthetic_size={sizes}: expected [min, max], the side in pixels of the synthetic images, "
                        f"with 1 <= min <= max, e.g. data.synthetic_size=[320,800]")
    return problems


def consistency_problems(cfg: TrainConfig) -> list[str]:
    problems = data_problems(cfg.data)
    m, epochs = cfg.measure, cfg.trainer.max_epochs
    warmup = max(1, m.warmup_epochs)  # the fix offered: the thesis' mean of 3 after a warm-up
    if epochs == 0:  # the warm-up is not why: say what the command set
        problems.append(f"trainer.max_epochs=0 trains no epoch, so there is nothing to measure; use e.g. "
                        f"trainer.max_epochs={warmup + 3} measure.warmup_epochs={warmup} for the thesis' mean of 3 "
                        f"after warm-up")
    elif epochs not in (None, -1) and m.warmup_epochs >= epochs:
        problems.append(
            f"measure.warmup_epochs={m.warmup_epochs} with trainer.max_epochs={epochs} leaves no epoch to measure; "
            f"use 0 <= warmup_epochs < max_epochs (e.g. trainer.max_epochs={warmup + 3} "
            f"measure.warmup_epochs={warmup} for the thesis' mean of 3 after warm-up)")
    for key, value in (("trainer.max_steps", cfg.trainer.max_steps), ("trainer.limit_train_batches", cfg.trainer.limit_train_batches)):
        if value == 0:  # Lightning skips training: the run would end FINISHED with no epoch measured
            problems.append(f"{key}={value} trains no batch, so there is nothing to measure; leave {key} out for every batch")
    for unit in ("epochs", "steps"):  # Lightning stops at the max without a word
        least, most = getattr(cfg.trainer, f"min_{unit}"), getattr(cfg.trainer, f"max_{unit}")
        if least is not None and most not in (None, -1) and least > most:
            problems.append(f"trainer.min_{unit}={least} with trainer.max_{unit}={most}: training stops at the max; "
                            f"use min_{unit} <= max_{unit} (e.g. trainer.max_{unit}={least})")
    max_time = cfg.trainer.max_time
    if max_time is not None and not isinstance(max_time, (str, dict)):  # Lightning's forms; a number has no unit
        problems.append(f"trainer.max_time={max_time}: expected days:hours:minutes:seconds, e.g. "
                        f"trainer.max_time=00:00:10:00 for ten minutes, or trainer.max_time={{minutes:10}}")
    if cfg.checkpoint.keep_best and cfg.data.val_fraction == 0:
        problems.append("checkpoint.keep_best=true keeps the checkpoint with the best val_acc, but data.val_fraction=0 "
                        "holds no images out to validate on; set data.val_fraction=0.2 (or keep_best=false)")
    problems += STRATEGIES[cfg.strategy.name].knob_problems(cfg.strategy)
    parallel = STRATEGIES[cfg.strategy.name].data_parallel(cfg.strategy)
    if cfg.data.batch_per == "global" and parallel:
        problems += batch_split_problems(cfg.data.batch_size, parallel)
    if (batch := known_worker_batch(cfg.data, parallel)) is not None and \
            (problem := STRATEGIES[cfg.strategy.name].batch_problem(cfg.strategy, batch, cfg.data.batch_size, parallel or 1,
                                                                    cfg.data.batch_per == "worker")):
        problems.append(problem)
    problems += synthetic_set_problems(cfg, parallel)
    if cfg.model.memory_format == "channels_last" and \
            (why := STRATEGIES[cfg.strategy.name].channels_last_problem(cfg.strategy)):
        problems.append(f"model.memory_format=channels_last with strategy={cfg.strategy.name}: {why}")
    if cfg.compile.enable:
        try:
            STRATEGIES[cfg.strategy.name].compile_unit(cfg.strategy)
        except ConfigError as err:
            problems.append(str(err))
    return problems


def known_worker_batch(data, data_parallel: int | None) -> int | None:
    """Each data-parallel worker's batch (:func:`~ddlx.job.worker_batch`) where it is known before
    launch: stated per worker, or a global batch that splits evenly over ``data_parallel`` known
    processes (else :func:`~ddlx.job.batch_split_problems` says why, or mpi's ranks are to come)."""
    known = data.batch_per == "worker" or (data_parallel and data.batch_size % data_parallel == 0)
    return worker_batch(data, data_parallel or 1) if known else None


def synthetic_set_problems(cfg: TrainConfig, data_parallel: int | None) -> list[str]:
    """What the datamodule would refuse in a synthetic set (no data.root: its image count is the
    config's) once written and split, ten seconds in, and Lightning at the first step: too few
    images for its classes, for a batch of each of ``data_parallel`` processes (None: mpi's ranks,
    known once launched), for the trainer's batch limits. A folder's count is known once read."""
    data = cfg.data
    if data.root is not None or unset_data_root(data):
        return []
    if problem := synthetic_count_problem(data.num_images, data.num_classes):
        return [problem]
    per_worker = data.batch_per == "worker"
    if data_parallel is None and not per_worker:
        return []
    if problem := split_too_small(data.num_images, data.val_fraction, data.batch_size, None, data_parallel or 1, per_worker):
        return [problem]
    share = known_worker_batch(data, data_parallel)
    if data_parallel is None or share is None:
        return []
    val = validation_images(data.num_images, data.val_fraction)
    return trainer_batch_problems(cfg.trainer, process_batches(data.num_images - val, data_parallel, share),
                                  process_batches(val, data_parallel, share))


# Folders an empty value would silently put at the file system's root (${paths.root}/mlflow.db: /mlflow.db).
FOLDER_KEYS = ("paths.root", "paths.data_dir", "data.synthetic_dir", "logger.artifact_location")


def empty_folders(value_of: Callable[[str], object]) -> list[str]:
    """The :data:`FOLDER_KEYS` set to '' (``value_of(key)``: a key's value, None where unset)."""
    return [f"{key}='' is empty; give a folder, or leave {key} out for its default"
            for key in FOLDER_KEYS if (value := value_of(key)) is not None and not str(value).strip()]


def path_problems(cfg: TrainConfig) -> list[str]:
    from .tracking import store_uri_problem

    problems = [*empty_folders(lambda key: attrgetter(key)(cfg)), *data_root_problems(cfg.data)]
    if problem := store_uri_problem(cfg.logger.tracking_uri):
        problems.append(problem)
    if cfg.ckpt_path is not None:
        problem = checkpoint_path_problem(cfg.ckpt_path)
        if problem:
            problems.append(problem)
    return problems


def data_root_problems(data) -> list[str]:
    """Why ``data`` (a data config, train.py's or recommend.py's) names no folder to read: a
    ``data.root`` that is not one, or none where the keys are to be read from one."""
    root = data.root
    if root is not None and (not str(root).strip() or not Path(root).expanduser().is_dir()):  # "": not the current folder
        return [missing_data_root(root)]
    problem = unset_data_root(data)
    return [problem] if problem else []


def checkpoint_path_problem(path) -> str | None:
    """Why ``ckpt_path=path`` names no checkpoint file (None: it names a file)."""
    fix = "give the path of a run's checkpoints/last.ckpt"
    if not str(path).strip():  # an unset shell variable: Path("") would be the current folder
        return f"ckpt_path={path!r} is empty; {fix}, or leave ckpt_path out to start a new run"
    path = Path(path).expanduser().resolve()
    if path.is_dir():
        inside = next((c for c in (path / "last.ckpt", path / "checkpoints" / "last.ckpt") if c.is_file()), None)
        return (f"ckpt_path={path} is a folder, not a checkpoint file; "
                + (f"resume with ckpt_path={inside}" if inside else fix))
    if not path.is_file():
        return f"ckpt_path={path} does not exist; {fix}"
    return None


def run_folder_problem(folder: str, key: str) -> str | None:
    """Why the run folder ``folder`` (set by ``key``) cannot be made, e.g. on a read-only file
    system or where a file stands; None when it can."""
    return folder_problem(folder, key, f"choose another {key} (or paths.root)")


def folder_problem(folder, setting: str, fix: str) -> str | None:
    """Why ``folder`` (given as ``setting``) cannot be made, with ``fix``; None when it can. Tried
    for real, as permission bits do not tell (root passes them in /proc): a folder made and
    removed where the first missing part of ``folder`` would go."""
    path = Path(folder).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{setting}={folder}: {existing} is a file, not a folder; {fix}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ddlx-check-", dir=existing))
    except OSError as err:
        return f"{setting}={folder}: cannot create a folder in {existing} ({err.strerror}); {fix}"
    return None


def machine_problems(cfg: TrainConfig) -> list[str]:
    spec = STRATEGIES[cfg.strategy.name]
    gpus = gpu_may_be_present()
    if spec.needs_gpu(cfg.strategy, cfg.trainer.accelerator) and not gpus:
        return [spec.no_gpu_problem(cfg.strategy, cfg.trainer.accelerator)]
    # On CPU for sure only without a GPU: with one, the plan may place the job there whatever the
    # trainer says (split, pipe and hybrid take the GPUs devices=auto finds), and ddlx.run checks it.
    problem = precision_problem(cfg, spec.refused_precisions(cfg.strategy), on_cpu=not gpus, gpus_here=gpus)
    return [problem] if problem else []


def precision_problem(cfg: TrainConfig, refused: dict[str, str], on_cpu: bool, gpus_here: bool) -> str | None:
    """Why the job cannot train in its ``trainer`` config's precision or batch norm: ``refused``
    by its strategy (precision: why), or ``on_cpu``; None where it can. ``gpus_here``: whether
    training on GPUs is a fix to offer."""
    why = {**refused, **(CPU_FP16 if on_cpu else {})}.get(precision_of(cfg.trainer.precision))
    if why is not None:
        return f"trainer.precision={cfg.trainer.precision} with strategy={cfg.strategy.name}: {why}"
    if cfg.trainer.sync_batchnorm and on_cpu:  # torch's SyncBatchNorm would fail at the first step
        return ("trainer.sync_batchnorm=true: torch's SyncBatchNorm runs only on CUDA devices; "
                + ("train on GPUs (trainer=gpu) or set " if gpus_here else "set ") + "trainer.sync_batchnorm=false")
    return None


def gpu_may_be_present() -> bool:
    """False when no GPU can be visible to torch here: no NVIDIA or AMD device node, or
    CUDA_VISIBLE_DEVICES hiding them all. True where it cannot tell without torch (not Linux)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    if not sys.platform.startswith("linux"):
        return True
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg")
