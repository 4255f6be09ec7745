"""The machine a run is measured on, as its tags name it (the report compares runs of one host
only), and how busy its cores are with other work when the run starts."""
from __future__ import annotations

import os
import platform
import socket
from pathlib import Path


def machine_tags() -> dict[str, str]:
    """Where a run was measured: the report compares runs of one host only."""
    import torch

    tags = {"host": socket.gethostname(), "cpu_cores": str(len(os.sched_getaffinity(0))), "cpu_model": cpu_model()}
    if torch.cuda.is_available():
        tags["gpus"] = str(torch.cuda.device_count())
        tags["gpu_name"] = torch.cuda.get_device_name(0)
    return tags


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


BUSY_PERCENT = 30.0  # a core this busy with other processes before the run starts is not the run's alone
BUSY_SAMPLE_S = 0.25  # long enough to see a busy loop, short beside a run's start


def busy_cores(sample_s: float = BUSY_SAMPLE_S) -> dict[int, float]:
    """The cores this process may run on that other processes keep busy, with how busy (percent of
    the core), sampled over ``sample_s`` while this process waits (so the load is theirs)."""
    import psutil

    usage = psutil.cpu_percent(interval=sample_s, percpu=True)
    return {core: usage[core] for core in sorted(os.sched_getaffinity(0))
            if core < len(usage) and usage[core] >= BUSY_PERCENT}
