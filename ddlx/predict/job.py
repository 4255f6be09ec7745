"""The training job a prediction is for."""
from __future__ import annotations

from dataclasses import dataclass

from ..allocator import SYSTEM


@dataclass(frozen=True)
class Job:
    model: str
    data: str
    num_classes: int
    channels: int
    image_size: int
    batch_size: int  # global
    train_samples: int  # per epoch
    num_workers: int = 0  # data loader worker processes per training process (data.num_workers)
    cpu_allocator: str = SYSTEM  # see ddlx/allocator.py: runs of another allocator do not inform it

    @property
    def steps(self) -> float:
        return self.train_samples / self.batch_size
