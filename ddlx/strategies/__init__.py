"""The strategies ddlx runs, measures and predicts: one spec per strategy (:mod:`.spec`), one file
each (``ddlx/strategies/<name>.py``, found here by their ``SPECS``). Adding a strategy is adding
its file; what several strategies run (a pipeline, a model's halves, replicas) is in :mod:`.parts`. Their implementations (Lightning strategies, parallelizers) are in :mod:`ddlx.parallel`.
"""
from __future__ import annotations

import importlib
import pkgutil

from ..errors import ConfigError
from ..job import BASELINE
from .spec import Setup, StrategyPlan, StrategySpec


def _discover() -> dict[str, StrategySpec]:
    found: list[StrategySpec] = []
    for module in pkgutil.iter_modules(__path__):
        found += getattr(importlib.import_module(f"{__name__}.{module.name}"), "SPECS", ())
    return {spec.name: spec for spec in sorted(found, key=lambda spec: spec.order)}


STRATEGIES: dict[str, StrategySpec] = _discover()
# BASELINE (ddlx.job): the one-device strategy every speedup is measured against (T_seq), never calibrated.


def available_strategies() -> list[str]:
    return sorted(STRATEGIES)


def spec_of(name: str) -> StrategySpec:
    if name not in STRATEGIES:
        raise ConfigError(f"strategy.name={name!r} is not known; expected one of {', '.join(available_strategies())}")
    return STRATEGIES[name]


def starts_ranks(cfg) -> bool:
    """Whether a run of the strategy config ``cfg`` has ddlx's launcher start ranks beside its
    own process (an unknown name: no; it is refused where the run builds its strategy)."""
    return cfg.name in STRATEGIES and STRATEGIES[cfg.name].starts_ranks(cfg)


def build_strategy(cfg, accelerator: str, model, data) -> StrategyPlan:
    """The Trainer's arguments for the strategy ``cfg`` names (``model`` on the meta device is
    enough: layer counts and cut points; ``data``: the batch's shape)."""
    spec = spec_of(cfg.name)
    plan = spec.plan(cfg, accelerator, model, data)
    plan.tags = {"strategy": spec.name, **plan.tags}
    return plan


__all__ = ["BASELINE", "STRATEGIES", "Setup", "StrategyPlan", "StrategySpec", "available_strategies", "build_strategy", "spec_of", "starts_ranks"]
