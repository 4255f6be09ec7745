"""Strategy setups on a described machine: which ones exist, their modelled time and memory.

A :class:`Setup` is a strategy config (an option of the ``strategy`` group) with its knobs; the
time of one global batch comes from :mod:`.perf_models`, given the sequential time split as

    t_seq(b) = b * (per_sample_s + load_per_sample_s) + weight_s

``weight_s`` is the per-step traffic over the parameters that does not shrink with the batch:
the optimizer step and gradient reset, the forward and backward passes' weight reads and the
gradient writes (``WEIGHT_PASSES`` passes over the parameters at the memory bandwidth). Every
data-parallel replica pays it in full, and on a CPU node all replicas share one memory bus, so
there it adds up: why FC-heavy AlexNet (57M parameters, few FLOPs) scales worse than ResNet18
under data parallelism on CPU. The thesis' models have no such term; they were built for GPUs,
where each replica has its own memory. ``load_per_sample_s`` is the training process's own data
loading (its measured data wait): intra-op threads and the threads strategy leave it to one
thread, data-parallel processes each load their share.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .hardware import GB, HardwareSpec, LinkSpec
from .job import Job
from .perf_models import (
    Link,
    cpu_mp_s,
    data_parallel_s,
    gpipe_comm_s,
    gpipe_compute_s,
    hybrid_s,
    split_s,
    threads_s,
)
from .memory import estimate_training_memory
from .profile import FLOAT_BYTES, ModelProfile

# Passes over the parameters per step (x 4 bytes each): SGD with momentum reads param, grad and
# momentum and writes param and momentum, the gradient reset writes, forward and backward read
# the weights and backward writes the gradient: 8; 12 fits this project's CPU runs (AlexNet and
# ResNet18 baselines solved for the compute rate and this) and covers cache misses.
WEIGHT_PASSES = 12
# Share of those passes each extra replica on the same weights repeats (its own forward and
# backward weight reads and gradient accumulation; the optimizer step is done once).
REPLICA_SHARE = 0.5
FORWARD_SHARE = 1 / 3  # of a training step's FLOPs (backward = 2 x forward): what checkpointing recomputes
MEMORY_HEADROOM = 0.9  # of a device's memory usable for training
DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class Setup:
    strategy: str
    knobs: tuple[tuple[str, object], ...] = ()

    def get(self, key: str, default=None):
        return dict(self.knobs).get(key, default)

    @property
    def label(self) -> str:
        return " ".join([self.strategy, *(f"{k}={_render(v)}" for k, v in self.knobs)])

    @property
    def overrides(self) -> str:
        """The train.py overrides that run this setup."""
        parts = [f"strategy={self.strategy}"]
        for key, value in self.knobs:
            parts.append(f"trainer={value}" if key == "trainer" else f"strategy.{key}={_render(value)}")
        return " ".join(parts)


def _render(value) -> str:
    return f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value)


def _gpu_index(device: str) -> int:
    return int(device.split(":")[1])


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

    def batch_s(self, batch: int) -> float:
        return batch * (self.per_sample_s + self.load_per_sample_s) + self.weight_s


def weight_seconds(params: int, hw: HardwareSpec) -> float:
    """One replica's weight traffic moved by one core (one device)."""
    return WEIGHT_PASSES * params * FLOAT_BYTES / (hw.memory_bandwidth_gb_s * GB)


def weight_traffic_s(seq: SequentialTime, hw: HardwareSpec, replicas: float, cores: int) -> float:
    """``replicas`` x one replica's weight traffic moved by ``cores`` cores of one CPU node: each
    core moves ``memory_bandwidth_gb_s``, all of them together at most the node's
    ``node_memory_bandwidth_gb_s`` (measured here: 13.5 GB/s one core, 22 GB/s two). On GPUs
    every device has its own memory: the caller passes one device's share."""
    if hw.device_kind != "cpu":
        return seq.weight_s * replicas
    per_core = hw.memory_bandwidth_gb_s
    together = min(hw.node_memory_bandwidth_gb_s or per_core * cores, per_core * max(1, cores))
    return seq.weight_s * replicas * per_core / together


def _link(spec: LinkSpec) -> Link:
    return Link(spec.latency_us * 1e-6, spec.bandwidth_gb_s * 1e3)


