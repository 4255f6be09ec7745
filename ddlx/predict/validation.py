"""Validation (Jansen's thesis Tables 8.1 / 8.2): every measured configuration predicted from all the
others' runs (leave-one-out), the recommended setup against the measured fastest, and how
reproducible each workload's measured fastest is (its setups' repeats resampled)."""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..allocator import SYSTEM
from ..records import MeasuredRun, distinct_labels, job_of_run, on_hardware
from .prediction import Predictor
from .setups import calibration_group


@dataclass
class ValidationRow:
    run_ids: str  # the configuration's runs, comma-separated
    workload: str
    setup: str
    group: str
    predicted_s: float
    basis: str
    run_times_s: tuple[float, ...]  # the configuration's runs, seconds per epoch

    @property
    def measured_s(self) -> float:
        return statistics.median(self.run_times_s)

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    def as_dict(self) -> dict:
        return vars(self) | {"measured_s": self.measured_s, "error": self.error}


# Resamples of each workload's repeated runs behind Pick's reproducibility figures.
RESAMPLES = 2000


@dataclass
class Pick:
    """Jansen's thesis Table 8.1's cell: the recommended and the measured fastest setup of a workload,
    and how much slower the recommended one measured."""

    recommended: str
    fastest: str
    slowdown: float  # measured(recommended) / measured(fastest) - 1
    # The two setups' repeated runs overlap (the recommended one's fastest run beat the fastest
    # setup's slowest): on this machine's noise the measurements do not tell them apart.
    overlapping: bool = False
    # Bootstrap over each setup's runs (the median of a resample of its runs, RESAMPLES times):
    # how often the measured fastest is again the fastest, what naming it could expect to score
    # against a re-measurement in the same sittings (drift between sittings only lowers it);
    # and how often the recommended setup is the fastest.
    fastest_reproduced: float = 1.0
    recommended_fastest: float = 0.0

    @property
    def correct(self) -> bool:
        return self.recommended == self.fastest


def validate(predictor: Predictor, cpu_allocator: str = SYSTEM) -> tuple[list[ValidationRow], dict[str, Pick]]:
    """Leave-one-out over measured configurations (workload x setup) on the target hardware, with
    ``cpu_allocator`` (the one held-out baselines are probed with: this process's): each
    predicted from the runs of every other configuration, against the median of its own runs
    (repeats of one configuration are one measurement, so none of them informs its prediction).

    Returns the rows and, per workload with two or more measured setups, the recommendation made
    from the leave-one-out predictions against the measured fastest."""
    configs: dict[tuple[str, str], list[MeasuredRun]] = defaultdict(list)
    target = [r for r in predictor.runs if on_hardware(r, predictor.hw) and r.workload.cpu_allocator == cpu_allocator]
    labels = distinct_labels(r.workload for r in target)  # the report's workloads, named apart
    for run in target:
        configs[labels[run.workload], run.strategy_setup.label].append(run)
    rows = []
    for (workload, label), group in sorted(configs.items()):
        ids = {r.run_id for r in group}
        setup = group[0].strategy_setup
        job = job_of_run(group[0])
        rec = predictor.recommend(job, [setup], exclude=lambda r, ids=ids: r.run_id in ids)
        (pred,) = rec.predictions
        times = tuple(r.metrics["mean_epoch_time_s"] for r in group)
        rows.append(ValidationRow(",".join(sorted(ids)), workload, label, calibration_group(setup), pred.epoch_s,
                                  pred.basis, times))
    by_workload: dict[str, list[ValidationRow]] = defaultdict(list)
    for row in rows:
        by_workload[row.workload].append(row)
    return rows, {workload: pick(group) for workload, group in by_workload.items() if len(group) >= 2}


# A group's validated error counts once this many of its configurations were predicted.
MIN_VALIDATED_CONFIGS = 3


def group_errors(predictor: Predictor, cpu_allocator: str = SYSTEM) -> dict[str, float]:
    """Each calibration group's median absolute leave-one-out error on the predictor's target
    hardware (:func:`validate`), for the groups with :data:`MIN_VALIDATED_CONFIGS` measured
    configurations or more: how far apart two of its predictions must be to rank them."""
    rows, _ = validate(predictor, cpu_allocator)
    errors: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        errors[row.group].append(abs(row.error))
    return {g: statistics.median(e) for g, e in errors.items() if len(e) >= MIN_VALIDATED_CONFIGS}


def pick(rows: Sequence[ValidationRow]) -> Pick:
    """One workload's recommendation (the predicted fastest) against its measured fastest."""
    recommended = min(rows, key=lambda r: r.predicted_s)
    fastest = min(rows, key=lambda r: r.measured_s)
    wins = resampled_fastest(rows)
    return Pick(recommended.setup, fastest.setup, recommended.measured_s / fastest.measured_s - 1,
                recommended is not fastest and min(recommended.run_times_s) <= max(fastest.run_times_s),
                float(wins[rows.index(fastest)]), float(wins[rows.index(recommended)]))


def pick_figures(picks: Sequence[Pick]) -> dict[str, float | None]:
    """Jansen's thesis Table 8.1's figures over the workloads' picks (None for each with no picks):
    fractions correct (strict, or with runs overlapping the fastest's), what following the picks cost against the measured fastest (the strict
    fraction alone counts a 1% tie like a 2x miss), and the resampling figures of :class:`Pick`
    (``fastest_reproduced_fraction``: what naming the measured fastest could expect against a
    re-measurement)."""
    figures = {
        "correct_fraction": lambda p: p.correct,
        "correct_or_overlapping_fraction": lambda p: p.correct or p.overlapping,
        "mean_slowdown": lambda p: p.slowdown,
        "fastest_reproduced_fraction": lambda p: p.fastest_reproduced,
        "recommended_fastest_fraction": lambda p: p.recommended_fastest,
    }
    out = {name: statistics.fmean(float(f(p)) for p in picks) if picks else None for name, f in figures.items()}
    out["max_slowdown"] = max(p.slowdown for p in picks) if picks else None
    return out


def resampled_fastest(rows: Sequence[ValidationRow], resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """For each row, the fraction of bootstrap resamples in which it measures fastest: each
    resample draws every setup's runs with replacement and takes their median, as the measured
    figure is taken. Seeded: the same runs give the same fractions."""
    rng = np.random.default_rng(seed)
    medians = np.stack([np.median(rng.choice(np.asarray(r.run_times_s), size=(resamples, len(r.run_times_s))), axis=1)
                        for r in rows])
    return np.bincount(np.argmin(medians, axis=0), minlength=len(rows)) / resamples
