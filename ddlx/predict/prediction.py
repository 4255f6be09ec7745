"""Predict every setup of a job on a machine, calibrated against the measured runs, and rank them.

Runs are taken from the target hardware when it has any, else from this machine when it is the
same device kind; otherwise the models stand uncalibrated and say so.
"""
from __future__ import annotations

import dataclasses
import socket
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import yaml

from ..allocator import MMAP_CEILING_BYTES, SYSTEM, keep_freed_possible
from ..config import DataConfig
from ..job import Batches, Job
from ..records import MeasuredRun, job_of_run, measured_per_batch_s, on_hardware, usable
from ..errors import ConfigError
from ..strategies import BASELINE, spec_of
from .calibration import Calibration, fit_group_calibrations, workload_ratios
from .compile_gain import CompileGain, measured_gain
from ..costmodel.hardware import HardwareSpec
from ..costmodel.numerics import numerics_of
from ..costmodel.profile import ModelProfile, mapped_bytes, profile_model
from .setups import (
    Cost,
    MemoryNeed,
    SequentialTime,
    Setup,
    calibration_group,
    candidates,
    is_baseline,
    loader_bound_s,
    memory_need,
    model_cost,
    overrides,
    training_processes,
    worker_batch,
    workers_to_keep_up,
)
from .sequential_time import (
    ProbedBatch,
    efficiency_from_runs,
    from_flops,
    from_gpu_model,
    from_probe,
    from_runs,
    with_measured_shares,
)

Probe = Callable[[Job], Callable[[int], list[ProbedBatch]]]
LoadingProbe = Callable[[Job], Callable[[], float]]


@dataclass
class Prediction:
    setup: Setup
    epoch_s: float
    speedup: float
    memory: MemoryNeed
    basis: str
    # Its time rests on the machine's own runs or probe and a model calibrated on runs; else an
    # estimate (counted FLOPs, or a strategy model no run calibrated), shown to two digits.
    calibrated: bool = True
    batch_size: int = 0  # its global batch (per data.batch_per and a batch of its own)
    data_overrides: tuple[str, ...] = ()  # what train.py needs beside the user's data overrides to train that batch
    # Where its loaders cannot keep up: the data.num_workers that would, and its epoch then (None: none would).
    loading_fix: tuple[int, float] | None = None

    @property
    def basis_kind(self) -> str:
        return "calibrated" if self.calibrated else "estimate"

    def as_dict(self) -> dict:
        return {
            "strategy": self.setup.strategy,
            "knobs": {k: list(v) if isinstance(v, tuple) else v for k, v in self.setup.knobs},
            "setup": self.setup.label,
            "overrides": overrides(self.setup),
            "predicted_epoch_s": round(self.epoch_s, 4),
            "speedup": round(self.speedup, 3),
            "memory_per_device_gb": round(self.memory.per_device_gb, 3),
            "memory_limit_gb": round(self.memory.limit_gb, 3),
            "fits": self.memory.fits,
            "basis": self.basis,
            "basis_kind": self.basis_kind,
            "global_batch": self.batch_size,
            "loading_fix": self.loading_fix_dict,
        }

    @property
    def loading_fix_dict(self) -> dict | None:
        if self.loading_fix is None:
            return None
        return {"num_workers": self.loading_fix[0], "predicted_epoch_s": round(self.loading_fix[1], 4)}


