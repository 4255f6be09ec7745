"""The training job a prediction is for."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .allocator import SYSTEM

FP32 = "32-true"
MIN_IMAGE_SIZE = 16  # the smallest square input every model takes (data.image_size's bound)
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
    data_cache: str = "none"  # memory: the decoded images kept in memory (ddlx.data.cache); runs of the other do not inform it

    @property
    def steps(self) -> float:
        return self.train_samples / self.batch_size


def validation_images(images: int, val_fraction: float) -> int:
    """The images of ``images`` held out to validate on: at least one where ``val_fraction`` > 0."""
    held_out = round(images * val_fraction)
    return max(1, held_out) if val_fraction > 0 else held_out


def images_of_training_split(train: int, val_fraction: float) -> int:
    """The fewest images whose training split (after :func:`validation_images`) is ``train``."""
    images = max(train, math.floor((train - 0.5) / (1 - val_fraction)) - 1)  # rounding holds out no fewer below it
    while images - validation_images(images, val_fraction) < train:
        images += 1
    return images


def split_too_small(images: int, val_fraction: float, batch_size: int, folder_holds: int | None = None,
                    data_parallel: int = 1, per_worker: bool = False) -> str | None:
    """Why ``images``, split as train.py splits them, cannot give each of ``data_parallel`` processes
    one batch of its share of the global ``batch_size`` (None: they can); with ``per_worker``
    (``data.batch_per=worker``), ``batch_size`` is each process's batch, as the user stated it, and
    the fix is said in those terms. ``folder_holds``: the images a folder of the user's holds (None:
    a synthetic set, written at any count), so that the fix offers only what gives enough:
    data.num_images where the folder's split would fill the batch, a smaller validation split where
    all its images would, else more images."""
    def fits(train_images: int) -> bool:
        return train_images >= batch_size if per_worker else train_images * data_parallel >= batch_size

    train = images - validation_images(images, val_fraction)
    if fits(train):
        return None
    fixes = [f"lower data.batch_size to at most {train if per_worker else train * data_parallel}"] if train else []
    if folder_holds is None:
        fixes.append("raise data.num_images")
    else:
        more = f"raise data.num_images (the folder holds {folder_holds})" if images < folder_holds else ""
        if more and fits(folder_holds - validation_images(folder_holds, val_fraction)):
            fixes.append(more)
        elif fits(folder_holds):
            fixes.append(" and ".join(filter(None, ["lower data.val_fraction", more])))
        else:
            fixes.append("add images to the folder")
    over = " per worker (data.batch_per=worker)" if per_worker else f" over {data_parallel} processes" if data_parallel > 1 else ""
    return (f"the training split has {train} images ({images} images, data.val_fraction={val_fraction}) but "
            f"data.batch_size={batch_size}{over}: {' or '.join(fixes)}")


def worker_batch(data, workers: int) -> int:
    """Each of ``workers`` data-parallel workers' batch (a process's, a pipeline's) under the data
    config ``data``: its share of the global ``data.batch_size``, or with ``data.batch_per=worker``
    the batch itself (so a plan made before ``ddlx.run.batch_of_workers`` makes it global, to count
    the processes, refuses only what the plan after it would)."""
    return data.batch_size if data.batch_per == "worker" else data.batch_size // workers


def synthetic_count_problem(num_images: int | None, num_classes: int) -> str | None:
    """Why a synthetic set (no ``data.root``) cannot be written with ``num_images`` images of
    ``num_classes`` classes (None: it can)."""
    if num_images is None:
        return ("data.num_images=null uses every image of a folder, but a synthetic set (no data.root) is written at "
                "a given count; give data.num_images=N")
    if num_images < num_classes:
        return (f"data.num_images={num_images}: a synthetic dataset needs at least one image per class "
                f"(data.num_classes={num_classes}); raise data.num_images")
    return None


BATCH_PER = ("global", "worker")
# What speedups are over: the sequential strategy, on one core of a CPU (threads=1) or one GPU.
BASELINE = "sequential"
CPU_BASELINE_SETUP = f"{BASELINE} threads=1"
CACHE_CHOICES = ("auto", "none")  # data.cache (ddlx.data.cache)
CACHE_SHARE_OF_RAM = 0.25  # data.cache=auto: what the decoded images may take of a machine's available RAM


def cache_outcome(choice: str, images: int, channels: int, image_size: int, room_bytes: float) -> str:
    """What ``data.cache=choice`` does with ``images`` of ``image_size`` px where ``room_bytes``
    of RAM are available: ``memory`` (decoded once, kept) or ``none`` (decoded every epoch)."""
    need = images * channels * image_size * image_size
    return "memory" if choice == "auto" and need <= CACHE_SHARE_OF_RAM * room_bytes else "none"


@dataclass(frozen=True)
class Batches:
    """Each setup's global batch, from the batch as the user stated it: ``per="global"``, it is
    every setup's global batch; ``per="worker"`` (``data.batch_per=worker``), it is each
    data-parallel process's (a pipeline's), so the global batch grows with the processes, as
    the papers state theirs (Jansen's thesis Table 3.3). ``own``: strategies given a batch of their
    own, in the same terms (the thesis gave GPipe 384 where DDP had 32 per GPU)."""

    per: str = "global"
    own: tuple[tuple[str, int], ...] = ()

    def stated(self, strategy: str) -> int | None:
        """The batch given to ``strategy`` alone, if any."""
        return dict(self.own).get(strategy)

    def job_of(self, job: Job, strategy: str, processes: int) -> Job:
        """``job`` (whose batch is the stated one) with the global batch of a setup of
        ``strategy`` that runs ``processes`` data-parallel processes."""
        stated = self.stated(strategy) or job.batch_size
        batch = stated * processes if self.per == "worker" else stated
        return job if batch == job.batch_size else replace(job, batch_size=batch)


def batch_split_problems(batch_size: int, data_parallel: int) -> list[str]:
    """``data.batch_size`` (the global batch) over ``data_parallel`` processes, each an equal share."""
    if batch_size % data_parallel == 0:
        return []
    return [f"data.batch_size={batch_size} is the global batch and must split evenly over the {data_parallel} "
            f"processes of this strategy; use a multiple of {data_parallel}"]
