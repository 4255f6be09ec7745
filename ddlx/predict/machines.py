"""Which machine, not only which strategy: one question answered on several hardware descriptions,
an epoch's cost where a description gives a price per device-hour, and the cheapest setup that
keeps an epoch within a stated time."""
from __future__ import annotations

from dataclasses import dataclass

from ..strategies import spec_of
from .prediction import Prediction, Recommendation


@dataclass(frozen=True)
class Choice:
    rec: Recommendation  # the answer on one machine
    prediction: Prediction  # one of its setups that fits

    @property
    def devices(self) -> int:
        return spec_of(self.prediction.setup.strategy).devices(self.prediction.setup)

    @property
    def epoch_cost(self) -> float | None:
        """What an epoch costs at the machine's price per device-hour (None: it gives none)."""
        price = self.rec.hw.price_per_device_hour
        return None if price is None else price * self.devices * self.prediction.epoch_s / 3600


@dataclass(frozen=True)
class MachineComparison:
    fastest: Choice | None  # the fastest setup that fits on any machine
    cheapest: Choice | None  # the cheapest priced setup that fits (within ``max_epoch_s`` where stated)
    max_epoch_s: float | None
    within: int  # how many fitting setups keep an epoch within max_epoch_s (all when none is stated)
    priced: bool  # any machine gives a price


def choices(recs: list[Recommendation]) -> list[Choice]:
    return [Choice(rec, p) for rec in recs for p in rec.fitting]


def compare(recs: list[Recommendation], max_epoch_s: float | None = None) -> MachineComparison:
    """The fastest setup over all machines, and the cheapest priced one whose epoch is predicted
    within ``max_epoch_s`` (ties to the faster)."""
    every = choices(recs)
    fastest = min(every, key=lambda c: c.prediction.epoch_s, default=None)
    within = [c for c in every if max_epoch_s is None or c.prediction.epoch_s <= max_epoch_s]
    priced = [c for c in within if c.epoch_cost is not None]
    cheapest = min(priced, key=lambda c: (c.epoch_cost, c.prediction.epoch_s), default=None)
    return MachineComparison(fastest, cheapest, max_epoch_s, len(within),
                             any(r.hw.price_per_device_hour is not None for r in recs))
