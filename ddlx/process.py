"""This process: who started it (ddlx's launcher, or mpirun, srun, torchrun), its name and its end
with its parent (Linux's prctl; elsewhere nothing), for the ranks, the fork server and the loader
workers alike."""
from __future__ import annotations

import os
import signal
import sys
from typing import Mapping

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # linux/prctl.h
WORKER_ENV = "DDLX_RANK_WORKER"
PARENT_ENV = "DDLX_RANK_PARENT"  # the launching process: a worker ends with it (ddlx.rank_worker)
STARTED_EXTERNALLY = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID")


def is_rank_worker() -> bool:
    """An extra rank started by ddlx's own launcher."""
    return os.environ.get(WORKER_ENV) == "1"


def end_with_parent(expected_parent: int | None = None) -> bool:
    """Have the kernel kill this process when its parent ends. False when the parent has already
    gone (the process was reparented before the call), or is not ``expected_parent``."""
    import ctypes

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    alive = parent != 1 and os.getppid() == parent
    return alive and (expected_parent is None or parent == expected_parent)


def ddlx_child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's by default) for a ``python -m ddlx....`` child, with the folder this
    process's ddlx comes from first on PYTHONPATH, so the child runs the same ddlx: ``train.py``'s
    folder is on its own path, not on a child's, and may hold another clone than the installed one,
    or the only one. An installed ddlx (a site folder) is left to the child's own path."""
    import site

    env = dict(os.environ if env is None else env)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sites = {os.path.abspath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}
    if root not in sites:
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != root]
        env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return env


def name_process(name: str) -> None:
    """This process's name as ps, top and psutil show it (its command line stays the launching
    one's: a forked process cannot change that)."""
    import ctypes

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15])
