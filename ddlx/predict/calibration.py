"""Calibration: for each strategy group (:func:`~ddlx.predict.setups.calibration_group`), what the
analytical model leaves out (the implementation's own overhead, e.g. torchgpipe's slow forward
that the thesis blamed for its 20-76% GPipe errors), learned from measured runs as one factor or
separate factors for the compute and overhead parts, and per network from its other workloads."""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..job import Job
from .setups import Cost, splits_batch

MIN_RUNS_FOR_TWO_TERMS = 3
# The strategies whose workers each run the whole network on their share of the batch: one
# compute factor for all (see fit_group_calibrations), from groups with this many runs.
MIN_RUNS_FOR_SHARED = 2
# A network's own correction needs its runs of the group on this many other workloads (image
# sizes, batches): with one, a sitting's drift would pass for the network's character.
MIN_WORKLOADS_PER_NETWORK = 2


@dataclass(frozen=True)
class WorkloadRatio:
    """One measured workload's runs of a group against the group's calibrated model: the median
    of measured / calibrated time over its runs."""

    job: Job
    ratio: float


@dataclass(frozen=True)
class NetworkFactor:
    """What a group's calibrated model still misses on one network, at every size alike: the
    median of its measured workloads' ratios."""

    network: str
    factor: float
    workloads: int


@dataclass(frozen=True)
class Calibration:
    """measured batch time ~ compute_factor x modelled compute + overhead_factor x modelled
    overhead, times the network's own factor where its runs give one."""

    compute_factor: float
    overhead_factor: float
    runs: int
    compute_shared_with: tuple[str, ...] = ()  # groups fitted with the same compute factor
    workloads: tuple[WorkloadRatio, ...] = ()  # the runs' workloads, for the networks' factors

    def network_factor(self, job: Job | None) -> NetworkFactor | None:
        mine = [w for w in self.workloads if job is not None and w.job.model == job.model]
        if len(mine) < MIN_WORKLOADS_PER_NETWORK:
            return None
        return NetworkFactor(job.model, statistics.median(w.ratio for w in mine), len(mine))

    def apply(self, cost: Cost, job: Job | None = None) -> float:
        own = self.network_factor(job)
        return (own.factor if own else 1.0) * (self.compute_factor * cost.compute_s + self.overhead_factor * cost.overhead_s)

    def describe(self, source: str, job: Job | None = None) -> str:
        own = self.network_factor(job)
        suffix = f", then x{own.factor:.3f} for {own.network} (its {own.workloads} measured workloads)" if own else ""
        if self.compute_factor == self.overhead_factor == 1.0:
            return f"model as is: calibrating on {self.runs} {source} run(s) did not predict them better{suffix}"
        if abs(self.compute_factor - self.overhead_factor) <= 1e-6 * self.compute_factor:
            return f"model x{self.compute_factor:.2f} calibrated on {self.runs} {source} run(s){suffix}"
        shared = f" (shared with {', '.join(self.compute_shared_with)})" if self.compute_shared_with else ""
        return (f"model calibrated on {self.runs} {source} run(s): compute x{self.compute_factor:.2f}{shared}, "
                f"overheads x{self.overhead_factor:.2f}{suffix}")


def fit_calibration(samples: Sequence[tuple[Cost, float]]) -> Calibration:
    """The calibration that predicts the group's own runs best, chosen by leave-one-out among
    the runs given: the model as it is, one factor (the median measured/modelled ratio), or two
    factors (compute and overheads apart, least squares on relative error; with 4+ runs and
    both factors positive). The model alone wins when the runs only add noise to it."""
    options = [_identity, _single_factor, _two_factors]
    best, best_error = None, float("inf")
    for fit in options:
        errors = []
        for i, (cost, measured) in enumerate(samples):
            rest = [s for j, s in enumerate(samples) if j != i]
            calib = fit(rest) if rest else None
            if calib is None:
                break
            errors.append(abs(calib.apply(cost) - measured) / measured)
        else:
            error = statistics.fmean(errors) if errors else float("inf")
            if error < best_error:
                best, best_error = fit, error
    chosen = (best or _single_factor)(samples)
    return chosen if chosen is not None else Calibration(1.0, 1.0, len(samples))


