"""Pipelines as parts: what strategy=pipe runs once and strategy=mpi and strategy=hybrid run once per
replica (``local=pipe``), so that no strategy's file borrows from another's. PyTorch's
``torch.distributed.pipelining`` runs one process per stage under a schedule; fairscale's ``Pipe``
runs GPipe in one process (Jansen's thesis, chapter 6). Checks, knobs, time and memory models here
are the same for every strategy that runs a pipeline."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from omegaconf import ListConfig

from ...compiling import EACH_LAYER
from ...errors import ConfigError
from ...job import worker_batch
from ...costmodel.costs import (
    DEFAULT_BUCKET_MB,
    RECOMPUTE,
    REPLICA_SHARE,
    cost,
    gpu_index,
    link,
    memory_need,
    rank_device,
    recompute_factor,
    recomputes,
    weight_traffic_s,
)
from ...parallel.cuts import contiguous_balance
from ...parallel.schedules import SCHEDULES, bubble_steps, in_flight, micro_batches, stage_owners, stages_of
from ...costmodel.perf_models import Link, gpipe_comm_s, pipeline_schedule_s, ring_allreduce_s
from ...knobs import SetupRole
from ..spec import Setup, refuse_compile

PIPE_CHECKPOINT = ("never", "except_last", "always")
ENGINES = ("fairscale", "torch")
# A data-parallel strategy's pipeline knobs name its setup only for PyTorch's pipelines (a
# fairscale pipeline's are calibrated as one): local=pipe engine=torch.
TORCH_PIPELINES = (("local", "pipe"), ("engine", "torch"))
PIPELINE_KNOB = SetupRole(when=TORCH_PIPELINES)
PIPELINE_KNOB_UNLESS_DEFAULT = SetupRole(unless_default=True, when=TORCH_PIPELINES)
CHUNKS = (2, 4, 8, 16)  # the micro-batch counts a user would try


def pipe_knobs(cfg, model, data, per_process_batch: int, stages: int, replicas: int = 1):
    """Checked (chunks, balance, checkpoint, micro-batch sample shape) of a pipelined network, one
    of ``replicas``."""
    chunks = cfg.chunks
    if problem := pipeline_batch_problem(cfg, per_process_batch, data.batch_size, replicas, stages, data.batch_per == "worker"):
        raise ConfigError(problem)
    balance = checked_balance(cfg.balance, model, stages, "one per device")
    sample = (max(1, per_process_batch // chunks), data.channels, data.image_size, data.image_size)
    return chunks, balance, cfg.checkpoint, sample


def smallest_micro_batch(cfg, batch: int) -> int:
    """The smallest of the micro-batches ``batch`` is cut into by ``cfg.chunks``: equal ones in
    PyTorch's schedules (:func:`micro_batches`), ``Tensor.chunk``'s in fairscale's Pipe (the last
    one smaller)."""
    if cfg.engine == "torch":
        return batch // micro_batches(batch, cfg.chunks)
    size = -(-batch // min(cfg.chunks, batch))
    return batch - size * (-(-batch // size) - 1)


TORCH_PIPELINE_CHANNELS_LAST = ("PyTorch's pipeline schedules fail to pass channels_last tensors between stages "
                                "(torch.distributed: 'input tensor has to be contiguous', at the first step); use "
                                "model.memory_format=contiguous, or strategy.engine=fairscale")


def pipeline_batch_problem(cfg, batch: int, batch_size: int, replicas: int, width: int, per_worker: bool = False) -> str | None:
    """Why each of ``replicas`` pipelines of ``cfg`` (of ``width`` processes under PyTorch's
    schedules) cannot take a batch of ``batch`` (of the user's ``data.batch_size``:
    :func:`pipelines_share`), with the fix; None where it can: a sample for every micro-batch and,
    under PyTorch's schedules, equal micro-batches, at least one per stage where the schedule needs it."""
    chunks, share = cfg.chunks, pipelines_share(batch_size, batch, replicas, per_worker)
    if chunks > batch:
        return (f"strategy.chunks={chunks} is larger than the batch of {batch} each pipeline gets ({share}): every "
                f"micro-batch needs a sample; use strategy.chunks<={batch}")
    if cfg.engine != "torch":
        return None
    least = width if SCHEDULES[cfg.schedule].micro_at_least_ranks else 1
    if chunks < least:
        return (f"strategy.schedule={cfg.schedule} needs at least one micro-batch per stage: strategy.chunks={chunks} < "
                f"{least} stages; use strategy.chunks>={least} that divides the batch of {batch} ({share}), "
                f"{_chunks_taken(batch, chunks, least)}")
    if batch % chunks:
        return (f"strategy.chunks={chunks} does not divide {share}: PyTorch's schedules need equal micro-batches; use a "
                f"divisor of {batch}" + (f" of at least {least}" if least > 1 else "") + f", {_chunks_taken(batch, chunks, least)}")
    return None


