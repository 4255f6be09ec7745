"""Turn a strategy config (``conf/strategy/NAME.yaml``) into ``pl.Trainer`` arguments."""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class StrategyPlan:
    """What the Trainer needs to run a strategy, and what the run is tagged with."""

    trainer_kwargs: dict[str, Any]
    tags: dict[str, str] = field(default_factory=dict)
    replicas_per_machine: int = 1  # model copies in this machine's memory, for the memory check


def _positive_int(cfg: Mapping[str, Any], key: str, strategy: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"strategy.{key}={value!r} for strategy={strategy}; expected a positive integer, e.g. strategy.{key}=1")
    return value


def _sequential(cfg: Mapping[str, Any], accelerator: str) -> StrategyPlan:
    threads = _positive_int(cfg, "threads", "sequential")
    cores = os.cpu_count() or 1
    if threads > cores:
        log.warning("strategy.threads=%d is more than the %d cores here: threads will oversubscribe", threads, cores)
    # Intra-op threads: 1 is the paper's one-core baseline.
    torch.set_num_threads(threads)
    return StrategyPlan(trainer_kwargs={"strategy": "auto", "devices": 1}, tags={"threads": str(threads)})


_FACTORIES = {"sequential": _sequential}


def available_strategies() -> list[str]:
    return sorted(_FACTORIES)


def build_strategy(cfg: Mapping[str, Any], accelerator: str) -> StrategyPlan:
    name = cfg.get("name")
    if name not in _FACTORIES:
        raise ConfigError(f"strategy.name={name!r} is not known; expected one of {', '.join(available_strategies())}")
    plan = _FACTORIES[name](cfg, accelerator)
    plan.tags = {"strategy": name, **plan.tags}
    return plan
