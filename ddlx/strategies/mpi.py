"""Ranks started by ``mpirun`` (or SLURM), gradients averaged across them, each rank running a
``local`` strategy on its own devices (the Lerat et al. entry, section 2.6)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from ..compiling import WHOLE_MODEL
from ..knobs import ALWAYS, knob
from ..parallel.schedules import SCHEDULES
from .parts.pipelines import (ENGINES, PIPE_CHECKPOINT, PIPELINE_KNOB, PIPELINE_KNOB_UNLESS_DEFAULT, compile_by_layers_or_refuse,
                              engine_group, engine_refused_precisions, local_torch_pipeline, pipelines_candidates, pipelines_cost,
                              pipelines_memory, torch_pipeline)
from .parts.replicas import (ParallelDims, ReplicasOfALocalStrategy, data_parallel_cost, data_parallel_memory, device_pairs,
                             local_parallelizer)
from .spec import TIMEOUT_S, Setup, StrategyPlan, StrategySpec, refuse_compile


@dataclass
class MpiConfig:
    """Ranks started by mpirun, gradients averaged across them, each running a ``local`` strategy
    (the Lerat et al. entry, section 2.6):  mpirun -np 2 python train.py strategy=mpi strategy.local=threads.
    local: pipe with engine=torch runs one rank per stage: pipelines of two consecutive ranks
    (on one node), mpirun -np 4 gives two of them."""

    name: str = "mpi"
    local: str = knob("sequential", choices=("sequential", "threads", "split", "pipe"), setup=ALWAYS)
    threads: int = knob(2, low=1)  # local: threads
    devices: Any = "auto"  # local: split | pipe (two devices per rank)
    cut_point: Optional[str] = None
    chunks: int = knob(4, low=1, setup=PIPELINE_KNOB)
    balance: Any = knob(None, label="when_set")
    checkpoint: str = knob("never", choices=PIPE_CHECKPOINT, setup=PIPELINE_KNOB_UNLESS_DEFAULT)
    engine: str = knob("fairscale", choices=ENGINES, setup=PIPELINE_KNOB_UNLESS_DEFAULT)  # local: pipe
    schedule: str = knob("gpipe", choices=tuple(SCHEDULES), setup=PIPELINE_KNOB, quiet=True)  # local: pipe, engine=torch
    pin_cores: bool = True  # local: pipe, engine=torch on CPU
    backend: Optional[str] = knob(None, choices=("gloo", "nccl", "mpi"))  # null: gloo on CPU, nccl on GPU
    timeout_s: float = knob(TIMEOUT_S, low=0, low_open=True)


class Mpi(ReplicasOfALocalStrategy, StrategySpec):
    name, config, order = "mpi", MpiConfig, 8
    resolved_tags = ("ranks", "nodes")
    splits_batch = True
    launcher_knobs = ("ranks",)  # mpirun -np

    def data_parallel(self, cfg) -> int | None:
        return None  # the ranks mpirun or srun starts

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        import torch
        from lightning_fabric.plugins.environments import MPIEnvironment

        from ..parallel.devices import gpu_count
        from ..parallel.mpi_ranks import mpi_layout, set_rank_threads
        from ..parallel.network import DataParallelNetworkStrategy

        world, local_size, nodes = mpi_layout()
        set_rank_threads(local_size)
        on_gpus = accelerator == "gpu" and gpu_count() >= local_size
        if local_torch_pipeline(cfg):  # two consecutive ranks of one node each run a two-stage pipeline
            dims = ParallelDims(world, 2, local_size).check(
                self.name, f"start an even number of ranks per node, e.g. mpirun -np {2 * nodes} --map-by ppr:2:node")
            return self._plan_torch(cfg, model, data, dims, nodes, on_gpus)
        dims = ParallelDims(world, 1, local_size)
        if cfg.local in ("split", "pipe"):
            pairs = device_pairs(cfg, local_size, self.name)
            roots = [pair[0] for pair in pairs]
            devices_of = lambda rank: pairs[rank]  # noqa: E731
        else:
            roots = [torch.device(f"cuda:{i}") if on_gpus else torch.device("cpu") for i in range(local_size)]
            devices_of = None
        parallelize, local_tags = local_parallelizer(cfg, model, data, dims.replicas, self.name, devices_of)
        on_cpu = roots[0].type == "cpu"
        backend = cfg.backend or ("gloo" if on_cpu else "nccl")
        strategy = DataParallelNetworkStrategy(parallelize, roots, cluster_environment=MPIEnvironment(),
                                               process_group_backend=backend, timeout=timedelta(seconds=cfg.timeout_s))
        return StrategyPlan(
            trainer_kwargs={"strategy": strategy, "devices": local_size, "num_nodes": nodes,
                            "accelerator": "cpu" if on_cpu else "gpu"},
            tags={"ranks": str(world), "nodes": str(nodes), "backend": backend, **local_tags},
            data_parallel=dims.replicas,
            replicas_per_machine=dims.replicas_per_node,
        )

    def _plan_torch(self, cfg, model, data, dims: ParallelDims, nodes: int, on_gpus: bool) -> StrategyPlan:
        """Pipelines of two consecutive ranks (one node's) under PyTorch's schedule, averaging gradients."""
        import torch
        from lightning_fabric.plugins.environments import MPIEnvironment

        local_size = dims.node_ranks
        devices = [torch.device(f"cuda:{i}") if on_gpus else torch.device("cpu") for i in range(local_size)]
        backend = cfg.backend or ("nccl" if on_gpus else "gloo")
        strategy, tags = torch_pipeline(cfg, devices, model, data, self.name, replicas=dims.replicas, width=dims.width,
                                        cluster_environment=MPIEnvironment(), process_group_backend=backend)
        return StrategyPlan(
            trainer_kwargs={"strategy": strategy, "devices": local_size, "num_nodes": nodes,
                            "accelerator": "gpu" if on_gpus else "cpu"},
            tags={"ranks": str(dims.world), "nodes": str(nodes), "backend": backend, "local": "pipe", **tags},
            data_parallel=dims.replicas, replicas_per_machine=dims.replicas_per_node,
            refused_precisions=engine_refused_precisions(cfg), recompute=strategy.recompute,
        )

    def compile_unit(self, knobs) -> str:
        local = knobs.local
        if local == "split":
            refuse_compile(self.name, "its ranks' split halves are not compiled by ddlx yet",
                           "use strategy.local=sequential or strategy.local=pipe strategy.engine=torch")
        return compile_by_layers_or_refuse(self.name, knobs) if local == "pipe" else WHOLE_MODEL

    def refused_precisions(self, knobs) -> dict[str, str]:
        return engine_refused_precisions(knobs)

    def candidates(self, hw, job) -> list[Setup]:
        if hw.nodes < 2:
            return []
        ranks = hw.total_devices
        pipelines = pipelines_candidates(self.setup, ranks // 2, job, ranks=ranks) if hw.devices_per_node % 2 == 0 else []
        return [self.setup(ranks=ranks, local="sequential"), *pipelines]

    def launcher(self, setup, hw) -> str:
        return f"mpirun -np {setup.ranks}"  # ranks fill each node's slots in order (the host file's)

    def processes(self, setup) -> int:
        return setup.ranks

    def calibration_group(self, setup) -> str:
        return engine_group(self.name, setup)

    def cost(self, setup, job, hw, profile, seq):
        if setup.engine == "torch":
            dims = self._dims(setup, hw)
            return pipelines_cost(setup, dims.replicas, dims.replicas_per_node, job, hw, profile, seq)
        return data_parallel_cost(setup, setup.ranks, job, hw, profile, seq)

    def memory(self, setup, job, hw, profile, seq=None):
        if setup.engine == "torch":
            dims = self._dims(setup, hw)
            return pipelines_memory(setup, dims.replicas, dims.replicas_per_node, job, hw, profile, seq)
        return data_parallel_memory(setup, setup.ranks, job, hw, profile)

    @staticmethod
    def _dims(setup, hw) -> ParallelDims:
        """Two-stage pipelines over the ranks, which fill nodes in order (mpirun's default)."""
        ranks = setup.ranks
        return ParallelDims(ranks, 2, min(ranks, hw.devices_per_node))


SPECS = (Mpi(),)
