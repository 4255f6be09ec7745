"""Data and model parallelism (Lerat et al. 2022 Table 2, the Lerat et al. entry Figure 1): DDP across
``processes``, each splitting or piping the model over its own pair of devices."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from ..knobs import ALWAYS, knob
from ..costmodel.costs import DEFAULT_BUCKET_MB, cost, cut_mb, link, memory_need
from ..costmodel.perf_models import hybrid_s, split_s
from ..parallel.schedules import SCHEDULES
from .parts.halves import halves_bytes
from .parts.pipelines import (ENGINES, PIPE_CHECKPOINT, PIPELINE_KNOB, PIPELINE_KNOB_UNLESS_DEFAULT, compile_by_layers_or_refuse,
                              engine_group, engine_refused_precisions, local_torch_pipeline, pipelines_candidates, pipelines_cost,
                              pipelines_memory, torch_pipeline)
from .parts.replicas import ParallelDims, ReplicasOfALocalStrategy, device_pairs, local_parallelizer
from .spec import TIMEOUT_S, Setup, StrategyPlan, StrategySpec, accelerator_of, refuse_compile, warn_oversubscription


@dataclass
class HybridConfig:
    """DDP across ``processes``, each splitting (local: split) or piping (local: pipe) the model
    over its own pair of devices (Lerat et al. 2022 Table 2, the Lerat et al. entry Figure 1). local: pipe with
    engine=torch runs one process per device: ``processes`` pipelines of two processes each."""

    name: str = "hybrid"
    processes: int = knob(2, low=1, setup=ALWAYS)
    local: str = knob("split", choices=("split", "pipe"), setup=ALWAYS)
    devices: Any = "auto"
    cut_point: Optional[str] = None
    chunks: int = knob(4, low=1, setup=PIPELINE_KNOB)  # local: pipe
    balance: Any = knob(None, label="when_set")  # local: pipe
    checkpoint: str = knob("never", choices=PIPE_CHECKPOINT, setup=PIPELINE_KNOB_UNLESS_DEFAULT)  # local: pipe
    engine: str = knob("fairscale", choices=ENGINES, setup=PIPELINE_KNOB_UNLESS_DEFAULT)  # local: pipe
    schedule: str = knob("gpipe", choices=tuple(SCHEDULES), setup=PIPELINE_KNOB, quiet=True)  # local: pipe, engine=torch
    pin_cores: bool = True  # local: pipe, engine=torch on CPU
    timeout_s: float = knob(TIMEOUT_S, low=0, low_open=True)


class Hybrid(ReplicasOfALocalStrategy, StrategySpec):
    name, config, order = "hybrid", HybridConfig, 7

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        from ..parallel.network import DataParallelNetworkStrategy

        processes = cfg.processes
        pairs = device_pairs(cfg, processes, self.name)
        on_cpu = pairs[0][0].type == "cpu"
        torch_engine = local_torch_pipeline(cfg)
        # A replica per pair of devices: one process driving both (split, fairscale's Pipe) or one per device.
        dims = ParallelDims(processes * (2 if torch_engine else 1), 2 if torch_engine else 1)
        if on_cpu:
            warn_oversubscription(self.name, dims.world, "processes")
        if torch_engine:
            return self._plan_torch(cfg, pairs, model, data, dims)
        parallelize, local_tags = local_parallelizer(cfg, model, data, dims.replicas, self.name, lambda rank: pairs[rank])
        strategy = DataParallelNetworkStrategy(parallelize, [pair[0] for pair in pairs],
                                               process_group_backend="gloo" if on_cpu else "nccl",
                                               timeout=timedelta(seconds=cfg.timeout_s))
        return StrategyPlan(
            trainer_kwargs={"strategy": strategy, "devices": dims.world, "accelerator": "cpu" if on_cpu else "gpu"},
            tags={"processes": str(processes), "devices": ";".join(",".join(map(str, p)) for p in pairs), **local_tags},
            data_parallel=dims.replicas,
            replicas_per_machine=dims.replicas_per_node,
        )

    def _plan_torch(self, cfg, pairs, model, data, dims: ParallelDims) -> StrategyPlan:
        """``processes`` pipelines of PyTorch's schedule, one process per device of each pair."""
        devices = [d for pair in pairs for d in pair]
        strategy, tags = torch_pipeline(cfg, devices, model, data, self.name, replicas=dims.replicas, width=dims.width)
        return StrategyPlan(
            trainer_kwargs={"strategy": strategy, "devices": dims.world, "accelerator": accelerator_of(devices[0])},
            tags={"processes": str(cfg.processes), "local": "pipe", "devices": ";".join(",".join(map(str, p)) for p in pairs),
                  **tags},
            data_parallel=dims.replicas, replicas_per_machine=dims.replicas_per_node,
            refused_precisions=engine_refused_precisions(cfg), recompute=strategy.recompute,
        )

    def starts_ranks(self, cfg) -> bool:
        return cfg.processes > 1 or (cfg.local == "pipe" and cfg.engine == "torch")

    def compile_unit(self, knobs) -> str:
        if knobs.local == "split":
            refuse_compile(self.name, "its processes' split halves are not compiled by ddlx yet",
                           "use strategy.local=pipe strategy.engine=torch")
        return compile_by_layers_or_refuse(self.name, knobs)

    def refused_precisions(self, knobs) -> dict[str, str]:
        return engine_refused_precisions(knobs)

    def candidates(self, hw, job) -> list[Setup]:
        n = hw.devices_per_node
        if n < 4:
            return []
        pipelines = pipelines_candidates(self.setup, n // 2, job, processes=n // 2)
        return pipelines if hw.device_kind == "cpu" else [self.setup(processes=n // 2, local="split"), *pipelines]

    def devices(self, setup) -> int:
        """A pair of devices per process (local: split or pipe) or per two-process pipeline (engine=torch)."""
        return 2 * setup.processes

    def calibration_group(self, setup) -> str:
        return engine_group(self.name, setup)

    def cost(self, setup, job, hw, profile, seq):
        p, b = setup.processes, job.batch_size
        if setup.engine == "torch":
            dims = ParallelDims(2 * p, 2)
            return pipelines_cost(setup, dims.replicas, dims.replicas_per_node, job, hw, profile, seq)
        local = split_s(seq.batch_s(b // p), b // p, cut_mb(profile), link(hw.link(0, 1)))
        ring = [link(hw.link(2 * i, 2 * ((i + 1) % p))) for i in range(p)]
        bucket = DEFAULT_BUCKET_MB  # its ranks' DDP at its default bucket (no knob)
        work = b * (seq.per_sample_at(b / p) + seq.load_per_sample_s)
        return cost(work / p, hybrid_s(local, p, profile.gradient_mb, bucket, ring, hw.allreduce_fixed_us * 1e-6))

    def memory(self, setup, job, hw, profile, seq=None):
        if setup.engine == "torch":
            dims = ParallelDims(2 * setup.processes, 2)
            return pipelines_memory(setup, dims.replicas, dims.replicas_per_node, job, hw, profile, seq)
        return memory_need(hw, halves_bytes(profile, hw, job.batch_size // setup.processes))


SPECS = (Hybrid(),)
