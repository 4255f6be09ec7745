"""Entry point of the extra ranks of a multi-process strategy: ``python -m ddlx.rank_worker CONFIG OUTPUT_DIR``.

Started by :class:`ddlx.strategies.launch.WorkerLauncher` with the job's resolved config, so
every rank trains exactly the job that rank 0 runs (see that module for why not ``sys.argv``).
"""
from __future__ import annotations

import logging
import os
import sys

from omegaconf import OmegaConf

from .cli import report_config_errors


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python -m ddlx.rank_worker CONFIG_YAML OUTPUT_DIR")
    from .run import train

    cfg = OmegaConf.load(argv[0])
    report_config_errors(lambda: train(cfg, argv[1]))
    # Everything this rank owns is done (rank 0 saves checkpoints and logs). Interpreter
    # teardown of torch/Lightning objects can take many seconds here, while rank 0 waits
    # for this process to end the job: leave at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