def fit_group_calibrations(samples: dict[str, Sequence[tuple[Cost, float]]]) -> dict[str, Calibration]:
    """Each group's :func:`fit_calibration`, except the batch-splitting groups
    (their strategies split each batch: :func:`~.setups.splits_batch`) with :data:`MIN_RUNS_FOR_SHARED` runs or more: those share
    one compute factor, each keeping its own overhead factor (least squares on relative error
    over all their runs), when that is determined and positive.

    Why: threads, cpu_mp and DDP all run the whole network on b/W samples per worker, so their
    modelled compute is the same work and is off by the same factor; only their overheads
    (joins, averaging, allreduce) differ. Fitted apart, each group's compute factor soaks up
    what its overhead term misses on the networks where overheads dominate (AlexNet, VGG), and
    then decides the ranking on networks where compute dominates, where the model alone ranks
    them right. Per-run leave-one-out error does not choose between the two fits: it is
    dominated by a machine's drift between sittings, which moves every setup of a workload
    together (studies/cpu-2core/README.md)."""
    shared = {g: v for g, v in samples.items() if splits_batch(g) and len(v) >= MIN_RUNS_FOR_SHARED}
    joint = _shared_compute_fit(shared) if len(shared) >= 2 else None
    return {g: joint[g] if joint and g in joint else fit_calibration(v) for g, v in samples.items()}


def workload_ratios(calibration: Calibration, samples: Sequence[tuple[Cost, float]],
                    jobs: Sequence[Job]) -> tuple[WorkloadRatio, ...]:
    """Each workload's :class:`WorkloadRatio` in one group, from the group's runs (``samples``)
    and the workload each was measured on (``jobs``). A workload's repeats count once."""
    per_workload: dict[Job, list[float]] = defaultdict(list)
    for (cost, measured), job in zip(samples, jobs):
        per_workload[job].append(measured / calibration.apply(cost))
    return tuple(WorkloadRatio(job, statistics.median(r)) for job, r in per_workload.items())


def _shared_compute_fit(samples: dict[str, Sequence[tuple[Cost, float]]]) -> dict[str, Calibration] | None:
    """One compute factor for all groups, an overhead factor per group; None when that is not
    determined (a singular system) or a factor comes out non-positive."""
    groups = sorted(samples)
    rows = []
    for k, g in enumerate(groups):
        for cost, measured in samples[g]:  # row . (a, b_g...) ~ 1
            row = [cost.compute_s / measured] + [0.0] * len(groups)
            row[1 + k] = cost.overhead_s / measured
            rows.append(row)
    matrix = np.array(rows)
    factors, _, rank, _ = np.linalg.lstsq(matrix, np.ones(len(rows)), rcond=None)
    if rank < matrix.shape[1] or (factors <= 0).any():
        return None
    return {g: Calibration(float(factors[0]), float(factors[1 + k]), len(samples[g]), tuple(h for h in groups if h != g))
            for k, g in enumerate(groups)}


def _identity(samples: Sequence[tuple[Cost, float]]) -> Calibration:
    return Calibration(1.0, 1.0, len(samples))


def _single_factor(samples: Sequence[tuple[Cost, float]]) -> Calibration | None:
    if not samples:
        return None
    factor = statistics.median(measured / cost.total_s for cost, measured in samples)
    return Calibration(factor, factor, len(samples))


def _two_factors(samples: Sequence[tuple[Cost, float]]) -> Calibration | None:
    if len(samples) < MIN_RUNS_FOR_TWO_TERMS:
        return None
    rows = [(cost.compute_s / m, cost.overhead_s / m) for cost, m in samples]  # rows . (a, b) ~ 1
    scc, soo = sum(c * c for c, _ in rows), sum(o * o for _, o in rows)
    sco, sc, so = sum(c * o for c, o in rows), sum(c for c, _ in rows), sum(o for _, o in rows)
    det = scc * soo - sco * sco
    if det <= 1e-12 * scc * soo:
        return None
    a, b = (sc * soo - so * sco) / det, (so * scc - sc * sco) / det
    return Calibration(a, b, len(samples)) if a > 0 and b > 0 else None