@dataclass
class Recommendation:
    job: Job
    hw: HardwareSpec
    sequential: SequentialTime
    predictions: list[Prediction]  # fastest first; those that do not fit last
    runs_used: int
    # Validated error per calibration group on this hardware (median absolute, leave-one-out:
    # validation.group_errors): what decides close calls; empty where nothing is validated.
    errors: dict[str, float] = field(default_factory=dict)
    batches: Batches = field(default_factory=Batches)  # how each setup's batch follows from job.batch_size
    # What the speedups are over: one device, or where one cannot hold the job, the fitting setup
    # of the fewest processes (a speedup over a run that cannot be made says nothing).
    reference: Prediction | None = None
    # What torch.compile gains on this hardware for the job's network (measured; None: no
    # compiled run says), and the epochs of the run asked about (trainer.max_epochs; None: not said).
    compile_gain: CompileGain | None = None
    epochs: int | None = None
    # The hw field overrides the question gave this machine (hw.nodes=2): beside its name where
    # machines are compared, so a file and the same file changed are told apart.
    hw_overrides: tuple[str, ...] = ()
    # The strategies the question asked to rank (recommend.py strategies=[...]); empty: every one.
    strategies: tuple[str, ...] = ()

    @property
    def machine(self) -> str:
        """The machine as the question named it: its hw file, and the overrides it was given."""
        return " ".join([self.hw.name, *self.hw_overrides])

    @property
    def compile_pays(self) -> bool:
        """Compiling the recommended setup makes the run asked about shorter, and it can be compiled."""
        best, gain = self.best, self.compile_gain
        return best is not None and gain is not None and gain.pays(best.epoch_s, self.epochs) and compilable(best.setup)

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
        """The recommended setup: the fastest that fits."""
        return self.fastest

    def close_calls(self, band: float) -> list[Prediction]:
        """The other setups that fit and are predicted within the models' error of the best, so
        the ranking among them is not settled by prediction: the larger validated error of the
        two setups' groups where both have one (:attr:`errors`), else ``band`` (a fraction)."""
        best = self.best
        if best is None:
            return []
        return [p for p in self.fitting if p is not best and p.epoch_s <= best.epoch_s * (1 + self.band(p, band))]

    def band(self, other: Prediction, band: float) -> float:
        """How far from the best ``other`` may be predicted and still be a close call."""
        found = [self.errors.get(calibration_group(p.setup)) for p in (self.best, other)]
        return band if None in found else max(found)


def allocator_advice(rec: Recommendation) -> str | None:
    """When glibc's default allocator maps some of the recommended setup's tensors afresh every
    step (those of 32 MiB or more, which its adaptive threshold never covers), say so and what
    ``cpu_allocator=keep_freed`` would change; None otherwise (GPUs, keep_freed or a preloaded
    malloc, small tensors, or this machine as the target when keep_freed cannot run here).
    Advice, not a prediction: the time it saves was measured on one workload, not modelled."""
    best = rec.best
    job = replace(rec.job, batch_size=best.batch_size) if best else rec.job
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
            f"again; cpu_allocator=keep_freed reuses freed memory instead, at some more peak RAM (measured effects: "
            f"docs/allocator.md). Predictions for it come "
            f"only from runs with it, so measure it")


def profile_of_job(job: Job) -> ModelProfile:
    """The job's model, counted, in the bytes of its precision."""
    return profile_model(job.model, job.num_classes, job.channels, job.image_size).at(numerics_of(job.precision))


