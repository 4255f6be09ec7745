"""A config field with its range or choices (:func:`knob`): declared once, beside its type, in the
schema's dataclasses (:mod:`ddlx.config`, each strategy's config); checked right after Hydra composes
the config (:mod:`ddlx.config_check`)."""
from __future__ import annotations

from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field
from typing import Any

# A value the config must give (a YAML option, or the command line): OmegaConf's marker, which
# Hydra names as missing when the config is composed; spelt here so the schema needs no omegaconf.
MISSING = "???"


@dataclass(frozen=True)
class Bound:
    """What a knob accepts beyond its type: a range (``low``/``high``, open or closed) or choices."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[Any, ...] | None = None

    def expected(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        parts = []
        if self.low is not None and self.high is not None:
            return f"a value in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}{')' if self.high_open else ']'}"
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_number(self.high)}")
        return "a value " + " and ".join(parts)

    def accepts(self, value: Any) -> bool:
        if value is None:
            return True  # Optional fields: None means "not set", their type says whether it may be
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True  # a non-number in an Any field: its consumer checks it
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.high_open and value == self.high)))


@dataclass(frozen=True)
class SetupRole:
    """How a strategy knob names a setup: what the recommender predicts, and what calibration matches
    a measured run to (:meth:`ddlx.strategies.spec.StrategySpec.setup`). A knob without one (a
    timeout, DDP's bucket size) changes how a setup runs, not which setup it is."""

    unless_default: bool = False  # left out at its default (a run that never set it is the same setup)
    when: tuple[tuple[str, Any], ...] = ()  # only while these (setup) knobs have these values (schedule: engine=torch)
    resolved: bool = False  # read from its run tag only, the value its plan resolved (devices=auto: which)
    absent: Any = None  # what a run logged before the knob (or its tag) existed used (None: its default)

    def holds(self, value_of) -> bool:
        """Whether its ``when`` holds, ``value_of(knob)`` giving the setup's other knobs."""
        return all(value_of(key) == value for key, value in self.when)


def _number(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"  # an integer bound in full (seeds: 4294967295)


def knob(default: Any = NO_DEFAULT, *, low=None, high=None, low_open=False, high_open=False, choices=None,
         setup: SetupRole | None = None, label: str = "tag", quiet: bool | None = None):
    """A dataclass field with its :class:`Bound` (``default=MISSING``: the option's YAML gives it).

    A strategy's knob also says how it names a setup (``setup``, a :class:`SetupRole`) and how a
    run's label shows it: ``label="tag"`` its run tag, the resolved value its plan wrote, left out at
    its default where ``quiet`` (by default: where its setup leaves it out there);
    ``label="when_set"`` its param, only where the user set one (a resolved default that differs
    per model); ``label="never"``."""
    bound = Bound(low, high, low_open, high_open, tuple(choices) if choices is not None else None)
    quiet = (setup is not None and setup.unless_default) if quiet is None else quiet
    metadata = {"bound": bound, "setup": setup, "label": label, "quiet": quiet}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=MISSING if default is NO_DEFAULT else default, metadata=metadata)


# The roles strategies share: a knob naming its setup at any value, or only away from its default.
ALWAYS = SetupRole()
UNLESS_DEFAULT = SetupRole(unless_default=True)