def _ring(hw: HardwareSpec, workers: int) -> list[Link]:
    """Workers fill nodes in order (device d of node n is global n * devices_per_node + d)."""
    return [_link(link) for link in hw.ring_links(list(range(workers)))]


def candidates(hw: HardwareSpec, job: Job) -> list[Setup]:
    """The setups worth predicting on ``hw``: every strategy that can run there, with the knobs a
    user would try (all devices, and pipelines of 2 and all devices with several chunk counts)."""
    n, total = hw.devices_per_node, hw.total_devices
    chunks = [c for c in (2, 4, 8, 16) if c <= job.batch_size]
    out: list[Setup] = []
    if hw.device_kind == "cpu":
        out.append(Setup("sequential", (("threads", 1),)))
        if n > 1:
            out += [Setup("sequential", (("threads", n),)), Setup("threads", (("threads", n),)),
                    Setup("cpu_mp", (("processes", n),)), Setup("ddp_gloo", (("processes", n),))]
            out += [Setup("pipe", (("chunks", c), ("devices", ("cpu", "cpu")))) for c in chunks]
        if hw.nodes > 1:
            out.append(Setup("mpi", (("ranks", total), ("local", "sequential"))))
        return [s for s in out if _divides(s, job)]
    out.append(Setup("sequential", (("trainer", "gpu"),)))
    if n > 1:
        out += [Setup("ddp_nccl", (("processes", n),)), Setup("split", (("devices", ("cuda:0", "cuda:1")),))]
        for stages in sorted({2, n}):
            devices = tuple(f"cuda:{i}" for i in range(stages))
            out += [Setup("pipe", (("chunks", c), ("devices", devices))) for c in chunks if c >= stages]
        if chunks:  # when nothing else fits: recompute activations instead of keeping them
            out.append(Setup("pipe", (("chunks", chunks[-1]), ("devices", devices), ("checkpoint", "always"))))
        if n >= 4:
            out.append(Setup("hybrid", (("processes", n // 2), ("local", "split"))))
    if hw.nodes > 1:
        out.append(Setup("mpi", (("ranks", total), ("local", "sequential"))))
    return [s for s in out if _divides(s, job)]


def _divides(setup: Setup, job: Job) -> bool:
    return job.batch_size % training_processes(setup) == 0


def setup_of_run(params: dict[str, str], tags: dict[str, str]) -> Setup:
    """The setup a measured run used, in the same terms as :func:`candidates`."""
    strategy = tags.get("strategy", params.get("strategy.name", "?"))
    if strategy == "sequential":
        if tags.get("accelerator") == "gpu":
            return Setup("sequential", (("trainer", "gpu"),))
        return Setup("sequential", (("threads", int(params.get("strategy.threads", 1))),))
    if strategy == "threads":
        return Setup("threads", (("threads", int(params["strategy.threads"])),))
    if strategy in ("cpu_mp", "ddp_gloo", "ddp_nccl"):
        return Setup(strategy, (("processes", int(params["strategy.processes"])),))
    devices = tuple(tags.get("devices", "cpu,cpu").split(","))
    if strategy == "pipe":
        knobs = (("chunks", int(params["strategy.chunks"])), ("devices", devices))
        checkpoint = params.get("strategy.checkpoint", "never")
        return Setup("pipe", knobs + ((("checkpoint", checkpoint),) if checkpoint != "never" else ()))
    if strategy == "split":
        return Setup("split", (("devices", devices),))
    if strategy == "hybrid":
        return Setup("hybrid", (("processes", int(params["strategy.processes"])), ("local", params.get("strategy.local", "split"))))
    if strategy == "mpi":
        return Setup("mpi", (("ranks", int(tags.get("ranks", 1))), ("local", params.get("strategy.local", "sequential"))))
    return Setup(strategy)


def calibration_group(setup: Setup) -> str:
    """Setups whose measured/model ratios are pooled for calibration."""
    if setup.strategy == "sequential":
        return "sequential" if setup.get("threads", 1) == 1 else "sequential-threads"
    return setup.strategy


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


def model_batch_s(setup: Setup, job: Job, hw: HardwareSpec, profile: ModelProfile, seq: SequentialTime) -> float:
    """Modelled seconds per global batch of ``setup`` (before calibration)."""
    return model_cost(setup, job, hw, profile, seq).total_s


def model_cost(setup: Setup, job: Job, hw: HardwareSpec, profile: ModelProfile, seq: SequentialTime) -> Cost:
    """The modelled batch time of ``setup``, split into each worker's share of the forward and
    backward work (``compute``) and the rest (``overhead``)."""
    b, g = job.batch_size, profile.gradient_mb
    bucket = float(setup.get("bucket_cap_mb", DEFAULT_BUCKET_MB))
    fixed = hw.allreduce_fixed_us * 1e-6
    name = setup.strategy
    shared_bus = hw.device_kind == "cpu"  # replicas of a CPU node share one memory bus
    compute = b * seq.per_sample_s
    load = b * seq.load_per_sample_s
    cut_mb = profile.layers[profile.split_index - 1].output_bytes / 1e6
    if name == "sequential":
        threads = setup.get("threads", 1)
        return _cost(compute / threads + load, compute / threads + load + weight_traffic_s(seq, hw, 1, threads))
    if name == "threads":
        k = setup.get("threads")
        return _cost(compute / k + load, threads_s(compute, k) + load + weight_traffic_s(seq, hw, 1 + (k - 1) * REPLICA_SHARE, k))
    if name == "cpu_mp":
        p = setup.get("processes")
        barrier = hw.intra_node.latency_us * 1e-6
        total = cpu_mp_s(compute + load, p, g, hw.memory_bandwidth_gb_s * 1e3, barrier) + weight_traffic_s(seq, hw, p, p)
        return _cost((compute + load) / p, total)
    if name in ("ddp_gloo", "ddp_nccl", "mpi"):
        w = setup.get("processes") or setup.get("ranks")
        local = min(w, hw.devices_per_node) if shared_bus else 1  # replicas on one node's memory
        total = data_parallel_s(compute + load, w, g, bucket, _ring(hw, w), fixed, overlap=not shared_bus) + weight_traffic_s(seq, hw, local, local)
        return _cost((compute + load) / w, total)
    if name == "split":
        link = _link(hw.link(0, 1)) if hw.devices_per_node > 1 else _link(hw.intra_node)
        return _cost(compute + load, split_s(seq.batch_s(b), b, cut_mb, link))
    if name == "pipe":
        w, m = len(setup.get("devices")), setup.get("chunks")
        return _cost(gpipe_compute_s(m * max(1, b // m) * seq.per_sample_s, w, m) + load, _pipe_batch_s(setup, hw, profile, seq, b) + load)
    if name == "hybrid":
        p = setup.get("processes")
        local = split_s(seq.batch_s(b // p), b // p, cut_mb, _link(hw.link(0, 1)))
        ring = [_link(hw.link(2 * i, 2 * ((i + 1) % p))) for i in range(p)]
        return _cost((compute + load) / p, hybrid_s(local, p, g, bucket, ring, fixed))
    raise ValueError(f"no performance model for strategy {name!r}")


def training_processes(setup: Setup) -> int:
    """The training processes of ``setup`` (each with its own data loader)."""
    return setup.get("processes") or setup.get("ranks") or 1


def worker_batch(setup: Setup, job: Job) -> int:
    """The samples one worker allocates activations for in a step: the global batch, split over
    data-parallel processes or threads, or a pipeline's micro-batch."""
    if setup.strategy == "threads":
        return job.batch_size // setup.get("threads")
    if setup.strategy == "pipe":
        return max(1, job.batch_size // setup.get("chunks"))
    return job.batch_size // training_processes(setup)


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


def _cost(compute_s: float, total_s: float) -> Cost:
    compute = min(total_s, compute_s)
    return Cost(compute, total_s - compute)


def pipe_balance(setup: Setup, profile: ModelProfile) -> list[int]:
    stages = len(setup.get("devices"))
    if stages == 2:
        return [profile.split_index, len(profile.layers) - profile.split_index]
    return profile.even_balance(stages)


def _pipe_batch_s(setup: Setup, hw: HardwareSpec, profile: ModelProfile, seq: SequentialTime, b: int) -> float:
    """Eq. 6.1 + Eq. 6.2, plus the weight traffic: every micro-batch reads its stage's weights
    again; on GPUs each stage has its own memory, on CPU stages share the bus."""
    devices = setup.get("devices")
    w, m = len(devices), setup.get("chunks")
    micro = max(1, b // m)
    traffic = 1 + (m - 1) * REPLICA_SHARE
    weights = weight_traffic_s(seq, hw, traffic, w) if hw.device_kind == "cpu" else seq.weight_s * traffic / w
    checkpoint = setup.get("checkpoint", "never")
    recomputing = {"never": 0, "except_last": w - 1, "always": w}.get(checkpoint, 0) / w
    per_sample = seq.per_sample_s * (1 + recomputing * FORWARD_SHARE)  # the forward again in backward
    compute = gpipe_compute_s(m * micro * per_sample, w, m) + weights
    balance = pipe_balance(setup, profile)
    boundaries = [x / 1e6 for x in profile.boundary_bytes(balance)]
    if all(d == "cpu" for d in devices):  # CPU stages: one memory, no link to cross
        links = [Link(hw.intra_node.latency_us * 1e-6, hw.memory_bandwidth_gb_s * 1e3)] * (w - 1)
    else:
        links = [_link(hw.link(_gpu_index(devices[j]), _gpu_index(devices[j + 1]))) for j in range(w - 1)]
    return compute + gpipe_comm_s(micro, m, boundaries, links)


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


def _state_bytes(params: int) -> int:
    return 3 * params * FLOAT_BYTES  # weights, gradients, momentum


def replica_bytes(job: Job, batch: int) -> int:
    """A whole replica (the estimate train.py checks before training)."""
    estimate, _ = estimate_training_memory(job.model, job.num_classes, job.channels, job.image_size, batch)
    return estimate.total_bytes


def memory_need(setup: Setup, job: Job, hw: HardwareSpec, profile: ModelProfile) -> MemoryNeed:
    """Bytes per device (per node's RAM for CPU setups, where every process shares it)."""
    b, name = job.batch_size, setup.strategy
    if name in ("sequential", "threads"):
        per = replica_bytes(job, b)
        replicas = 1
    elif name in ("cpu_mp", "ddp_gloo", "ddp_nccl", "mpi"):
        w = setup.get("processes") or setup.get("ranks")
        bucket_copy = profile.params * FLOAT_BYTES if name != "cpu_mp" else 0  # DDP's gradient buckets
        per = replica_bytes(job, b // w) + bucket_copy
        replicas = min(w, hw.devices_per_node) if hw.device_kind == "cpu" else 1
    elif name in ("split", "pipe", "hybrid"):
        groups = setup.get("processes", 1) if name == "hybrid" else 1
        balance = pipe_balance(setup, profile) if name == "pipe" else [profile.split_index, len(profile.layers) - profile.split_index]
        per_batch = b // groups
        m = setup.get("chunks", 1)
        micro = max(1, per_batch // m)
        checkpoint = setup.get("checkpoint", "never")
        parts = profile.partitions(balance)
        inputs = [profile.input_bytes] + profile.boundary_bytes(balance)
        stage_bytes = []
        for i, part in enumerate(parts):
            acts = sum(layer.activation_bytes for layer in part) + (profile.input_bytes if i == 0 else 0)
            recomputes = checkpoint == "always" or (checkpoint == "except_last" and i < len(parts) - 1)
            # A checkpointed stage keeps only each micro-batch's input, and one micro-batch's
            # activations while it recomputes them in backward.
            kept = per_batch * inputs[i] + micro * acts if recomputes else per_batch * acts
            stage_bytes.append(_state_bytes(sum(layer.params for layer in part)) + kept)
        if hw.device_kind == "cpu":  # every stage in the same RAM
            per, replicas = sum(stage_bytes), 1
        else:
            per, replicas = max(stage_bytes), 1
    else:
        raise ValueError(f"no memory model for strategy {name!r}")
    if hw.device_kind == "cpu":
        need = per * replicas / GB
        return MemoryNeed(need, MEMORY_HEADROOM * hw.ram_per_node_gb, f"{hw.ram_per_node_gb:.0f} GB RAM per node")
    return MemoryNeed(per / GB, MEMORY_HEADROOM * hw.memory_per_device_gb, f"{hw.memory_per_device_gb:.0f} GB per device")