class Predictor:
    """Predictions for one target machine from a fixed set of measured runs."""

    def __init__(self, hw: HardwareSpec, runs: Sequence[MeasuredRun], local: HardwareSpec | None = None,
                 probe: Probe | None = None, loading: LoadingProbe | None = None) -> None:
        """``loading``: times one sample's data loading on one core of this machine (for GPU
        targets, whose loaders run on the host's cores: see :func:`~.setups.loader_bound_s`)."""
        self.hw, self.local, self.probe, self.loading = hw, local, probe, loading
        self.runs = [r for r in runs if usable(r)]
        self.measured = list(runs)  # compiled runs too: what compiling gains (:mod:`.compile_gain`)
        self._probed: dict[Job, SequentialTime] = {}
        self._loading: dict[Job, float] = {}

    # -- sequential time ------------------------------------------------------------------
    def sequential(self, job: Job, hw: HardwareSpec, runs: Sequence[MeasuredRun]) -> SequentialTime:
        """Measured runs of the job, else a probe here (when the target is this machine), else the
        GPU model on a GPU, else FLOPs."""
        profile = profile_of_job(job)
        return with_measured_shares(self._sequential(job, hw, runs, profile), job, hw, runs, profile)

    def _sequential(self, job: Job, hw: HardwareSpec, runs: Sequence[MeasuredRun], profile: ModelProfile) -> SequentialTime:
        can_probe = self.probe is not None and self.local is not None and hw is self.local
        measured = from_runs(job, hw, runs, profile, other_batch=not can_probe)
        if measured is not None:
            return measured
        if can_probe:
            return self._probed_time(job, hw)
        modelled = from_gpu_model(job, hw)
        if modelled is not None:
            return modelled
        effs = efficiency_from_runs(runs, self._hw_of_run, lambda r: profile_of_job(job_of_run(r)), hw.device_kind)
        return from_flops(job, hw, profile, effs)

    def _probed_time(self, job: Job, hw: HardwareSpec) -> SequentialTime:
        if job not in self._probed:
            self._probed[job] = from_probe(job, hw, profile_of_job(job), self.probe(job))
        return self._probed[job]

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
            setup = run.strategy_setup
            group = calibration_group(setup)
            if group == BASELINE:
                continue
            job = job_of_run(run)
            if job not in seqs:
                profile = profile_of_job(job)
                seq = from_runs(job, source_hw, runs, profile)
                seqs[job] = seq and with_measured_shares(seq, job, source_hw, runs, profile)
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
                  exclude: Callable[[MeasuredRun], bool] | None = None, batches: Batches = Batches(),
                  tries: dict | None = None) -> Recommendation:
        """``job``'s batch is the batch as stated (``batches`` says what each setup's global batch
        is then); ``setups``: these, else the candidates on the hardware (``tries``: the knob
        values they try instead of the strategies' own choice)."""
        # Another allocator (docs/allocator.md), precision or loading (decoded images kept in memory or
        # not) changes every timing: not this job's runs.
        runs = [r for r in self.runs if r.workload.cpu_allocator == job.cpu_allocator
                and r.workload.precision == job.precision and r.workload.data_cache == job.data_cache
                and not (exclude and exclude(r))]
        profile = profile_of_job(job)
        seq = self._sequential_with_loading(job, runs)
        load_core = self._load_core_s(job) if job.num_workers > 0 or seq.load_per_sample_s == 0 else None
        calibrations, source = self.calibration(runs)
        baseline = seq.batch_s(job.batch_size)
        if load_core is not None:
            baseline = max(baseline, loader_bound_s(spec_of(BASELINE).setup(), job, self.hw, load_core))
        predictions = []
        for setup in setups if setups is not None else candidates(self.hw, job, batches, tries):
            group = calibration_group(setup)
            theirs = batches.job_of(job, setup.strategy, training_processes(setup))
            their_seq = seq if theirs == job else self._sequential_with_loading(theirs, runs)

            def timed(their_seq: SequentialTime) -> tuple[float, str]:
                cost = model_cost(setup, theirs, self.hw, profile, their_seq)
                if group == BASELINE:
                    return cost.total_s, ""
                if group in calibrations:
                    calibration = calibrations[group]
                    return calibration.apply(cost, theirs), "; " + calibration.describe(source, theirs)
                return cost.total_s, f"; model uncalibrated (no measured {group} run on {self.hw.device_kind} hardware)"

            batch_s, how = timed(their_seq)
            bound = loader_bound_s(setup, theirs, self.hw, load_core) if load_core is not None else 0.0
            loading_fix = None
            if self.hw.device_kind == "gpu" and theirs.num_workers == 0 and their_seq.load_per_sample_s > 0:
                # the training process loads its own data between steps: the workers that would hide it
                hidden_s, _ = timed(replace(their_seq, load_per_sample_s=0.0))
                enough = workers_to_keep_up(setup, theirs, self.hw, their_seq.load_per_sample_s, hidden_s)
                if enough is not None:
                    loading_fix = (enough, hidden_s * theirs.steps)
                    how += f"; data.num_workers={enough} would load beside the steps"
            if bound > batch_s:
                enough = workers_to_keep_up(setup, theirs, self.hw, load_core, batch_s)
                fix = (f"data.num_workers={enough} would" if enough is not None else
                       f"not even all of a process's share of the node's {self.hw.cores_per_node} cores would: keep "
                       f"the decoded images in memory (data.cache=auto) or decode fewer pixels")
                loading_fix = None if enough is None else (enough, batch_s * theirs.steps)
                batch_s = bound
                how += (f"; bound by data loading: {job.num_workers} worker(s) per process at {1e3 * load_core:.1f} "
                        f"ms/sample (timed on this machine's core) cannot keep up; {fix}")
            epoch = batch_s * theirs.steps
            calibrated = not their_seq.estimated and (group == BASELINE or group in calibrations)
            stated = batches.stated(setup.strategy)
            predictions.append(Prediction(setup, epoch, baseline * job.steps / epoch, memory_need(setup, theirs, self.hw, profile, their_seq),
                                          f"T_seq {their_seq.basis}{how}", calibrated, theirs.batch_size,
                                          (f"data.batch_size={stated}",) if stated else (), loading_fix))
        predictions.sort(key=lambda p: (not p.memory.fits, p.epoch_s))
        reference = speedup_reference(predictions)
        if reference is not None and not is_baseline(reference.setup):
            for p in predictions:
                p.speedup = reference.epoch_s / p.epoch_s
        return Recommendation(job, self.hw, seq, predictions, len(runs), batches=batches, reference=reference,
                              compile_gain=measured_gain(self.measured, job, self.hw, next(
                                  (p.setup.label for p in predictions if p.memory.fits), None)))

    def _sequential_with_loading(self, job: Job, runs: Sequence[MeasuredRun]) -> SequentialTime:
        """T_seq of ``job``, with the training process's own loading timed here when it must be
        added (a GPU target's loaders with ``data.num_workers=0``)."""
        seq = self.sequential(job, self.hw, runs)
        if job.num_workers == 0 and seq.load_per_sample_s == 0:
            load_core = self._load_core_s(job)  # timed only where it is used
            if load_core is not None:
                seq = replace(seq, load_per_sample_s=load_core, basis=f"{seq.basis}; plus the loading in the training "
                              f"process (data.num_workers=0), {1e3 * load_core:.1f} ms/sample timed on this machine's core")
        return seq

    def _load_core_s(self, job: Job) -> float | None:
        """One sample's loading on one core, for GPU targets (their loaders run on host cores,
        which the GPU's T_seq does not include); None for CPU targets, whose T_seq is measured
        with the loading in it, or when nothing may be timed."""
        if self.hw.device_kind != "gpu" or self.loading is None:
            return None
        if job not in self._loading:
            self._loading[job] = self.loading(job)()
        return self._loading[job]


