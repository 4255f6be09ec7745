"""Predict every setup on a machine, calibrate against measured runs, rank, and validate.

Calibration: for each strategy group (:func:`~ddlx.predict.setups.calibration_group`), the
median of measured / modelled batch time over the runs of that group whose one-device
baseline was also measured: what the analytical model leaves out (the implementation's own
overhead, e.g. torchgpipe's slow forward that the thesis blamed for its 20-76% GPipe errors)
is learned from the runs. Runs are taken from the target hardware when it has any, else from
this machine when it is the same device kind; otherwise the model stands uncalibrated and says so.
"""
from __future__ import annotations

import socket
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import yaml
from omegaconf import OmegaConf

from ..allocator import MMAP_CEILING_BYTES, SYSTEM, keep_freed_possible
from ..measure.report import MeasuredRun, distinct_labels
from .hardware import HardwareSpec
from .job import Job, measured_per_batch_s, on_hardware, usable
from .profile import ModelProfile, mapped_bytes, profile_model
from .setups import (
    MemoryNeed,
    SequentialTime,
    Setup,
    Cost,
    calibration_group,
    candidates,
    loader_bound_s,
    memory_need,
    model_cost,
    setup_of_run,
    worker_batch,
)
from .tseq import ProbedBatch, baselines_on, efficiency_from_runs, from_flops, from_probe, from_runs, rescaled

