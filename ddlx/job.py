"""The training job a prediction is for."""
from __future__ import annotations

from dataclasses import dataclass

from .allocator import SYSTEM

FP32 = "32-true"
# Lightning's short names for its precisions, and what they mean.
PRECISION_ALIASES = {"32": FP32, "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true", "None": FP32, "": FP32}


def precision_of(value) -> str:
    """A trainer.precision value (None: Lightning's default, fp32) by its full name."""
    return PRECISION_ALIASES.get(str(value), str(value))


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
    precision: str = FP32  # Lightning's trainer.precision: runs of another precision do not inform it

    @property
    def steps(self) -> float:
        return self.train_samples / self.batch_size
