"""Shared by the Hydra entry points: config resolvers and user-facing error reporting."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .errors import ConfigError


def register_resolvers(project_dir: Path) -> None:
    """``${project_dir:}`` in configs: the folder holding train.py, so mlflow.db and data/ land there
    whatever the working directory."""
    OmegaConf.register_new_resolver("project_dir", lambda: str(project_dir), replace=True)


def report_config_errors(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; a :class:`ConfigError` becomes one clear message and exit status 2, no traceback."""
    try:
        return fn()
    except ConfigError as err:
        print(f"ddlx: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