def compilable(setup: Setup) -> bool:
    """``setup``'s strategy can take compile.enable (:meth:`~ddlx.strategies.spec.StrategySpec.compile_unit`)."""
    try:
        spec_of(setup.strategy).compile_unit(setup)
    except ConfigError:
        return False
    return True


def speedup_reference(predictions: list[Prediction]) -> Prediction | None:
    """The one-device setup, or when it does not fit, the fitting setup of the fewest training
    processes (the fastest of those); None when nothing fits."""
    one = next((p for p in predictions if is_baseline(p.setup)), None)
    if one is not None and one.memory.fits:
        return one
    fitting = [p for p in predictions if p.memory.fits]
    return min(fitting, key=lambda p: (training_processes(p.setup), p.epoch_s)) if fitting else one


def data_config_of_job(job: Job, runs: Sequence[MeasuredRun]):
    """The ``data`` config of a measured run of exactly ``job`` (to probe it as it was measured),
    or None."""
    for run in runs:
        if usable(run) and job_of_run(run) == job:
            data = data_config_from_params(run.params)
            data.cache = "auto" if run.workload.data_cache == "memory" else "none"  # as it loaded
            return data
    return None


def data_config_from_params(params: dict[str, str]) -> DataConfig:
    """The ``data`` config of a run, rebuilt from its flattened params (for a probe); a key this
    release's :class:`~ddlx.config.DataConfig` no longer has is left out."""
    known = {f.name for f in dataclasses.fields(DataConfig)}
    data = {}
    for key, value in params.items():
        if key.startswith("data.") and key[5:] in known:
            data[key[5:]] = None if value == "None" else yaml.safe_load(value)
    return DataConfig(**data)
