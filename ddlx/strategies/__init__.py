"""Strategies: a factory from strategy config to Trainer arguments, and the strategies Lightning lacks."""
from .factory import StrategyPlan, available_strategies, build_strategy

__all__ = ["StrategyPlan", "available_strategies", "build_strategy"]
