"""What every strategy's time and memory models are made of (each strategy's spec, in
:mod:`ddlx.strategies`, says which apply to it).

The time of one global batch is modelled from the sequential time split as

    t_seq(b) = b * (per_sample_s + load_per_sample_s) + weight_s

``weight_s`` is the per-step traffic over the parameters that does not shrink with the batch:
the optimizer step and gradient reset, the forward and backward passes' weight reads and the
gradient writes (``WEIGHT_PASSES`` passes over the parameters at the memory bandwidth). Every
data-parallel replica pays it in full, and on a CPU node all replicas share one memory bus, so
there it adds up: why FC-heavy networks scale worse than convolutional ones under data
parallelism on CPU. The thesis' models have no such term; they were built for GPUs, where each
replica has its own memory. ``load_per_sample_s`` is the training process's own data loading
(its measured data wait): intra-op threads and the threads strategy leave it to one thread,
data-parallel processes each load their share.

No torch here: the strategy specs import this when the config is composed.
"""
from __future__ import annotations

from collections.abc import Callable

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .hardware import GB, HardwareSpec, LinkSpec
from .perf_models import Link

if TYPE_CHECKING:
    from ..job import Job
    from .profile import ModelProfile

# Passes over the parameters per step (x 4 bytes each in fp32): SGD with momentum reads param, grad and
# momentum and writes param and momentum, the gradient reset writes, forward and backward read
# the weights and backward writes the gradient: 8; 12 fits measured CPU baselines (solved for
# the compute rate and this) and covers cache misses.
WEIGHT_PASSES = 12
# Share of those passes each extra replica on the same weights repeats (its own forward and
# backward weight reads and gradient accumulation; the optimizer step is done once).
REPLICA_SHARE = 0.5
FORWARD_SHARE = 1 / 3  # of a training step's FLOPs (backward = 2 x forward): what checkpointing recomputes
RECOMPUTE = ("never", "always")  # strategy.checkpoint of ddp_*, fsdp, pipe engine=torch: every block between cut points
MEMORY_HEADROOM = 0.9  # of a device's memory usable for training
DEFAULT_BUCKET_MB = 25.0


@dataclass
class SequentialTime:
    """One device's time for a global batch: (``per_sample_s`` + ``load_per_sample_s``) x b +
    ``weight_s``, and its basis. ``load_per_sample_s``: the training process's own data loading
    (its measured data wait), which intra-op threads do not share out and data-parallel
    processes split; 0 where it was not measured apart (a probe, a FLOPs estimate)."""

    per_sample_s: float
    weight_s: float
    basis: str
    load_per_sample_s: float = 0.0
    estimated: bool = False  # counted FLOPs over a peak, not a run or a probe on the machine
    measured: bool = False  # the machine's one-device runs of this very batch: no run need be made to know it
    # A step's compute (no weight traffic) at n samples where it is not n x per_sample_s: on a GPU
    # a small batch leaves its units idle and every kernel costs a launch (:mod:`.gpu_time`).
    step_s: Callable[[int], float] | None = None
    # The same per top-level layer, (forward, backward): a pipeline's stages are as slow as their
    # layers, and DDP's buckets are ready as the backward pass reaches them.
    layers_s: Callable[[int], tuple[tuple[float, float], ...]] | None = None

    def stage_s(self, balance: list[int], samples: int) -> list[float] | None:
        """Seconds of each stage of a model cut by ``balance`` on ``samples`` at a time, where the
        time is known per layer (None: shares of the FLOPs stand in)."""
        if self.layers_s is None:
            return None
        layers, out, start = self.layers_s(max(1, int(samples))), [], 0
        for count in balance:
            out.append(sum(f + b for f, b in layers[start:start + count]))
            start += count
        return out

    def layers_s_at(self, samples: float, profile: ModelProfile) -> tuple[tuple[float, float], ...] | None:
        """Each of ``profile``'s top-level layers' (forward, backward) on ``samples`` at a time, in
        the model's order (None: not known per layer of that profile)."""
        layers = None if self.layers_s is None else self.layers_s(max(1, int(samples)))
        return layers if layers and len(layers) == len(profile.layers) else None

    def per_sample_at(self, samples: float) -> float:
        """Per sample when the device works on ``samples`` at a time (a worker's share of the
        batch, a micro-batch)."""
        if self.step_s is None or samples < 1:
            return self.per_sample_s
        return self.step_s(int(samples)) / int(samples)

    def batch_s(self, batch: int) -> float:
        return batch * (self.per_sample_at(batch) + self.load_per_sample_s) + self.weight_s


@dataclass(frozen=True)
class Cost:
    """A modelled batch time in two parts that calibration may weigh apart: ``compute`` (the
    forward/backward work each worker does on its share) and ``overhead`` (weight traffic,
    communication, synchronisation)."""

    compute_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.overhead_s


def cost(compute_s: float, total_s: float) -> Cost:
    """``total_s`` split into its compute part (at most all of it) and the rest."""
    compute = min(total_s, compute_s)
    return Cost(compute, total_s - compute)


def weight_seconds(profile: ModelProfile, hw: HardwareSpec) -> float:
    """One replica's weight traffic moved by one core (one device), in the profile's precision."""
    return WEIGHT_PASSES * profile.params * profile.param_bytes / (hw.memory_bandwidth_gb_s * GB)


