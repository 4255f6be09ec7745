"""A batch norm over one value per channel cannot train (torch raises at that step): a model
whose feature map is 1x1 before a batch norm (VGG's small variant at 16 px) needs two images in
every piece of a batch a layer trains on. Refused before training where the job would give a
layer one image: a process's batch, its epoch's last batch, or a micro-batch or thread's share."""
from __future__ import annotations

import math

import torch
from torch import nn

from .epoch_batches import process_batches, process_images, trained_batches
from .errors import ConfigError
from .models import build_model
from .strategies import STRATEGIES

LARGER_SIZES = 16  # image sizes tried above the job's for the fix


def trains_on_one_sample(model: nn.Module, channels: int, image_size: int) -> bool:
    """Whether every batch norm of ``model`` (on the meta device: shapes only) sees more than one
    value per channel for a single image."""
    seen: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda _, args: seen.append(math.prod(args[0].shape[2:])))
             for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    was_training = model.training
    try:
        model.eval()  # batch norm checks the batch in training only: every layer is reached
        model(torch.empty(1, channels, image_size, image_size, device="meta"))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return all(values > 1 for values in seen)


def one_sample_pieces(cfg, global_batch: int, data_parallel: int, train_images: int) -> list[str]:
    """Where a run of ``cfg`` (the typed train config) with a global batch of ``global_batch``
    trains a layer on one image, each as a phrase; [] where it never does."""
    spec, batch = STRATEGIES[cfg.strategy.name], global_batch // data_parallel
    if cfg.trainer.sync_batchnorm and data_parallel > 1:  # SyncBatchNorm counts every rank's values
        return []
    batches = process_batches(train_images, data_parallel, batch)
    steps = cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else batches  # a run ending within its first epoch
    last = process_images(train_images, data_parallel) % batch \
        if min(trained_batches(cfg.trainer, batches), steps) == batches else 0
    over = f" over {data_parallel} processes" if data_parallel > 1 else ""
    epoch = f"{train_images} training images{over} in batches of {batch}"
    found = []
    if batch == 1:
        found.append(f"data.batch_size={global_batch}{over} is a batch of 1")
    elif spec.smallest_piece(cfg.strategy, batch) == 1:
        found.append(f"strategy={cfg.strategy.name} cuts a batch of {batch} into pieces as small as 1")
    if last == 1:
        found.append(f"the epoch ends in a batch of 1 ({epoch})")
    elif last and spec.smallest_piece(cfg.strategy, last) == 1:
        found.append(f"strategy={cfg.strategy.name} cuts the epoch's last batch of {last} ({epoch}) into pieces as "
                     f"small as 1")
    return found


def check_single_sample_batches(cfg, model: nn.Module, data_parallel: int, train_images: int,
                                per_worker: bool = False) -> None:
    """Refuse, naming the fix, a job that would give a layer of ``model`` (meta) a single image
    where one image cannot train (:func:`trains_on_one_sample`); ``per_worker``: the user stated
    data.batch_size per worker (data.batch_per=worker), as the fix then gives it."""
    pieces = one_sample_pieces(cfg, cfg.data.batch_size, data_parallel, train_images)
    data = cfg.data
    if not pieces or trains_on_one_sample(model, data.channels, data.image_size):
        return
    fixes = []
    for size in range(data.image_size + 1, data.image_size + LARGER_SIZES + 1):
        with torch.device("meta"):
            larger = build_model(cfg.model.name, data.num_classes, data.channels, size, cfg.model.dropout)
        if trains_on_one_sample(larger, data.channels, size):
            fixes.append(f"data.image_size={size}")
            break
    spec = STRATEGIES[cfg.strategy.name]
    larger_batches = range(data.batch_size + data_parallel, train_images + 1, data_parallel)
    batch = next((b for b in larger_batches if spec.takes_batch(cfg.strategy, b // data_parallel)
                  and not one_sample_pieces(cfg, b, data_parallel, train_images)), None)
    if batch is not None:
        fixes.append(f"data.batch_size={batch // data_parallel if per_worker else batch}")
    raise ConfigError(
        f"model={cfg.model.name} at data.image_size={data.image_size} has a batch norm over a 1x1 feature map, "
        f"which cannot train on a single image, and {'; '.join(pieces)}: use {' or '.join(fixes) or 'a larger batch'}")
