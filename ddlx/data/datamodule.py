"""The LightningDataModule train.py trains from: :class:`~.image_data.ImageFolderData` (whose
loaders follow ``self.trainer`` where Lightning sets one) with LightningDataModule's hook machinery."""
from __future__ import annotations

import pytorch_lightning as pl

from .image_data import ImageFolderData


class ImageFolderDataModule(ImageFolderData, pl.LightningDataModule):
    """Train/validation loaders over an ImageFolder tree, for a Lightning Trainer (whose strategy
    and ``overfit_batches`` the loaders follow: :meth:`ImageFolderData._loader`)."""


def build_datamodule(data, data_parallel: int = 1, per_worker: bool = False) -> ImageFolderDataModule:
    """The datamodule for one process (:meth:`ImageFolderData.of_process`)."""
    return ImageFolderDataModule.of_process(data, data_parallel, per_worker)
