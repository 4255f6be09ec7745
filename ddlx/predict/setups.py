"""Strategy setups on a described machine: which exist, their modelled time and memory, each
answered by the strategy's own spec (:mod:`ddlx.strategies`); the parts the models share are in
:mod:`.costs`."""
from __future__ import annotations

from ..job import Job
from ..strategies import STRATEGIES, Setup, spec_of
from .costs import Cost, MemoryNeed, SequentialTime, weight_seconds
from .hardware import HardwareSpec
from .profile import ModelProfile

__all__ = ["Cost", "MemoryNeed", "SequentialTime", "Setup", "calibration_group", "candidates", "loader_bound_s",
           "memory_need", "model_batch_s", "model_cost", "setup_of_run", "splits_batch", "training_processes",
           "weight_seconds", "worker_batch"]


def candidates(hw: HardwareSpec, job: Job) -> list[Setup]:
    """The setups worth predicting on ``hw``: every strategy's, each dividing the batch evenly."""
    out = [setup for spec in STRATEGIES.values() for setup in spec.candidates(hw, job)]
    return [s for s in out if job.batch_size % training_processes(s) == 0]


def setup_of_run(params: dict[str, str], tags: dict[str, str]) -> Setup:
    """The setup a measured run used, in the same terms as :func:`candidates`."""
    name = tags.get("strategy", params.get("strategy.name", "?"))
    return STRATEGIES[name].setup_of_run(params, tags) if name in STRATEGIES else Setup(name)


def calibration_group(setup: Setup) -> str:
    """Setups whose measured/model ratios are pooled for calibration."""
    spec = STRATEGIES.get(setup.strategy)
    return spec.calibration_group(setup) if spec is not None else setup.strategy


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


def memory_need(setup: Setup, job: Job, hw: HardwareSpec, profile: ModelProfile) -> MemoryNeed:
    """Bytes per device (per node's RAM for CPU setups, where every process shares it)."""
    return spec_of(setup.strategy).memory(setup, job, hw, profile)


def training_processes(setup: Setup) -> int:
    """The training processes of ``setup`` (each with its own data loader)."""
    spec = STRATEGIES.get(setup.strategy)
    return spec.processes(setup) if spec is not None else setup.get("processes") or setup.get("ranks") or 1


def worker_batch(setup: Setup, job: Job) -> int:
    """The samples one worker allocates activations for in a step: the global batch, split over
    data-parallel processes or threads, or a pipeline's micro-batch."""
    return spec_of(setup.strategy).worker_batch(setup, job)


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
