"""The batches an epoch has in each process, and the ``trainer.*`` values Lightning refuses for
them only once the run has opened (a FAILED run and a traceback): refused before it instead."""
from __future__ import annotations

import math


def process_images(images: int, data_parallel: int) -> int:
    """The images of an epoch each of ``data_parallel`` processes sharing ``images`` takes
    (DistributedSampler pads every one to the same count)."""
    return math.ceil(images / data_parallel)


def process_batches(images: int, data_parallel: int, batch: int) -> int:
    """Batches of ``batch`` in each of ``data_parallel`` processes sharing ``images``."""
    return math.ceil(process_images(images, data_parallel) / batch)


def epoch_trained(trainer) -> bool:
    """Whether the running epoch has trained all its batches (Lightning's progress): its own
    validation and its end hooks may still be to come."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.current.ready >= trainer.num_training_batches or progress.is_last_batch  # an iterable's count is inf


def _limited(batches: int, limit) -> int:
    """Lightning's count of ``batches`` under a ``limit_*_batches`` (a count, or a share)."""
    if limit is None:
        return batches
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


def _limits(trainer) -> dict[str, tuple[str, object]]:
    """Each stage's limit of batches, with the key that set it: Lightning takes overfit_batches
    as both limits when it is set."""
    if trainer.overfit_batches:
        return {stage: ("trainer.overfit_batches", trainer.overfit_batches) for stage in ("train", "val")}
    return {"train": ("trainer.limit_train_batches", trainer.limit_train_batches),
            "val": ("trainer.limit_val_batches", trainer.limit_val_batches)}


def trained_batches(trainer, batches: int) -> int:
    """The batches of an epoch of ``batches`` Lightning trains under the typed ``trainer`` config."""
    if trainer.fast_dev_run:
        return min(batches, int(trainer.fast_dev_run))
    return _limited(batches, _limits(trainer)["train"][1])


def trainer_batch_problems(trainer, train_batches: int, val_batches: int) -> list[str]:
    """What Lightning would refuse in the typed ``trainer`` config for epochs of ``train_batches``
    and ``val_batches`` a process, each with the fix."""
    if trainer.fast_dev_run:  # Lightning's own count of batches, every limit and interval aside
        return []
    limits = _limits(trainer)
    problems = []
    for stage, batches in (("train", train_batches), ("val", val_batches)):
        key, limit = limits[stage]
        if isinstance(limit, float) and limit > 0 and batches and int(batches * limit) == 0:
            problems.append(f"{key}={limit} of the {batches} {stage} batch(es) an epoch has in each process is less "
                            f"than one; use at least {key}={math.ceil(1e4 / batches) / 1e4:g}, or a count (e.g. {key}=1)")
    trained, interval = trained_batches(trainer, train_batches), trainer.val_check_interval
    validates = limits["val"][1] is None or limits["val"][1] > 0
    if isinstance(interval, int) and not isinstance(interval, bool) and interval > trained and validates \
            and trainer.check_val_every_n_epoch is not None:
        problems.append(f"trainer.val_check_interval={interval} batches, but an epoch trains {trained} in each process; "
                        f"use at most {trained}, a share of the epoch (e.g. trainer.val_check_interval=0.5), or "
                        f"trainer.check_val_every_n_epoch=null to count batches across epochs")
    return problems