def weight_traffic_s(seq: SequentialTime, hw: HardwareSpec, replicas: float, cores: int) -> float:
    """``replicas`` x one replica's weight traffic moved by ``cores`` cores of one CPU node: each
    core moves ``memory_bandwidth_gb_s``, all of them together at most the node's
    ``node_memory_bandwidth_gb_s``. On GPUs every device has its own memory: the caller passes
    one device's share."""
    if hw.device_kind != "cpu":
        return seq.weight_s * replicas
    return seq.weight_s * replicas * hw.memory_bandwidth_gb_s / node_copy_gb_s(hw, cores)


def node_copy_gb_s(hw: HardwareSpec, cores: int) -> float:
    """What ``cores`` cores of one CPU node copy together: each ``memory_bandwidth_gb_s``, all of
    them at most the node's ``node_memory_bandwidth_gb_s``."""
    per_core = hw.memory_bandwidth_gb_s
    return min(hw.node_memory_bandwidth_gb_s or per_core * cores, per_core * max(1, cores))


def link(spec: LinkSpec) -> Link:
    return Link(spec.latency_us * 1e-6, spec.bandwidth_gb_s * 1e3)


def ring(hw: HardwareSpec, workers: int) -> list[Link]:
    """Workers fill nodes in order (device d of node n is global n * devices_per_node + d); more
    workers than devices (CPU processes beyond the cores) share them, in turn."""
    return [link(spec) for spec in hw.ring_links([rank_device(hw, r) for r in range(workers)])]


def computing_at_once(hw: HardwareSpec, workers: int) -> int:
    """How many of ``workers`` processes compute at once: CPU processes beyond the cores share them."""
    return max(1, min(workers, hw.total_devices))


def rank_device(hw: HardwareSpec, rank: int) -> int:
    """The device (core on CPU) of a job's ``rank``-th worker: nodes filled in order, then shared in turn."""
    return rank % hw.total_devices


def gpu_index(device: str) -> int:
    return int(device.split(":")[1])


def cut_mb(profile: ModelProfile) -> float:
    """The activations crossing the model's own split point, per sample (MB)."""
    return profile.layers[profile.split_index - 1].output_bytes / 1e6


# ---- memory -----------------------------------------------------------------------------


@dataclass
class MemoryNeed:
    per_device_gb: float
    limit_gb: float
    what: str = ""  # the limit compared against
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.per_device_gb <= self.limit_gb


def replica_bytes(job: Job, batch: int, recompute: bool = False) -> int:
    """A whole replica (the estimate train.py checks before training), in the job's precision,
    with ``recompute``: checkpointing its activations at the model's cut points."""
    from .memory import estimate_training_memory

    estimate, _ = estimate_training_memory(job.model, job.num_classes, job.channels, job.image_size, batch,
                                           precision=job.precision, recompute=recompute)
    return estimate.total_bytes


def recomputes(knobs) -> bool:
    """Whether ``knobs`` (a strategy's typed config, its :class:`Setup` or a pipeline's: anything with
    a ``checkpoint`` knob) recompute every block between the cut points
    (``strategy.checkpoint=always`` of ddp_*, fsdp, pipe engine=torch)."""
    return knobs.checkpoint == "always"


def recompute_factor(knobs, backward_passes: int = 1) -> float:
    """A step's compute against one that keeps every activation: under :func:`recomputes`, the
    forward once more per backward pass through a block (ZB-V makes two)."""
    return 1 + FORWARD_SHARE * backward_passes if recomputes(knobs) else 1.0


def recomputed_share(checkpoint: str, chunks: int) -> float:
    """The share of a batch's micro-batches whose activations a pipeline recomputes in backward
    instead of keeping: torchgpipe's and fairscale's ``checkpoint`` names micro-batches, not
    stages (``except_last``: every micro-batch but the last, on every stage; their default)."""
    return {"always": 1.0, "except_last": (chunks - 1) / chunks}.get(checkpoint, 0.0)


def stage_bytes(profile: ModelProfile, balance: list[int], batch: int, chunks: int, checkpoint: str) -> list[int]:
    """Bytes each stage of a model cut by ``balance`` keeps while training ``batch`` samples in
    ``chunks`` micro-batches: its weights, gradients and momentum, and its activations; for a
    recomputed micro-batch (``checkpoint``) it keeps only the stage's input, and holds one
    micro-batch's activations at a time when it recomputes them in backward."""
    micro = max(1, batch // chunks)
    recomputed = round(recomputed_share(checkpoint, chunks) * chunks) * micro
    parts = profile.partitions(balance)
    inputs = [profile.input_bytes] + profile.boundary_bytes(balance)
    out = []
    for i, part in enumerate(parts):
        acts = sum(layer.activation_bytes for layer in part)  # the first layer's saved input among them
        # Backward runs the kept micro-batches first and frees them, then recomputes the others one at a time.
        kept = recomputed * inputs[i] + max(batch - recomputed, micro if recomputed else 0) * acts
        out.append(profile.state_bytes(sum(layer.params for layer in part)) + kept)
    return out


def memory_need(hw: HardwareSpec, per_process_bytes: float, processes_per_node: int = 1) -> MemoryNeed:
    """Against a GPU's memory, one device's bytes; against a CPU node's RAM, all its processes'."""
    if hw.device_kind == "cpu":
        need = per_process_bytes * processes_per_node / GB
        return MemoryNeed(need, MEMORY_HEADROOM * hw.ram_per_node_gb, f"{hw.ram_per_node_gb:.0f} GB RAM per node")
    from .gpu_measured import gpu_working_memory

    working, _ = gpu_working_memory()  # cuBLAS's and cuDNN's workspaces beside what is counted
    return MemoryNeed((per_process_bytes + working) / GB, MEMORY_HEADROOM * hw.memory_per_device_gb,
                      f"{hw.memory_per_device_gb:.0f} GB per device")
