"""Entry point of the extra ranks of a multi-process strategy: ``python -m ddlx.rank_worker CONFIG OUTPUT_DIR``.

Started by :class:`ddlx.parallel.launch.WorkerLauncher` with the job's resolved config, so
every rank trains exactly the job that rank 0 runs (see that module for why not ``sys.argv``).
A worker ends with the process that started it (kill -9 of rank 0 leaves no rank behind).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

from omegaconf import OmegaConf

from .cli import report_config_errors
from .errors import Stopped
from .parallel.launch import PARENT_ENV

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent() -> None:
    """Ask the kernel to kill this process when its parent dies (Linux), and leave now if it
    already has (it died before the request)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: the collectives' timeout (strategy.timeout_s) ends this rank instead
    parent = os.environ.get(PARENT_ENV)
    if parent and os.getppid() != int(parent):
        os._exit(1)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python -m ddlx.rank_worker CONFIG_YAML OUTPUT_DIR")
    end_with_parent()
    from .run import train

    cfg = OmegaConf.load(argv[0])
    try:
        report_config_errors(lambda: train(cfg, argv[1]))
    except Stopped as stop:
        if stop.step is None:  # this rank alone, before training: the job's launcher ends the others
            raise SystemExit(stop.exit_status) from None
        # Otherwise every rank stopped at the same step; rank 0 wrote the checkpoint and records the run.
    # Everything this rank owns is done (rank 0 saves checkpoints and logs). Interpreter
    # teardown of torch/Lightning objects can take many seconds here, while rank 0 waits
    # for this process to end the job: leave at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
