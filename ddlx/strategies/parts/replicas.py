"""Replicas as parts: the degrees of a data-parallel job, checked once (:class:`ParallelDims`), its
time and memory models, and what each replica runs (``strategy.local``). strategy=ddp_* and
strategy=mpi average gradients over replicas of the whole model; strategy=mpi and strategy=hybrid
compose a replica from the local strategy's parts (:mod:`.halves`, :mod:`.pipelines`)."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from ...errors import ConfigError
from ...job import worker_batch
from ...costmodel.costs import (DEFAULT_BUCKET_MB, computing_at_once, cost, memory_need, recompute_factor, recomputes,
                               replica_bytes, ring, weight_traffic_s)
from ...costmodel.perf_models import data_parallel_s, exposed_allreduce_s
from .halves import cut_point
from .pipelines import TORCH_PIPELINE_CHANNELS_LAST, pipe_knobs, pipeline_batch_problem, smallest_micro_batch
from ..spec import Setup


def thread_share(threads: int, batch: int) -> int:
    """The smallest share of ``batch`` among ``threads`` threads (``Tensor.tensor_split``: the first ones larger)."""
    return batch // min(threads, batch)


# The knobs of a composite's config (hybrid, mpi) that each ``local`` strategy reads.
LOCAL_KNOBS = {"sequential": (), "threads": ("threads",), "split": ("devices", "cut_point"),
               "pipe": ("devices", "chunks", "balance", "checkpoint", "engine", "schedule", "pin_cores")}


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a job whose replicas average their gradients, each replica on ``width``
    ranks (the stages of one of PyTorch's pipelines) or on one (torchtitan's ``ParallelDims``):
    checked once, then read by the plan and by the time and memory models alike. ``per_node``:
    the ranks of one node (a replica's ranks share a node); None: all on one."""

    world: int  # ranks (processes) of the job
    width: int = 1  # ranks per replica
    per_node: int | None = None

    def check(self, strategy: str, fix: str) -> ParallelDims:
        """These degrees, or a :class:`ConfigError` naming what does not divide and ``fix``."""
        node = self.node_ranks
        if self.world < self.width or self.world % self.width or node % self.width:
            raise ConfigError(f"strategy={strategy} runs each replica on {self.width} ranks of one node, but the job has "
                              f"{self.world} rank(s), {node} on this node; {fix}")
        return self

    @property
    def node_ranks(self) -> int:
        return self.world if self.per_node is None else self.per_node

    @property
    def replicas(self) -> int:
        return self.world // self.width

    @property
    def replicas_per_node(self) -> int:
        return max(1, self.node_ranks // self.width)


def ranks_on_a_node(processes: int, hw) -> int:
    """The ranks of a data-parallel job of ``processes`` on one node of ``hw``: a node's devices
    each where the job spans nodes, all of them where it has one node (on CPU, more processes
    than cores share them)."""
    n = hw.devices_per_node
    return n if processes > n and hw.nodes > 1 else processes


class ReplicasOfALocalStrategy:
    """A spec whose replicas each run a ``local`` strategy's parts (hybrid, mpi): what a replica
    cuts a batch into, the batches it takes, the knobs it reads, the memory formats it keeps."""

    name: str

    def smallest_piece(self, cfg, batch: int) -> int:
        if cfg.local == "pipe":
            return smallest_micro_batch(cfg, batch)
        if cfg.local == "threads":
            return thread_share(cfg.threads, batch)
        return batch  # sequential, split: the layers apart, not the samples

    def batch_problem(self, cfg, batch: int, batch_size: int, replicas: int, per_worker: bool = False) -> str | None:
        return pipeline_batch_problem(cfg, batch, batch_size, replicas, 2, per_worker) if cfg.local == "pipe" else None

    def knob_problems(self, cfg) -> list[str]:
        """The knobs of ``cfg`` set away from their default that its ``local`` strategy does not
        read: a run would be labelled with a setting it never used."""
        others = {k for knobs in LOCAL_KNOBS.values() for k in knobs} - set(LOCAL_KNOBS[cfg.local])
        defaults = {f.name: f.default for f in fields(cfg) if f.default is not MISSING}
        users = {k: [local for local, knobs in LOCAL_KNOBS.items() if k in knobs] for k in others}
        return [f"strategy.{k}={getattr(cfg, k)} is a knob of strategy.local={'|'.join(users[k])}, which strategy="
                f"{self.name} with local={cfg.local} does not use; leave it out, or use strategy.local={users[k][0]}"
                for k in sorted(others) if hasattr(cfg, k) and k in defaults and getattr(cfg, k) != defaults[k]]

    def channels_last_problem(self, cfg) -> str | None:
        return TORCH_PIPELINE_CHANNELS_LAST if cfg.local == "pipe" and cfg.engine == "torch" else None


class RanksOverNodes:
    """A spec whose ``processes`` are its ranks, which srun starts where they span nodes (ddp_*,
    fsdp): its launcher line, and which counts have a place on a machine."""

    def launcher(self, setup: Setup, hw) -> str:
        """srun's tasks are the ranks when they span nodes ('': on one node ddlx starts a node's ranks itself)."""
        per_node = ranks_on_a_node(setup.processes, hw)
        return f"srun --nodes={setup.processes // per_node} --ntasks-per-node={per_node}" if per_node < setup.processes else ""

    def places(self, setup: Setup, hw) -> bool:
        """On one node (a GPU each; CPU processes beyond the cores share them), or a node's devices
        on each of a whole number of its nodes."""
        p, n = setup.processes, hw.devices_per_node
        if p <= n:
            return True
        if hw.nodes == 1:
            return hw.device_kind == "cpu"
        return p % n == 0 and p <= hw.total_devices


def data_parallel_cost(setup: Setup, workers: int, job, hw, profile, seq):
    """Eq. 5.1 (ring allreduce over the slowest link, the bucket as ``th``) plus a fixed cost per
    allreduce; only the last bucket is exposed on GPUs, every bucket on CPU (gloo and the
    backward pass share the cores), where the replicas of a node also share its memory bus."""
    shared_bus = hw.device_kind == "cpu"
    work = job.batch_size * (seq.per_sample_at(job.batch_size / workers) * recompute_factor(setup) + seq.load_per_sample_s)
    local = min(workers, hw.devices_per_node) if shared_bus else 1
    bucket = float(getattr(setup, "bucket_cap_mb", DEFAULT_BUCKET_MB))
    compute = work / computing_at_once(hw, workers)
    layers = None if shared_bus else seq.layers_s_at(job.batch_size / workers, profile)
    if layers:  # the buckets go as the backward pass reaches them
        comm = exposed_allreduce_s([b for _, b in layers], profile.layer_mb, workers, bucket, ring(hw, workers),
                                   hw.allreduce_fixed_us * 1e-6)
    else:
        comm = data_parallel_s(0.0, workers, profile.gradient_mb, bucket, ring(hw, workers), hw.allreduce_fixed_us * 1e-6,
                               overlap=not shared_bus)
    return cost(compute, compute + comm + weight_traffic_s(seq, hw, local, local))


def data_parallel_memory(setup: Setup, workers: int, job, hw, profile):
    """A replica on each worker's share of the batch, plus DDP's gradient buckets (a copy of the gradients)."""
    per = (replica_bytes(job, job.batch_size // workers, recompute=recomputes(setup))
           + profile.params * profile.param_bytes)
    return memory_need(hw, per, min(workers, hw.devices_per_node))


def local_parallelizer(cfg, model, data, processes: int, name: str, devices_of):
    """The network strategy each rank of a data-parallel job runs (``strategy.local``): its
    parallelizer (None: the plain network) and tags."""
    local = cfg.local
    if local == "sequential":
        return None, {"local": local}
    if local == "threads":
        from ...parallel.sub_batch_threads import threads_parallelizer

        # Inside DDP, whose reducer expects each gradient once per step.
        return threads_parallelizer(cfg.threads, accumulate_once=True), {"local": local, "threads": str(cfg.threads)}
    if local == "split":
        from ...parallel.two_device_split import split_parallelizer

        cut = cut_point(cfg, model, name)
        return split_parallelizer(devices_of, cut), {"local": local, "cut_point": cut}
    from ...parallel.fairscale_pipe import pipe_parallelizer

    chunks, balance, checkpoint, sample = pipe_knobs(cfg, model, data, worker_batch(data, processes), 2, processes)
    return pipe_parallelizer(devices_of, chunks, balance, checkpoint, sample), {"local": local, "chunks": str(chunks),
                                                                                "balance": str(balance)}


def device_pairs(cfg, processes: int, name: str) -> list:
    """Two devices per process: ``auto`` gives GPUs 2i, 2i+1 when there are enough, else [cpu, cpu]."""
    from ...parallel.devices import resolve_devices

    flat = resolve_devices(cfg.devices, 2 * processes, name)
    return [flat[2 * i : 2 * i + 2] for i in range(processes)]
