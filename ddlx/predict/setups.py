"""Strategy setups on a described machine: which exist, their modelled time and memory, each
answered by the strategy's own spec (:mod:`ddlx.strategies`); the parts the models share are in
:mod:`.costs`."""
from __future__ import annotations

import math

from ..errors import ConfigError
from ..job import Batches, Job
from ..strategies import BASELINE, STRATEGIES, Setup, spec_of
from ..costmodel.costs import Cost, MemoryNeed, SequentialTime, weight_seconds
from ..costmodel.hardware import HardwareSpec
from ..costmodel.profile import ModelProfile

__all__ = ["Cost", "MemoryNeed", "SequentialTime", "Setup", "calibration_group", "candidates", "loader_bound_s",
           "memory_need", "model_batch_s", "model_cost", "overrides", "splits_batch", "training_processes",
           "weight_seconds", "worker_batch"]


def candidates(hw: HardwareSpec, job: Job, batches: Batches = Batches(), tries: dict | None = None) -> list[Setup]:
    """The setups worth predicting on ``hw``: every strategy's own choice of knob values, or the
    values ``tries`` gives it (``{strategy: {knob: [values]}}``, checked by :func:`.choices.check_tries`),
    each on its batch (``batches``) split evenly over its processes."""
    out = []
    for spec in STRATEGIES.values():
        own = batches.job_of(job, spec.name, 1)  # one process's (one pipeline's) batch
        for setup in tried(spec.candidates(hw, own), (tries or {}).get(spec.name, {})):
            processes = training_processes(setup)
            theirs = batches.job_of(job, setup.strategy, processes)
            if (theirs.batch_size % processes == 0 and spec.accepts(setup, theirs) and spec.places(setup, hw)
                    and theirs.precision not in spec.refused_precisions(setup)):
                out.append(setup)
    return out


def tried(setups: list[Setup], knobs: dict) -> list[Setup]:
    """``setups`` with each knob of ``knobs`` set to each of its values instead, each built by its
    spec (a knob at a default its setup leaves out, e.g. ``checkpoint=never``, is left out, as a
    measured run's is)."""
    if not knobs:
        return setups
    out = []
    for setup in setups:
        variants = [setup.values()]
        for knob, values in knobs.items():
            variants = [v | {knob: tuple(value) if isinstance(value, list) else value} for v in variants for value in values]
        out += [spec_of(setup.strategy).setup(**v) for v in variants]
    return list(dict.fromkeys(out))


def only_strategies(setups: list[Setup], names: list[str], hw: HardwareSpec, required: bool = True) -> list[Setup]:
    """``setups`` of the strategies ``names`` ([]: all) and the one-device setup (the speedups'
    reference); with ``required``, a :class:`ConfigError` when none of those strategies has a
    setup on ``hw`` (a machine compared with it may have none)."""
    if not names:
        return setups
    kept = [s for s in setups if s.strategy in names or is_baseline(s)]
    if required and not any(s.strategy in names for s in kept):
        placed = sorted({s.strategy for s in setups}, key=list(STRATEGIES).index)
        raise ConfigError(f"strategies=[{','.join(names)}]: none has a setup on hw={hw.name} ({hw.nodes} node(s) x "
                          f"{hw.devices_per_node} {hw.device_kind} device(s)); the strategies that have: {', '.join(placed)}")
    return kept


def calibration_group(setup: Setup) -> str:
    """Setups whose measured/model ratios are pooled for calibration."""
    spec = STRATEGIES.get(setup.strategy)
    return spec.calibration_group(setup) if spec is not None else setup.strategy


def is_baseline(setup: Setup) -> bool:
    """The one-device setup speedups are over and T_seq is measured by: one GPU, or one core
    (``sequential threads=2`` is not)."""
    return calibration_group(setup) == BASELINE


def overrides(setup: Setup) -> str:
    """The train.py overrides that run ``setup`` (what its launcher sets is not one of them)."""
    return STRATEGIES[setup.strategy].overrides(setup)


def splits_batch(group: str) -> bool:
    """Whether the setups of a calibration group each train a share of every batch."""
    return group in STRATEGIES and STRATEGIES[group].splits_batch


def model_cost(setup: Setup, job: Job, hw: HardwareSpec, profile: ModelProfile, seq: SequentialTime) -> Cost:
    """The modelled batch time of ``setup``, split into each worker's share of the forward and
    backward work (``compute``) and the rest (``overhead``)."""
    return spec_of(setup.strategy).cost(setup, job, hw, profile, seq)


def model_batch_s(setup: Setup, job: Job, hw: HardwareSpec, profile: ModelProfile, seq: SequentialTime) -> float:
    """Modelled seconds per global batch of ``setup`` (before calibration)."""
    return model_cost(setup, job, hw, profile, seq).total_s


def memory_need(setup: Setup, job: Job, hw: HardwareSpec, profile: ModelProfile,
                seq: SequentialTime | None = None) -> MemoryNeed:
    """Bytes per device (per node's RAM for CPU setups, where every process shares it); a
    pipeline's stages cut by ``seq``'s layer times where given, as its time model cuts them."""
    return spec_of(setup.strategy).memory(setup, job, hw, profile, seq)


def training_processes(setup: Setup) -> int:
    """The training processes of ``setup`` (each with its own data loader)."""
    spec = STRATEGIES.get(setup.strategy)
    return spec.processes(setup) if spec is not None else 1  # a strategy since removed: its knobs are unknown


def worker_batch(setup: Setup, job: Job) -> int:
    """The samples one worker allocates activations for in a step: the global batch, split over
    data-parallel processes or threads, or a pipeline's micro-batch."""
    return spec_of(setup.strategy).worker_batch(setup, job)


def workers_to_keep_up(setup: Setup, job: Job, hw: HardwareSpec, load_core_s: float, batch_s: float) -> int | None:
    """The ``data.num_workers`` per training process with which its loading keeps up with
    ``batch_s`` seconds a batch; None when its share of the node's cores cannot."""
    processes = training_processes(setup)
    cores = max(1, hw.cores_per_node // min(processes, hw.devices_per_node))
    need = math.ceil(job.batch_size / processes * load_core_s / batch_s)
    return need if need <= cores else None


def loader_bound_s(setup: Setup, job: Job, hw: HardwareSpec, load_core_s: float) -> float:
    """The least seconds per global batch the data loaders need when they run beside the training
    (``data.num_workers`` > 0; 0 otherwise: then the loading is part of the step, in T_seq): each
    training process loads its b/P samples in its workers, prefetching while the devices train,
    on at most its share of the node's cores; ``load_core_s`` is one sample's loading on one
    core. Decoding JPEGs on 2 workers per process easily bounds a fast GPU on small networks."""
    if job.num_workers <= 0:
        return 0.0
    processes = training_processes(setup)
    per_node = min(processes, hw.devices_per_node)
    cores = min(job.num_workers, max(1, hw.cores_per_node // per_node))
    return job.batch_size / processes * load_core_s / cores
