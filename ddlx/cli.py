"""Shared by the Hydra entry points: config resolvers, sweep tags and user-facing error reporting."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .errors import ConfigError, StoreError


class SweepJobRefused(Exception):
    """A sweep job refused before training: Hydra records the job as failed and runs the next."""


def register_resolvers(project_dir: Path) -> None:
    """``${project_dir:}`` in configs: the folder holding train.py, so mlflow.db and data/ land there
    whatever the working directory."""
    OmegaConf.register_new_resolver("project_dir", lambda: str(project_dir), replace=True)


def hydra_job_tags(project_root: str) -> tuple[str, dict[str, str]]:
    """The job's output folder and, in a ``-m`` sweep, the tags that tie its run to the sweep:
    ``sweep_id`` (the sweep folder, relative to the project when inside it) and ``sweep_job``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return hydra_cfg.runtime.output_dir, {}
    sweep_dir = Path(hydra_cfg.sweep.dir).resolve()
    try:
        sweep_id = str(sweep_dir.relative_to(Path(project_root).resolve()))
    except ValueError:
        sweep_id = str(sweep_dir)
    overrides = " ".join(hydra_cfg.overrides.task)
    return hydra_cfg.runtime.output_dir, {"sweep_id": sweep_id, "sweep_job": str(hydra_cfg.job.num), "overrides": overrides}


def report_config_errors(fn: Callable[[], Any], in_sweep: bool = False) -> Any:
    """Run ``fn``; a :class:`ConfigError` becomes one clear message, no traceback: exit status 2
    for a single run; in a sweep, a failed job (recorded as a FAILED MLflow run) and the sweep goes
    on, unless the store itself refuses (:class:`StoreError`): then no job could be recorded, and
    the sweep stops with exit status 2 rather than try each of them."""
    try:
        return fn()
    except ConfigError as err:
        print(f"ddlx: error: {err}", file=sys.stderr)
        if in_sweep:
            if not isinstance(err, StoreError):
                raise SweepJobRefused(str(err)) from None
            print("ddlx: the sweep stops here: its other jobs log to the same store and would be refused alike",
                  file=sys.stderr)
        raise SystemExit(2) from None
