"""Decoded images kept in memory (``data.cache``): each image is read, decoded and scaled once
per machine and run, not once per epoch by every process's loader workers.

What a training sample costs the loader is mostly the JPEG decode and the resize; what is left
per epoch from the kept pixels (uint8, after :meth:`.transforms.ImageTransform.decode`) is the
conversion to float, the normalization and the flip, the same operations on the same pixels, so
a sample is the same tensor to the bit with or without the cache. The pixels lie in one file of
shared memory per machine that every process of the job there maps (its ranks and their loader
workers); the processes of a machine decode their share of the images, each with a thread per
core, before the first epoch. ``auto`` keeps them when they take at most a quarter
(:data:`ddlx.job.CACHE_SHARE_OF_RAM`) of the RAM every machine of the job has available, and fit
in its shared memory; ``none`` decodes every image in every epoch, as the loader always did.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from ..job import CACHE_SHARE_OF_RAM, cache_outcome
from ..parallel.shared_memory import SHM_DIR, shared_file

log = logging.getLogger(__name__)



@dataclass
class MachineGroup:
    """The processes of this job on this machine: this one's index among them, their count, and
    the collectives over the whole job that :func:`.shared_memory.shared_file` needs."""

    index: int
    count: int
    barrier: Callable[[], None]
    broadcast_name: Callable[[str | None], str]  # the name this machine's first process gave
    agree: Callable[[bool], bool]  # True when every process of the job says True


def machine_group() -> MachineGroup:
    if not (dist.is_available() and dist.is_initialized()):
        return MachineGroup(0, 1, lambda: None, lambda name: name, lambda ok: ok)
    hosts = _gathered(socket.gethostname())
    here = [rank for rank, host in enumerate(hosts) if host == socket.gethostname()]
    return MachineGroup(here.index(dist.get_rank()), len(here), dist.barrier,
                        lambda name: _gathered(name)[here[0]], lambda ok: all(_gathered(ok)))


def _gathered(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def shared_memory_free() -> float:
    """Bytes free in the shared memory the images would lie in (a container's /dev/shm may be
    far smaller than its RAM: writing past its end kills the process with SIGBUS)."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return float("inf")  # no /dev/shm: shared_file uses /tmp
    return stat.f_bavail * stat.f_frsize


def decoded_bytes(images: int, channels: int, image_size: int) -> int:
    return images * channels * image_size * image_size


def keep_decoded(datasets: Sequence, choice: str, channels: int, image_size: int) -> bool:
    """Decode every image of ``datasets`` (:class:`.image_data.ImageFileDataset`) into memory
    this machine's processes share and have each dataset read its images from there, when
    ``choice`` and the RAM allow it on every machine; returns whether it did. Collective: every
    process of the job calls it with the same datasets (the processes of one machine each decode
    a share of them)."""
    group = machine_group()
    images = sum(len(d) for d in datasets)
    need = decoded_bytes(images, channels, image_size)
    fits = cache_outcome(choice, images, channels, image_size, psutil.virtual_memory().available) == "memory"
    if not group.agree(fits and need <= shared_memory_free()):
        if choice == "auto":
            log.info("data.cache=auto: the decoded images (%.0f MB) take more than %.0f%% of the available RAM, or more "
                     "than %s has free, on a machine of the job: every epoch decodes them again", need / 1e6,
                     100 * CACHE_SHARE_OF_RAM, SHM_DIR)
        return False
    start = time.perf_counter()
    threads = len(os.sched_getaffinity(0))
    for dataset in datasets:
        pixels = shared_file(decoded_bytes(len(dataset), channels, image_size), torch.uint8, group.index == 0,
                             group.barrier, group.broadcast_name, "images")
        pixels = pixels.view(len(dataset), channels, image_size, image_size)
        with ThreadPoolExecutor(threads) as pool:  # PIL decodes and resizes without the GIL
            for _ in pool.map(lambda i: pixels[i].copy_(dataset.decode(i)), range(group.index, len(dataset), group.count)):
                pass
        group.barrier()  # every share decoded
        dataset.cache = pixels
    log.info("data.cache=auto: %d images decoded into memory (%.1f MB, shared by the %d process(es) of this machine) "
             "in %.1f s; every epoch reads them from there (data.cache=none decodes them in every epoch)",
             sum(len(d) for d in datasets), need / 1e6, group.count, time.perf_counter() - start)
    return True