Probe = Callable[[Job], Callable[[int], list[ProbedBatch]]]
LoadingProbe = Callable[[Job], Callable[[], float]]
T = TypeVar("T")
MIN_RUNS_FOR_TWO_TERMS = 3
# The strategies whose workers each run the whole network on their share of the batch: one
# compute factor for all (see fit_group_calibrations), from groups with this many runs.
SHARED_COMPUTE_GROUPS = ("threads", "cpu_mp", "ddp_gloo", "ddp_nccl", "mpi")
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
    (:data:`SHARED_COMPUTE_GROUPS`) with :data:`MIN_RUNS_FOR_SHARED` runs or more: those share
    one compute factor, each keeping its own overhead factor (least squares on relative error
    over all their runs), when that is determined and positive.

    Why: threads, cpu_mp and DDP all run the whole network on b/W samples per worker, so their
    modelled compute is the same work and is off by the same factor; only their overheads
    (joins, averaging, allreduce) differ. Fitted apart, each group's compute factor soaks up
    what its overhead term misses on the networks where overheads dominate (AlexNet, VGG), and
    then decides the ranking on networks where compute dominates: cpu_mp's x1.04 against
    threads' x1.00 put threads first on MobileNetV2 at 96-160 px, where it measured 0-5% behind
    cpu_mp (the model alone ranks them right). Per-run leave-one-out error does not choose
    between the two (4.9% mean either way here): it is dominated by the machine's drift
    between sittings, which moves every setup of a workload together."""
    shared = {g: v for g, v in samples.items() if g in SHARED_COMPUTE_GROUPS and len(v) >= MIN_RUNS_FOR_SHARED}
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


@dataclass
class Prediction:
    setup: Setup
    epoch_s: float
    speedup: float
    memory: MemoryNeed
    basis: str

    def as_dict(self) -> dict:
        return {
            "strategy": self.setup.strategy,
            "knobs": {k: list(v) if isinstance(v, tuple) else v for k, v in self.setup.knobs},
            "setup": self.setup.label,
            "overrides": self.setup.overrides,
            "predicted_epoch_s": round(self.epoch_s, 4),
            "speedup": round(self.speedup, 3),
            "memory_per_device_gb": round(self.memory.per_device_gb, 3),
            "memory_limit_gb": round(self.memory.limit_gb, 3),
            "fits": self.memory.fits,
            "basis": self.basis,
        }


def choose(options: Sequence[T], seconds: Callable[[T], float], sequential: Callable[[T], bool],
           prefer_sequential_within: float) -> T:
    """The option to recommend: the fastest, unless a sequential one (one process on the whole
    batch: the baseline's training exactly, BatchNorm over the whole batch, no extra memory) is
    predicted within ``prefer_sequential_within`` (a fraction) of it. A parallel setup must be
    predicted to gain more than the predictions resolve before it is worth its costs."""
    fastest = min(options, key=seconds)
    plain = [o for o in options if sequential(o)]
    if plain:
        best_plain = min(plain, key=seconds)
        if seconds(best_plain) <= seconds(fastest) * (1 + prefer_sequential_within):
            return best_plain
    return fastest


@dataclass
class Recommendation:
    job: Job
    hw: HardwareSpec
    sequential: SequentialTime
    predictions: list[Prediction]  # fastest first; those that do not fit last
    runs_used: int
    prefer_sequential_within: float = 0.0  # see :func:`choose`

    @property
    def fitting(self) -> list[Prediction]:
        """The setups that fit, fastest first."""
        return [p for p in self.predictions if p.memory.fits]

    @property
    def fastest(self) -> Prediction | None:
        """The setup predicted fastest among those that fit."""
        return next(iter(self.fitting), None)

    @property
    def best(self) -> Prediction | None:
        """The recommended setup (:func:`choose` among those that fit)."""
        fitting = self.fitting
        if not fitting:
            return None
        return choose(fitting, lambda p: p.epoch_s, lambda p: p.setup.strategy == "sequential", self.prefer_sequential_within)

    def close_calls(self, band: float) -> list[Prediction]:
        """The other setups that fit and are predicted within ``band`` (a fraction) of the best:
        inside the models' error, so the ranking among them is not settled by prediction."""
        best = self.best
        if best is None:
            return []
        return [p for p in self.fitting if p is not best and p.epoch_s <= best.epoch_s * (1 + band)]


def allocator_advice(rec: Recommendation) -> str | None:
    """When glibc's default allocator maps some of the recommended setup's tensors afresh every
    step (those of 32 MiB or more, which its adaptive threshold never covers), say so and what
    ``cpu_allocator=keep_freed`` would change; None otherwise (GPUs, keep_freed or a preloaded
    malloc, small tensors, or this machine as the target when keep_freed cannot run here).
    Advice, not a prediction: the time it saves was measured on one workload, not modelled."""
    best, job = rec.best, rec.job
    if best is None or rec.hw.device_kind != "cpu" or job.cpu_allocator != SYSTEM:
        return None
    if rec.hw.host == socket.gethostname() and not keep_freed_possible():  # train.py here would refuse the command
        return None
    mapped = mapped_bytes(job.model, job.num_classes, job.channels, job.image_size, worker_batch(best.setup, job), MMAP_CEILING_BYTES)
    if not mapped:
        return None
    return (f"with cpu_allocator={SYSTEM} (glibc's default), each worker of {best.setup.label} maps "
            f"{mapped / 1e6:.0f} MB of its tensors afresh every step (those of {MMAP_CEILING_BYTES // 2**20} MiB or more) "
            f"and page-faults them in "
            f"again; cpu_allocator=keep_freed reuses freed memory instead: 1.07-1.37x faster for threads, ddp_gloo and "
            f"cpu_mp on MobileNetV2 at 192 px, 5-17% more peak RAM (benchmarks/allocator.sh). Predictions for it come "
            f"only from runs with it, so measure it")


def profile_of_job(job: Job) -> ModelProfile:
    return profile_model(job.model, job.num_classes, job.channels, job.image_size)


class Predictor:
    """Predictions for one target machine from a fixed set of measured runs."""

    def __init__(self, hw: HardwareSpec, runs: Sequence[MeasuredRun], local: HardwareSpec | None = None,
                 probe: Probe | None = None, prefer_sequential_within: float = 0.0,
                 loading: LoadingProbe | None = None) -> None:
        """``loading``: times one sample's data loading on one core of this machine (for GPU
        targets, whose loaders run on the host's cores: see :func:`~.setups.loader_bound_s`)."""
        self.hw, self.local, self.probe, self.loading = hw, local, probe, loading
        self.prefer_sequential_within = prefer_sequential_within
        self.runs = [r for r in runs if usable(r)]
        self._probed: dict[Job, SequentialTime] = {}
        self._loading: dict[Job, float] = {}

    # -- sequential time ------------------------------------------------------------------
    def sequential(self, job: Job, hw: HardwareSpec, runs: Sequence[MeasuredRun],
                   probe_on_runs_footing: bool = False) -> SequentialTime:
        """``probe_on_runs_footing``: rescale a probe to the stored runs' sittings (validation
        compares with runs taken then); otherwise a probe stands as measured now, for a run now."""
        profile = profile_of_job(job)
        can_probe = self.probe is not None and self.local is not None and hw is self.local
        measured = from_runs(job, hw, runs, profile, other_batch=not can_probe)
        if measured is not None:
            return measured
        if can_probe:
            return self._referenced_probe(job, hw, runs) if probe_on_runs_footing else self._probed_time(job, hw)
        effs = efficiency_from_runs(runs, self._hw_of_run, lambda r: profile_of_job(Job.from_run(r)), hw.device_kind)
        return from_flops(job, hw, profile, effs)

    def _probed_time(self, job: Job, hw: HardwareSpec) -> SequentialTime:
        if job not in self._probed:
            self._probed[job] = from_probe(job, hw, profile_of_job(job), self.probe(job))
        return self._probed[job]

    def _referenced_probe(self, job: Job, hw: HardwareSpec, runs: Sequence[MeasuredRun]) -> SequentialTime:
        """The probe of ``job``, put on the footing of the measured runs: this machine's speed drifts
        by 10-25% between sittings, so to compare a probe taken now with held-out runs taken then,
        the job's probe is multiplied by the median measured/probed ratio of every other workload
        with measured one-device runs, probed in the same sitting (validation probes each of them
        anyway, when it holds it out). Fewer references track the sittings they were measured in:
        with the 3 most-measured workloads, the baselines' median error moved from 5% to 9% when
        those three were re-measured in one evening; with all of them it was 2-5%."""
        probed = self._probed_time(job, hw)
        measured: dict[Job, list[float]] = defaultdict(list)
        for run in baselines_on(hw, runs):
            measured[Job.from_run(run)].append(measured_per_batch_s(run))
        measured.pop(job, None)
        if not measured:
            return probed
        ratio = statistics.median(statistics.median(times) / self._probed_time(ref, hw).batch_s(ref.batch_size)
                                  for ref, times in measured.items())
        return rescaled(probed, job.batch_size, ratio, f"median measured/probed ratio of {len(measured)} other "
                        f"workload(s) with measured one-device runs, probed in the same sitting")

    def _hw_of_run(self, run: MeasuredRun) -> HardwareSpec | None:
        for hw in (self.hw, self.local):
            if hw is not None and on_hardware(run, hw):
                return hw
        return None

    # -- calibration ----------------------------------------------------------------------
    def calibration(self, runs: Sequence[MeasuredRun]) -> tuple[dict[str, Calibration], str]:
        """Calibration per strategy group, and where its runs came from."""
        source, source_hw = self._calibration_source(runs)
        samples: dict[str, list[tuple[Cost, float]]] = defaultdict(list)
        jobs: dict[str, list[Job]] = defaultdict(list)  # each sample's workload
        seqs: dict[Job, SequentialTime | None] = {}  # one T_seq per workload, not per run
        for run in source:
            setup = setup_of_run(run.params, run.tags)
            group = calibration_group(setup)
            if group == "sequential":
                continue
            job = Job.from_run(run)
            if job not in seqs:
                seqs[job] = from_runs(job, source_hw, runs, profile_of_job(job))
            seq = seqs[job]
            if seq is None:
                continue
            cost = model_cost(setup, job, source_hw, profile_of_job(job), seq)
            samples[group].append((cost, measured_per_batch_s(run)))
            jobs[group].append(job)
        fits = fit_group_calibrations(samples)
        fits = {g: replace(c, workloads=workload_ratios(c, samples[g], jobs[g])) for g, c in fits.items()}
        return fits, (source_hw.name if source else "")

    def _calibration_source(self, runs: Sequence[MeasuredRun]) -> tuple[list[MeasuredRun], HardwareSpec]:
        on_target = [r for r in runs if on_hardware(r, self.hw)]
        if on_target:
            return on_target, self.hw
        if self.local is not None and self.local.device_kind == self.hw.device_kind:
            return [r for r in runs if on_hardware(r, self.local)], self.local
        return [], self.hw

    # -- prediction -----------------------------------------------------------------------
    def recommend(self, job: Job, setups: Sequence[Setup] | None = None,
                  exclude: Callable[[MeasuredRun], bool] | None = None, probe_on_runs_footing: bool = False) -> Recommendation:
        # Another allocator changes every CPU timing (1.05-1.37x on large activations): not this job's runs.
        runs = [r for r in self.runs if r.workload.cpu_allocator == job.cpu_allocator and not (exclude and exclude(r))]
        profile = profile_of_job(job)
        seq = self.sequential(job, self.hw, runs, probe_on_runs_footing)
        # Timed only where it is used: as a bound beside the training, or as T_seq's missing loading.
        load_core = self._load_core_s(job) if job.num_workers > 0 or seq.load_per_sample_s == 0 else None
        if load_core is not None and job.num_workers == 0:
            seq = replace(seq, load_per_sample_s=load_core, basis=f"{seq.basis}; plus the loading in the training "
                          f"process (data.num_workers=0), {1e3 * load_core:.1f} ms/sample timed on this machine's core")
        calibrations, source = self.calibration(runs)
        baseline = seq.batch_s(job.batch_size)
        if load_core is not None:
            baseline = max(baseline, loader_bound_s(Setup("sequential"), job, self.hw, load_core))
        predictions = []
        for setup in setups if setups is not None else candidates(self.hw, job):
            group = calibration_group(setup)
            cost = model_cost(setup, job, self.hw, profile, seq)
            if group == "sequential":
                batch_s, how = cost.total_s, ""
            elif group in calibrations:
                calibration = calibrations[group]
                batch_s, how = calibration.apply(cost, job), "; " + calibration.describe(source, job)
            else:
                batch_s = cost.total_s
                how = f"; model uncalibrated (no measured {group} run on {self.hw.device_kind} hardware)"
            bound = loader_bound_s(setup, job, self.hw, load_core) if load_core is not None else 0.0
            if bound > batch_s:
                batch_s = bound
                how += (f"; bound by data loading: {job.num_workers} worker(s) per process at {1e3 * load_core:.1f} "
                        f"ms/sample (timed on this machine's core) cannot keep up")
            epoch = batch_s * job.steps
            predictions.append(Prediction(setup, epoch, baseline * job.steps / epoch, memory_need(setup, job, self.hw, profile),
                                          f"T_seq {seq.basis}{how}"))
        predictions.sort(key=lambda p: (not p.memory.fits, p.epoch_s))
        return Recommendation(job, self.hw, seq, predictions, len(runs), self.prefer_sequential_within)

    def _load_core_s(self, job: Job) -> float | None:
        """One sample's loading on one core, for GPU targets (their loaders run on host cores,
        which the GPU's T_seq does not include); None for CPU targets, whose T_seq is measured
        with the loading in it, or when nothing may be timed."""
        if self.hw.device_kind != "gpu" or self.loading is None:
            return None
        if job not in self._loading:
            self._loading[job] = self.loading(job)()
        return self._loading[job]


# ---- validation (source 004 Tables 8.1 / 8.2) ------------------------------------------


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
    """Source 004 Table 8.1's cell: the recommended and the measured fastest setup of a workload,
    and how much slower the recommended one measured."""

    recommended: str
    fastest: str
    slowdown: float  # measured(recommended) / measured(fastest) - 1
    # The two setups' repeated runs overlap (the recommended one's fastest run beat the fastest
    # setup's slowest): on this machine's noise the measurements do not tell them apart.
    overlapping: bool = False
    predicted_fastest: str = ""  # the recommendation with prefer_sequential_within=0
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
        configs[labels[run.workload], setup_of_run(run.params, run.tags).label].append(run)
    rows = []
    for (workload, label), group in sorted(configs.items()):
        ids = {r.run_id for r in group}
        setup = setup_of_run(group[0].params, group[0].tags)
        job = Job.from_run(group[0])
        # The held-out runs were taken in their own sittings: a probe is put on their footing.
        rec = predictor.recommend(job, [setup], exclude=lambda r, ids=ids: r.run_id in ids, probe_on_runs_footing=True)
        (pred,) = rec.predictions
        times = tuple(r.metrics["mean_epoch_time_s"] for r in group)
        rows.append(ValidationRow(",".join(sorted(ids)), workload, label, calibration_group(setup), pred.epoch_s,
                                  pred.basis, times))
    by_workload: dict[str, list[ValidationRow]] = defaultdict(list)
    for row in rows:
        by_workload[row.workload].append(row)
    return rows, {workload: pick(group, predictor.prefer_sequential_within)
                  for workload, group in by_workload.items() if len(group) >= 2}


def pick(rows: Sequence[ValidationRow], prefer_sequential_within: float = 0.0) -> Pick:
    """One workload's recommendation (:func:`choose` on the predicted times) against its
    measured fastest."""
    recommended = choose(rows, lambda r: r.predicted_s, lambda r: r.group.startswith("sequential"), prefer_sequential_within)
    fastest = min(rows, key=lambda r: r.measured_s)
    wins = resampled_fastest(rows)
    return Pick(recommended.setup, fastest.setup, recommended.measured_s / fastest.measured_s - 1,
                recommended is not fastest and min(recommended.run_times_s) <= max(fastest.run_times_s),
                min(rows, key=lambda r: r.predicted_s).setup,
                float(wins[rows.index(fastest)]), float(wins[rows.index(recommended)]))


def pick_figures(picks: Sequence[Pick]) -> dict[str, float | None]:
    """Source 004 Table 8.1's figures over the workloads' picks (None for each with no picks):
    fractions correct (strict, or with runs overlapping the fastest's, or always taking the
    predicted fastest), what following the picks cost against the measured fastest (the strict
    fraction alone counts a 1% tie like a 2x miss), and the resampling figures of :class:`Pick`
    (``fastest_reproduced_fraction``: what naming the measured fastest could expect against a
    re-measurement)."""
    figures = {
        "correct_fraction": lambda p: p.correct,
        "correct_or_overlapping_fraction": lambda p: p.correct or p.overlapping,
        "predicted_fastest_correct_fraction": lambda p: p.predicted_fastest == p.fastest,
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


def data_config_of_job(job: Job, runs: Sequence[MeasuredRun]):
    """The ``data`` config of a measured run of exactly ``job`` (to probe it as it was measured),
    or None."""
    for run in runs:
        if usable(run) and Job.from_run(run) == job:
            return data_config_from_params(run.params)
    return None


def data_config_from_params(params: dict[str, str]):
    """The ``data`` config of a run, rebuilt from its flattened params (for a probe)."""
    data = {}
    for key, value in params.items():
        if key.startswith("data."):
            data[key[5:]] = None if value == "None" else yaml.safe_load(value)
    return OmegaConf.create(data)
