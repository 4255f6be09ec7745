"""Turn a strategy config (an option of the ``strategy`` group, :mod:`ddlx.config`) into ``pl.Trainer`` arguments.

Each knob's type and range are the strategy's schema's (:mod:`ddlx.config`), checked when the
config is composed; what depends on the model, the data or the machine (cut points, micro-batch
counts, devices present) is checked here, before any data is written or process started: a bad
value is a :class:`ConfigError` that names it, says what was expected and gives the override
that works.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ..errors import ConfigError
from ..models import LayeredModel
from .devices import gpu_count, resolve_devices

log = logging.getLogger(__name__)


@dataclass
class StrategyPlan:
    """What the Trainer needs to run a strategy, and what the run is tagged with."""

    trainer_kwargs: dict[str, Any]
    tags: dict[str, str] = field(default_factory=dict)
    data_parallel: int = 1  # processes sharing the global batch (data.batch_size)
    replicas_per_machine: int = 1  # model copies in this machine's memory, for the memory check


Factory = Callable[[Mapping[str, Any], str, LayeredModel, Mapping[str, Any]], StrategyPlan]


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _require_cpu(name: str, accelerator: str) -> None:
    if accelerator not in ("cpu", "auto"):
        raise ConfigError(f"strategy={name} runs on CPU, but trainer.accelerator={accelerator}; use trainer.accelerator=cpu")


def _warn_oversubscription(name: str, workers: int, what: str) -> None:
    if workers > _cores():
        log.warning(
            "strategy=%s asks for %d %s but only %d cores are available: they will oversubscribe and run slower",
            name, workers, what, _cores(),
        )


def _comm_hook(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """DDP communication hook (source 002, section 4: gradient compression)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hook = cfg.comm_hook
    if hook == "fp16":
        return {"ddp_comm_hook": default_hooks.fp16_compress_hook}
    if hook == "bf16":
        return {"ddp_comm_hook": default_hooks.bf16_compress_hook}
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        return {"ddp_comm_state": state, "ddp_comm_hook": powerSGD_hook.powerSGD_hook}
    return {}


def _sequential(cfg: Mapping[str, Any], accelerator: str, model: LayeredModel, data: Mapping[str, Any]) -> StrategyPlan:
    threads = cfg.threads
    _warn_oversubscription("sequential", threads, "threads")
    # Intra-op threads: 1 is the paper's one-core baseline.
    torch.set_num_threads(threads)
    return StrategyPlan(trainer_kwargs={"strategy": "auto", "devices": 1}, tags={"threads": str(threads)})


def _threads(cfg: Mapping[str, Any], accelerator: str, model: LayeredModel, data: Mapping[str, Any]) -> StrategyPlan:
    from .network import NetworkStrategy
    from .threads import threads_parallelizer

    _require_cpu("threads", accelerator)
    threads = cfg.threads
    _warn_oversubscription("threads", threads, "threads")
    strategy = NetworkStrategy(torch.device("cpu"), threads_parallelizer(threads))
    return StrategyPlan(
        trainer_kwargs={"strategy": strategy, "devices": 1, "accelerator": "cpu"}, tags={"threads": str(threads)}
    )


def _cpu_mp(cfg: Mapping[str, Any], accelerator: str, model: LayeredModel, data: Mapping[str, Any]) -> StrategyPlan:
    from .cpu_mp import CpuMultiProcessStrategy

    _require_cpu("cpu_mp", accelerator)
    processes = cfg.processes
    _warn_oversubscription("cpu_mp", processes, "processes")
    strategy = CpuMultiProcessStrategy(processes, pin_cores=bool(cfg.get("pin_cores", True)), timeout_s=cfg.timeout_s)
    return StrategyPlan(
        trainer_kwargs={"strategy": strategy, "devices": processes, "accelerator": "cpu"},
        tags={"processes": str(processes)},
        data_parallel=processes,
        replicas_per_machine=processes,
    )


def _ddp(backend: str) -> Factory:
    def build(cfg: Mapping[str, Any], accelerator: str, model: LayeredModel, data: Mapping[str, Any]) -> StrategyPlan:
        from .launch import RelaunchingDDPStrategy

        name = f"ddp_{backend}"
        processes = cfg.processes
        if backend == "nccl":
            gpus = gpu_count()
            if gpus < processes:
                raise ConfigError(
                    f"strategy=ddp_nccl asks for {processes} CUDA GPU(s) (NCCL runs only on GPUs), but this machine has "
                    f"{gpus}; use strategy=ddp_gloo (CPU) or strategy.processes={gpus}" if gpus else
                    f"strategy=ddp_nccl needs CUDA GPUs (NCCL runs only on GPUs), but this machine has none "
                    f"(devices: cpu); use strategy=ddp_gloo strategy.processes={processes}"
                )
            device_accelerator = "gpu"
        else:
            device_accelerator = "cpu" if accelerator in ("cpu", "auto") else accelerator
            if device_accelerator == "cpu":
                _warn_oversubscription(name, processes, "processes")
        bucket = cfg.bucket_cap_mb
        strategy = RelaunchingDDPStrategy(
            process_group_backend=backend,
            bucket_cap_mb=bucket,
            timeout=timedelta(seconds=cfg.timeout_s),
            **_comm_hook(cfg),
        )
        return StrategyPlan(
            trainer_kwargs={"strategy": strategy, "devices": processes, "accelerator": device_accelerator},
            tags={"processes": str(processes), "backend": backend, "bucket_cap_mb": f"{bucket:g}", "comm_hook": cfg.comm_hook},
            data_parallel=processes,
            replicas_per_machine=processes,
        )

    return build


