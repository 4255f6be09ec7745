"""The machine a run is measured on, as its tags name it (the report compares runs of one host only)."""
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
