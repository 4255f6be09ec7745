"""How the C heap treats freed memory in a training process (``cpu_allocator``).

glibc's default ("system") serves each block above its mmap threshold (which adapts, up to
32 MiB) with a fresh ``mmap`` and hands it back on free, so a step whose activations exceed it
page-faults them in again every step. "keep_freed" serves every block from the heap and never
trims it (``mallopt(M_MMAP_MAX, 0)`` and a trim threshold of 2 GiB, and the same as
``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` for the processes it starts): freed memory is
reused, at the price of a higher peak RSS. On MobileNetV2 at 192 px (16 samples per process)
it made cpu_mp 1.37x and ddp_gloo 1.24x faster, threads 1.05x (``benchmarks/allocator.sh``).

glibc cannot go back to its adaptive default within a process, so a process that set
"keep_freed" refuses a later "system" job (a Hydra sweep runs its jobs in one process).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

from .errors import ConfigError

DEFAULT = "system"  # also what runs from before the setting used
CHOICES = (DEFAULT, "keep_freed")
# mallopt's parameters (malloc.h) and the values "keep_freed" sets.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap before any is returned
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the adaptive threshold never rises above it, so
# under "system" every block this large is mapped afresh on each allocation, whatever came before.
MMAP_CEILING_BYTES = 32 * 2**20
KEEP_FREED_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}

_set_here: str | None = None  # what this process set, if anything


def _glibc():
    """glibc's handle, or None elsewhere (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def check_allocator(choice: str) -> None:
    """Refuse a ``cpu_allocator`` this process cannot honour, before any work."""
    if choice not in CHOICES:
        raise ConfigError(f"cpu_allocator={choice!r} is not one of {', '.join(CHOICES)}: use cpu_allocator=system "
                          f"(glibc's default) or cpu_allocator=keep_freed (reuse freed memory; faster data-parallel "
                          f"CPU training on large activations)")
    if choice == "keep_freed" and _glibc() is None:
        raise ConfigError("cpu_allocator=keep_freed sets glibc's mallopt, and this C library is not glibc: "
                          "use cpu_allocator=system")
    if choice == DEFAULT:
        if _set_here == "keep_freed":
            raise ConfigError("cpu_allocator=system after a cpu_allocator=keep_freed job in the same process: glibc "
                              "cannot return to its default, so this job would be measured with the other allocator; "
                              "run the cpu_allocator=system jobs in a train.py call (or sweep) of their own")
        preset = sorted(k for k in KEEP_FREED_ENV if k in os.environ)
        if preset:
            raise ConfigError(f"cpu_allocator=system, but {', '.join(preset)} is set in the environment, which changes "
                              f"glibc's allocator for this run: unset it, or use cpu_allocator=keep_freed, which sets "
                              f"these for you and records it with the run")


def apply_allocator(choice: str) -> None:
    """Set ``choice`` in this process and, through the environment, in the processes it starts."""
    global _set_here
    check_allocator(choice)
    if choice == "keep_freed":
        libc = _glibc()
        if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
            raise ConfigError("cpu_allocator=keep_freed: glibc's mallopt refused the settings; use cpu_allocator=system")
        os.environ.update(KEEP_FREED_ENV)
        _set_here = choice