def _chunks_taken(batch: int, chunks: int, least: int) -> str:
    """The fix for a batch of ``batch`` under PyTorch's schedules: the divisor of it nearest
    ``chunks``, of at least ``least``."""
    fits = [c for c in range(least, batch + 1) if batch % c == 0]
    return f"e.g. strategy.chunks={min(fits, key=lambda c: (abs(c - chunks), c))}" if fits else \
        f"or a data.batch_size of at least {least} a pipeline"


def pipelines_share(batch_size: int, batch: int, replicas: int, per_worker: bool = False) -> str:
    """Each of ``replicas`` pipelines' ``batch`` as the user's ``data.batch_size`` gives it: theirs,
    with ``per_worker`` (``data.batch_per=worker``), else a share of the global ``batch_size``."""
    if per_worker:
        return f"data.batch_size={batch} per pipeline (data.batch_per=worker)"
    return f"data.batch_size={batch_size}" + (f" over {replicas} pipelines ({batch} each)" if replicas > 1 else "")


def torch_pipeline(cfg, devices, model, data, name: str, replicas: int = 1, width: int | None = None, **strategy_kwargs):
    """The checked :class:`TorchPipelineStrategy` (and its tags) of ``replicas`` pipelines, each
    over ``width`` processes (default: ``len(devices) // replicas``; one per device of ``devices``, this node's)."""
    from ...parallel.torch_pipe import TorchPipelineStrategy

    kinds = {d.type for d in devices}
    if len(kinds) > 1 or ("cuda" in kinds and len(set(devices)) < len(devices)):
        raise ConfigError(f"strategy.devices={[str(d) for d in devices]} with strategy.engine=torch: one process per "
                          f"device, all CPU or all distinct GPUs; use e.g. strategy.devices=[cpu,cpu] or [cuda:0,cuda:1]")
    if cfg.checkpoint not in RECOMPUTE:
        raise ConfigError(f"strategy.checkpoint={cfg.checkpoint} is fairscale's choice of micro-batches to recompute; "
                          f"strategy.engine=torch recomputes every block of every micro-batch or none: use "
                          f"strategy.checkpoint=always or never, or strategy.engine=fairscale")
    schedule, chunks = SCHEDULES[cfg.schedule], cfg.chunks
    width = width or len(devices) // replicas
    batch = worker_batch(data, replicas)
    if problem := pipeline_batch_problem(cfg, batch, data.batch_size, replicas, width, data.batch_per == "worker"):
        raise ConfigError(problem)
    stages = width * schedule.stages_per_rank
    balance = checked_balance(cfg.balance, model, stages,
                              f"{schedule.stages_per_rank} stage(s) per process under schedule={cfg.schedule}")
    if stages > len(model):
        raise ConfigError(f"strategy.schedule={cfg.schedule} on {width} processes needs {stages} stages, more than "
                          f"{model.arch}'s {len(model)} layers; use fewer devices or strategy.schedule=gpipe")
    sample = (max(1, batch // chunks), data.channels, data.image_size, data.image_size)
    strategy = TorchPipelineStrategy(devices, cfg.schedule, chunks, balance, sample, pin_cores=cfg.pin_cores,
                                     timeout_s=cfg.timeout_s, width=width, replicas=replicas, **strategy_kwargs)
    strategy.recompute = recomputes(cfg)
    return strategy, {"chunks": str(chunks), "balance": str(balance), "checkpoint": cfg.checkpoint, "engine": "torch",
                      "schedule": cfg.schedule}


def local_torch_pipeline(cfg) -> bool:
    """Whether a data-parallel strategy's ``local`` is PyTorch's pipeline (local=pipe engine=torch);
    its ``engine`` or ``schedule`` set for another local strategy is refused by name."""
    if cfg.local == "pipe" and cfg.engine == "torch":
        return True
    if cfg.engine == "torch" or cfg.schedule != "gpipe":
        raise ConfigError(f"strategy.engine={cfg.engine} strategy.schedule={cfg.schedule} with strategy.local={cfg.local}: "
                          f"PyTorch's schedules run with strategy.local=pipe strategy.engine=torch; use those, or "
                          f"strategy.engine=fairscale strategy.schedule=gpipe")
    return False


def engine_refused_precisions(knobs) -> dict[str, str]:
    """The precisions a pipeline with ``knobs`` cannot train in (PyTorch's engine: 16-mixed)."""
    if knobs.engine != "torch":
        return {}
    return {"16-mixed": "16-mixed scales the loss before Lightning's backward, but PyTorch's schedule runs the backward "
                        "inside the forward, and each rank sees only its stages' gradients; use "
                        "trainer.precision=bf16-mixed (no loss scaling), or strategy.engine=fairscale for 16-mixed"}


def checked_balance(balance, model, stages: int, per: str) -> list[int] | str:
    """``strategy.balance`` for ``stages`` stages of ``model``: null = two stages at the model's own
    split point, more balanced by profiling (``auto``); a list is checked (``per``: what a count is for)."""
    layers = len(model)
    if balance is None:
        return [model.split_index, layers - model.split_index] if stages == 2 else "auto"
    if balance == "auto":
        return balance
    counts = list(balance) if isinstance(balance, (list, tuple, ListConfig)) else None  # a string or number: none
    if (counts is None or len(counts) != stages
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in counts) or sum(counts) != layers):
        even = [layers // stages + (i < layers % stages) for i in range(stages)]  # as even as the layers allow
        example = f"[{model.split_index},{layers - model.split_index}]" if stages == 2 else f"[{','.join(map(str, even))}]"
        shown = balance if counts is None else f"[{','.join(map(str, counts))}]"  # as it was given
        raise ConfigError(
            f"strategy.balance={shown} must give {stages} positive layer counts ({per}) summing to "
            f"{model.arch}'s {layers} layers, e.g. strategy.balance={example}, or strategy.balance=auto to balance by "
            f"profiled layer time"
        )
    return counts


def default_balance(profile, stages: int, seq=None, micro: int = 1) -> list[int]:
    """The cut a pipeline runs by default, as the models see it: the split point for two stages,
    else the cut ``balance=auto`` finds on the device (:func:`~ddlx.parallel.cuts.contiguous_balance`
    of each layer's forward and backward time), here of the layers' predicted times at ``micro``
    samples where ``seq`` knows them per layer, else of their FLOPs. The time and memory models
    of one setup see the same cut."""
    if stages == 2:
        return [profile.split_index, len(profile.layers) - profile.split_index]
    layers = seq.layers_s_at(micro, profile) if seq is not None else None
    if layers and stages <= len(layers):
        return contiguous_balance([f + b for f, b in layers], stages)
    return profile.even_balance(stages)


@dataclass(frozen=True)
class TorchPipeline:
    """One PyTorch pipeline as the time and memory models read it: a ``pipe engine=torch`` setup, or
    one of a data-parallel job's two-stage pipelines (:func:`one_pipeline`)."""

    devices: tuple[str, ...]
    chunks: int
    schedule: str = "gpipe"
    checkpoint: str = "never"

    @classmethod
    def of(cls, setup: Setup, devices: tuple[str, ...] | None = None) -> TorchPipeline:
        """The pipeline of ``setup``'s knobs, over its ``devices`` or the ones given (a composite's
        setup names none)."""
        return cls(devices or tuple(setup.devices), setup.chunks, setup.schedule, setup.checkpoint)

    def micro_batch(self, batch: int) -> int:
        return max(1, batch // self.chunks)

    def cut(self, profile, seq, batch: int) -> list[int]:
        """Layers per stage (the schedule's stages: several per rank where it interleaves), as
        :func:`default_balance` cuts them at this pipeline's micro-batch of ``batch``: the one cut
        its time, memory and gradient averaging all read."""
        stages = len(self.devices) * SCHEDULES[self.schedule].stages_per_rank
        return default_balance(profile, stages, seq, self.micro_batch(batch))


def chunk_counts(job) -> list[int]:
    return [c for c in CHUNKS if c <= job.batch_size]


def torch_batch_s(pipe: TorchPipeline, hw, profile, seq, b: int) -> tuple[float, float]:
    """(compute, total) of one batch under PyTorch's schedule: #mb steps of the slowest rank
    (its stages' share of the FLOPs) plus the schedule's bubble; each micro-batch reads its
    stage's weights again; activations cross between ranks (loopback between CPU processes,
    the GPUs' link), in lockstep as in Eq. 6.2."""
    devices, m, name = pipe.devices, pipe.chunks, pipe.schedule
    w, micro, balance = len(devices), pipe.micro_batch(b), pipe.cut(profile, seq, b)
    again = recompute_factor(pipe, SCHEDULES[name].backward_passes)
    stages = seq.stage_s(balance, micro)
    if stages is None:  # shares of the FLOPs stand in for the stages' times
        flops = [sum(layer.forward_flops for layer in part) for part in profile.partitions(balance)]
        stages = [f / sum(flops) * micro * seq.per_sample_at(micro) for f in flops]
    per_rank = [sum(stages[i] for i in stages_of(name, r, w)) * again for r in range(w)]
    compute = pipeline_schedule_s(per_rank, m, bubble_steps(name, w, m))
    traffic = 1 + (m - 1) * REPLICA_SHARE
    weights = weight_traffic_s(seq, hw, traffic, w) if hw.device_kind == "cpu" else seq.weight_s * traffic / w
    owner = stage_owners(name, w)

    def between(a: int, b: int) -> Link:
        if a == b:  # two stages of one rank (interleaved, ZB-V): nothing crosses
            return Link(0.0, float("inf"))
        return link(hw.intra_node) if hw.device_kind == "cpu" else link(hw.link(gpu_index(devices[a]), gpu_index(devices[b])))

    links = [between(owner[j], owner[j + 1]) for j in range(len(balance) - 1)]
    comm = gpipe_comm_s(micro, m, [x / 1e6 for x in profile.boundary_bytes(balance)], links)
    return compute, compute + weights + comm


def torch_rank_bytes(pipe: TorchPipeline, batch: int, hw, profile, seq=None) -> list[float]:
    """Per rank: its stages' weights, gradients and optimizer state, and the activations of the
    micro-batches the schedule keeps in flight (recomputing: their blocks' inputs, and one
    block's activations at a time); on CPU each rank's process also holds the other stages'
    weights (the whole model is built in every process). The stages are cut as
    :func:`torch_batch_s` cuts them."""
    devices, m, name = pipe.devices, pipe.chunks, pipe.schedule
    w, micro, balance = len(devices), pipe.micro_batch(batch), pipe.cut(profile, seq, batch)
    parts, bounds = profile.partitions(balance), [0, *itertools.accumulate(balance)]
    recompute = recomputes(pipe)
    ranks = []
    for r in range(w):
        mine = stages_of(name, r, w)
        params = sum(layer.params for i in mine for layer in parts[i])
        if recompute:
            acts = sum(profile.block_inputs_bytes(bounds[i], bounds[i + 1]) for i in mine)
            one = max(profile.largest_block_bytes(bounds[i], bounds[i + 1]) for i in mine)
        else:
            acts, one = sum(profile.kept_bytes(bounds[i], bounds[i + 1]) for i in mine), 0
        held = profile.state_bytes(params) + in_flight(name, r, w, m) * micro * acts + micro * one
        ranks.append(held + ((profile.params - params) * profile.param_bytes if hw.device_kind == "cpu" else 0))
    return ranks


def one_pipeline(setup: Setup, hw) -> TorchPipeline:
    """One of a data-parallel job's two-stage PyTorch pipelines (its first)."""
    devices = ("cpu", "cpu") if hw.device_kind == "cpu" else ("cuda:0", "cuda:1")
    return TorchPipeline.of(setup, devices)


def pipelines_cost(setup, replicas: int, per_node: int, job, hw, profile, seq):
    """``replicas`` two-stage PyTorch pipelines (``per_node`` on each node), each on its share of
    the batch, then each rank's gradient averaged with the same stage's ranks (a ring through
    device 2i+s of each pipeline i), after the schedule: nothing overlaps it. On CPU, processes
    beyond the node's cores time-share them."""
    pipe, b = one_pipeline(setup, hw), job.batch_size // replicas
    compute, total = torch_batch_s(pipe, hw, profile, seq, b)
    if hw.device_kind == "cpu":
        share = max(1.0, 2 * per_node / hw.devices_per_node)
        compute, total = compute * share, total * share
    name = pipe.schedule
    parts = profile.partitions(pipe.cut(profile, seq, b))
    gradients = [sum(layer.params for i in stages_of(name, r, 2) for layer in parts[i]) / profile.params * profile.gradient_mb
                 for r in range(2)]
    fixed = hw.allreduce_fixed_us * 1e-6
    average = max(ring_allreduce_s(replicas, mb, [link(x) for x in hw.ring_links([rank_device(hw, 2 * i + r) for i in range(replicas)])],
                                   fixed * max(1, math.ceil(mb / DEFAULT_BUCKET_MB)))
                  for r, mb in enumerate(gradients))
    load = b * seq.load_per_sample_s
    return cost(compute + load, total + average + load)


def pipelines_memory(setup, replicas: int, per_node: int, job, hw, profile, seq=None):
    """Each rank of a pipeline at its share of the batch; a CPU node holds its ``per_node`` pipelines' ranks."""
    ranks = torch_rank_bytes(one_pipeline(setup, hw), job.batch_size // replicas, hw, profile, seq)
    if hw.device_kind == "cpu":
        return memory_need(hw, sum(ranks), per_node)
    return memory_need(hw, max(ranks))


def pipelines_candidates(setup_of, replicas: int, job, **knobs) -> list[Setup]:
    """Data-parallel two-stage PyTorch pipelines, each schedule at the most micro-batches its
    share of the batch allows (the smallest bubble); ``setup_of``: the strategy's :meth:`setup`."""
    b = job.batch_size // replicas
    out = []
    for schedule in SCHEDULES:
        chunks = [c for c in CHUNKS if c <= b and b % c == 0 and c >= 2]
        if chunks:
            out.append(setup_of(**knobs, local="pipe", chunks=chunks[-1], engine="torch", schedule=schedule))
    return out


def compile_by_layers_or_refuse(strategy: str, knobs) -> str:
    """Pipelines of PyTorch's schedules stage the model by layers: each layer compiled; fairscale's
    ``Pipe`` runs its stages in worker threads of its own, which ddlx does not compile."""
    if knobs.engine == "torch":
        return EACH_LAYER
    refuse_compile(strategy, "fairscale's Pipe runs each stage's layers in worker threads of its own and "
                   "moves the micro-batches between them outside any graph torch.compile could take",
                   "use strategy.engine=torch (PyTorch's pipeline schedules, each layer compiled)")


def engine_group(name: str, setup: Setup) -> str:
    """The calibration group of a strategy that runs pipelines: PyTorch's apart from its other
    setups (another engine, another way of working)."""
    return f"{name} engine=torch" if setup.engine == "torch" else name
