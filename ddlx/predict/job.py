"""The training job a prediction is for, and the measured runs it can lean on."""
from __future__ import annotations

from dataclasses import dataclass

from ..allocator import SYSTEM
from ..records import MeasuredRun
from .hardware import HardwareSpec


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

    @classmethod
    def from_run(cls, run: MeasuredRun) -> "Job":
        p, m = run.params, run.metrics
        return cls(
            model=p["model.name"], data=p["data.name"], num_classes=int(p["data.num_classes"]),
            channels=int(p["data.channels"]), image_size=int(p["data.image_size"]),
            batch_size=int(p["data.batch_size"]),
            train_samples=round(m["mean_samples_per_s"] * m["mean_epoch_time_s"]),
            num_workers=int(p.get("data.num_workers", 0)), cpu_allocator=run.workload.cpu_allocator,
        )


def measured_per_batch_s(run: MeasuredRun) -> float:
    """Seconds per global batch of a finished run: its mean epoch time over its steps."""
    job = Job.from_run(run)
    return run.metrics["mean_epoch_time_s"] / job.steps


def usable(run: MeasuredRun) -> bool:
    """Finished, measured the ddlx way, with the params a prediction needs."""
    need = ("model.name", "data.num_classes", "data.channels", "data.image_size", "data.batch_size")
    return (run.status == "FINISHED" and run.tags.get("measured") != "false" and all(k in run.params for k in need)
            and {"mean_epoch_time_s", "mean_samples_per_s"} <= set(run.metrics))


def on_hardware(run: MeasuredRun, hw: HardwareSpec) -> bool:
    """A run measured on ``hw``: tagged with its name, or taken on its host (hw=local)."""
    return run.tags.get("hw") == hw.name or (bool(hw.host) and run.tags.get("host") == hw.host)


def same_network(run: MeasuredRun, job: Job) -> bool:
    p = run.params
    return (p.get("model.name") == job.model and p.get("data.image_size") == str(job.image_size)
            and p.get("data.num_classes") == str(job.num_classes) and p.get("data.channels") == str(job.channels))