def _cut_point(cfg: Mapping[str, Any], model: LayeredModel, name: str) -> str:
    cut = cfg.get("cut_point") or model.split_point
    if cut not in model.cut_points:
        raise ConfigError(
            f"strategy.cut_point={cut!r} for strategy={name} is not a cut point of {model.arch}; "
            f"expected one of {', '.join(model.cut_points)} (default: the paper's {model.split_point})"
        )
    return cut


def _pipe_knobs(cfg: Mapping[str, Any], model: LayeredModel, data: Mapping[str, Any], per_process_batch: int, stages: int, name: str):
    """Validated (chunks, balance, checkpoint, micro-batch sample shape) of a pipelined network."""
    chunks = cfg.chunks
    if chunks > per_process_batch:
        raise ConfigError(
            f"strategy.chunks={chunks} is larger than the batch of {per_process_batch} each pipeline gets "
            f"(data.batch_size={data['batch_size']}): every micro-batch needs a sample; use strategy.chunks<={per_process_batch}"
        )
    checkpoint = cfg.checkpoint
    balance = cfg.get("balance")
    layers = len(model)
    if balance is None:
        # Two stages cut at the model's own split point; more stages are balanced by profiling.
        balance = [model.split_index, layers - model.split_index] if stages == 2 else "auto"
    elif balance != "auto":
        balance = list(balance)
        if len(balance) != stages or any(not isinstance(b, int) or b < 1 for b in balance) or sum(balance) != layers:
            raise ConfigError(
                f"strategy.balance={balance} must give {stages} positive layer counts (one per device) summing to "
                f"{model.arch}'s {layers} layers, e.g. strategy.balance=[{model.split_index},{layers - model.split_index}], "
                f"or strategy.balance=auto to balance by profiled layer time"
            )
    sample = (max(1, per_process_batch // chunks), data["channels"], data["image_size"], data["image_size"])
    return chunks, balance, checkpoint, sample


def _stage_count(cfg: Mapping[str, Any]) -> int:
    devices = cfg.get("devices")
    return 2 if devices in (None, "auto") or isinstance(devices, str) else len(devices)


def _split(cfg: Mapping[str, Any], accelerator: str, model: LayeredModel, data: Mapping[str, Any]) -> StrategyPlan:
    from .network import NetworkStrategy
    from .split import split_parallelizer

    devices = resolve_devices(cfg.get("devices"), 2, "split")
    cut = _cut_point(cfg, model, "split")
    strategy = NetworkStrategy(devices[0], split_parallelizer(lambda rank: devices, cut))
    return StrategyPlan(
        trainer_kwargs={"strategy": strategy, "devices": 1, "accelerator": _accelerator_of(devices[0])},
        tags={"devices": ",".join(map(str, devices)), "cut_point": cut},
    )


def _pipe(cfg: Mapping[str, Any], accelerator: str, model: LayeredModel, data: Mapping[str, Any]) -> StrategyPlan:
    from .network import NetworkStrategy
    from .pipe import pipe_parallelizer

    devices = resolve_devices(cfg.get("devices"), _stage_count(cfg), "pipe")
    chunks, balance, checkpoint, sample = _pipe_knobs(cfg, model, data, data["batch_size"], len(devices), "pipe")
    strategy = NetworkStrategy(devices[0], pipe_parallelizer(lambda rank: devices, chunks, balance, checkpoint, sample))
    return StrategyPlan(
        trainer_kwargs={"strategy": strategy, "devices": 1, "accelerator": _accelerator_of(devices[0])},
        tags={"devices": ",".join(map(str, devices)), "chunks": str(chunks), "balance": str(balance), "checkpoint": checkpoint},
    )


def _local_parallelizer(cfg: Mapping[str, Any], model: LayeredModel, data: Mapping[str, Any], processes: int, name: str, devices_of):
    """The network strategy each rank of a hybrid or MPI job runs: (parallelizer or None, tags)."""
    local = cfg.get("local", "split")
    if local == "sequential":
        return None, {"local": local}
    if local == "threads":
        from .threads import threads_parallelizer

        threads = cfg.threads
        return threads_parallelizer(threads), {"local": local, "threads": str(threads)}
    if local == "split":
        from .split import split_parallelizer

        cut = _cut_point(cfg, model, name)
        return split_parallelizer(devices_of, cut), {"local": local, "cut_point": cut}
    if local == "pipe":
        from .pipe import pipe_parallelizer

        chunks, balance, checkpoint, sample = _pipe_knobs(cfg, model, data, data["batch_size"] // processes, 2, name)
        return pipe_parallelizer(devices_of, chunks, balance, checkpoint, sample), {"local": local, "chunks": str(chunks), "balance": str(balance)}
    raise AssertionError(f"strategy.local={local!r}: the schema's choices and this function disagree")


def _device_pairs(cfg: Mapping[str, Any], processes: int, name: str) -> list[list[torch.device]]:
    """Two devices per process: ``auto`` gives GPUs 2i, 2i+1 when there are enough, else [cpu, cpu]."""
    spec = cfg.get("devices")
    flat = resolve_devices(spec, 2 * processes, name)
    return [flat[2 * i : 2 * i + 2] for i in range(processes)]


def _hybrid(cfg: Mapping[str, Any], accelerator: str, model: LayeredModel, data: Mapping[str, Any]) -> StrategyPlan:
    from .network import DataParallelNetworkStrategy

    processes = cfg.processes
    pairs = _device_pairs(cfg, processes, "hybrid")
    on_cpu = pairs[0][0].type == "cpu"
    if on_cpu:
        _warn_oversubscription("hybrid", processes, "processes")
    parallelize, local_tags = _local_parallelizer(cfg, model, data, processes, "hybrid", lambda rank: pairs[rank])
    strategy = DataParallelNetworkStrategy(
        parallelize, [pair[0] for pair in pairs], process_group_backend="gloo" if on_cpu else "nccl", timeout=timedelta(seconds=cfg.timeout_s)
    )
    return StrategyPlan(
        trainer_kwargs={"strategy": strategy, "devices": processes, "accelerator": "cpu" if on_cpu else "gpu"},
        tags={"processes": str(processes), "devices": ";".join(",".join(map(str, p)) for p in pairs), **local_tags},
        data_parallel=processes,
        replicas_per_machine=processes,
    )


def _mpi(cfg: Mapping[str, Any], accelerator: str, model: LayeredModel, data: Mapping[str, Any]) -> StrategyPlan:
    from .mpi import mpi_layout, set_rank_threads
    from .network import DataParallelNetworkStrategy

    world, local_size, nodes = mpi_layout()
    set_rank_threads(local_size)
    local = cfg.get("local", "sequential")
    gpus = gpu_count()
    if local in ("split", "pipe"):
        pairs = _device_pairs(cfg, local_size, "mpi")
        roots = [pair[0] for pair in pairs]
        devices_of = lambda rank: pairs[rank]  # noqa: E731
    else:
        roots = [torch.device(f"cuda:{i}") for i in range(local_size)] if accelerator == "gpu" and gpus >= local_size else [torch.device("cpu")] * local_size
        devices_of = None
    parallelize, local_tags = _local_parallelizer(cfg, model, data, world, "mpi", devices_of)
    on_cpu = roots[0].type == "cpu"
    from lightning_fabric.plugins.environments import MPIEnvironment

    backend = cfg.get("backend") or ("gloo" if on_cpu else "nccl")
    strategy = DataParallelNetworkStrategy(
        parallelize, roots, cluster_environment=MPIEnvironment(), process_group_backend=backend, timeout=timedelta(seconds=cfg.timeout_s)
    )
    return StrategyPlan(
        trainer_kwargs={"strategy": strategy, "devices": local_size, "num_nodes": nodes, "accelerator": "cpu" if on_cpu else "gpu"},
        tags={"ranks": str(world), "nodes": str(nodes), "backend": backend, **local_tags},
        data_parallel=world,
        replicas_per_machine=local_size,
    )


def _accelerator_of(device: torch.device) -> str:
    return "gpu" if device.type == "cuda" else "cpu"


_FACTORIES: dict[str, Factory] = {
    "sequential": _sequential,
    "threads": _threads,
    "cpu_mp": _cpu_mp,
    "ddp_gloo": _ddp("gloo"),
    "ddp_nccl": _ddp("nccl"),
    "split": _split,
    "pipe": _pipe,
    "hybrid": _hybrid,
    "mpi": _mpi,
}


def available_strategies() -> list[str]:
    return sorted(_FACTORIES)


def build_strategy(cfg: Mapping[str, Any], accelerator: str, model: LayeredModel, data: Mapping[str, Any]) -> StrategyPlan:
    """``model`` (on the meta device is enough) gives layer counts and cut points; ``data`` the batch shape."""
    name = cfg.get("name")
    if name not in _FACTORIES:
        raise ConfigError(f"strategy.name={name!r} is not known; expected one of {', '.join(available_strategies())}")
    plan = _FACTORIES[name](cfg, accelerator, model, data)
    plan.tags = {"strategy": name, **plan.tags}
    return plan
