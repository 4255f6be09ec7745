"""Ranks of one machine, each pinned to its own equal share of the cores with as many intra-op
threads, so ranks never oversubscribe (cpu_mp's ranks, torch pipeline stages)."""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

Restore = tuple[set[int], int]


def core_share(cores: list[int], processes: int, rank: int) -> list[int]:
    """The cores of ``rank`` when ``cores`` are split evenly into ``processes`` contiguous shares."""
    per = max(1, len(cores) // processes)
    start = (rank * per) % len(cores)
    return cores[start : start + per]


def pin_rank(processes: int, local_rank: int, pin_cores: bool, what: str) -> Restore:
    """This process on its share of the cores (when ``pin_cores``) with one thread per core;
    returns what :func:`unpin` puts back (the process may outlive the job: a sweep)."""
    cores = sorted(os.sched_getaffinity(0))
    mine = core_share(cores, processes, local_rank)
    restore = (set(cores), torch.get_num_threads())
    if pin_cores:
        os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    log.info("%s rank %d: cores %s, %d threads", what, local_rank, mine, len(mine))
    return restore


def unpin(restore: Restore | None, pin_cores: bool) -> None:
    if restore is not None:
        cores, threads = restore
        if pin_cores:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
