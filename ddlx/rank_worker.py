"""Entry point of the extra ranks of a multi-process strategy: ``python -m ddlx.rank_worker CONFIG OUTPUT_DIR``.

Started by :class:`ddlx.parallel.launch.WorkerLauncher` with the job's resolved config, so
every rank trains exactly the job that rank 0 runs (see that module for why not ``sys.argv``).
A worker ends with the process that started it (kill -9 of rank 0 leaves no rank behind).
"""
from __future__ import annotations

import logging
import os
import sys

from omegaconf import OmegaConf

from .entry import report_config_errors
from .errors import Stopped
from .process import PARENT_ENV, end_with_parent, rank_logging

def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python -m ddlx.rank_worker CONFIG_YAML OUTPUT_DIR")
    parent = os.environ.get(PARENT_ENV)
    if not end_with_parent(int(parent) if parent else None):
        os._exit(1)  # the launching process is gone already
    rank_logging()  # forked or a new interpreter: before Lightning's import (in .run), which adds a handler where none is
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
