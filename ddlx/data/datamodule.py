"""The LightningDataModule train.py trains from: :class:`~.image_data.ImageFolderData` with
Lightning's hooks (its trainer, checkpointed loader state)."""
from __future__ import annotations

import pytorch_lightning as pl

from .image_data import ImageFolderData


class ImageFolderDataModule(ImageFolderData, pl.LightningDataModule):
    """Train/validation loaders over an ImageFolder tree, for a Lightning Trainer (whose strategy
    and ``overfit_batches`` the loaders follow: :meth:`ImageFolderData._loader`)."""


def build_datamodule(data, data_parallel: int = 1) -> ImageFolderDataModule:
    """The datamodule for one process from the typed ``data`` config: ``data.batch_size`` is the
    global batch, split evenly."""
    return ImageFolderDataModule.of_process(data, data_parallel)
