"""Measurement callbacks."""
from .timing import EpochTimer

__all__ = ["EpochTimer"]
