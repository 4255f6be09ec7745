"""Sharded data parallelism (FSDP2, ``fully_shard``): DDP's maths, each rank keeping only its
shard of the weights, gradients and optimizer state (ZeRO-3 ``full``, ZeRO-2 ``grad_op``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..compiling import EACH_LAYER
from ..errors import ConfigError
from ..knobs import ALWAYS, UNLESS_DEFAULT, SetupRole, knob
from ..costmodel.costs import (
    RECOMPUTE,
    computing_at_once,
    cost,
    link,
    memory_need,
    rank_device,
    recompute_factor,
    recomputes,
    replica_bytes,
    ring,
    weight_traffic_s,
)
from ..costmodel.perf_models import data_parallel_s, exposed_sharded_s
from .parts.replicas import RanksOverNodes, ranks_on_a_node
from .spec import TIMEOUT_S, Setup, StrategyPlan, StrategySpec, no_loss_scaling, warn_oversubscription

SHARDINGS = ("full", "grad_op", "none", "hybrid")
# Ring volume per step against DDP's allreduce (2(W-1)/W of the gradients): full gathers the
# weights before forward and again before backward and reduce-scatters the gradients (3 x (W-1)/W);
# grad_op gathers them once (2 x); none is DDP's allreduce; hybrid is full inside its groups.
VOLUME = {"full": 1.5, "grad_op": 1.0, "none": 1.0, "hybrid": 1.5}


@dataclass
class FsdpConfig:
    """``processes`` ranks (CPU shares over gloo, or GPUs over NCCL with trainer=gpu), each with
    its share of the batch and 1/processes of the model's state: ``sharding`` full (weights,
    gradients, optimizer state), grad_op (gradients, optimizer state), none (replicated) or
    hybrid (full within groups of ``shard_size`` ranks, null: one node's, replicated across them)."""

    name: str = "fsdp"
    processes: int = knob(2, low=1, setup=ALWAYS)
    sharding: str = knob("full", choices=SHARDINGS, setup=ALWAYS)
    shard_size: Optional[int] = knob(None, low=1, setup=SetupRole(when=(("sharding", "hybrid"),), resolved=True))  # sharding=hybrid: ranks per shard group (null: a node's)
    checkpoint: str = knob("never", choices=RECOMPUTE, setup=UNLESS_DEFAULT)  # always: recompute each block between cut points in backward
    pin_cores: bool = True  # on CPU: each rank on its own share of the cores
    timeout_s: float = knob(TIMEOUT_S, low=0, low_open=True)


class Fsdp(RanksOverNodes, StrategySpec):
    name, config, order = "fsdp", FsdpConfig, 5
    splits_batch = True

    def channels_last_problem(self, cfg) -> str | None:
        return ("FSDP2 shards contiguous parameters only (torch: 'FSDP does not support non-contiguous parameters'); "
                "use model.memory_format=contiguous, or strategy=ddp_gloo/ddp_nccl, which takes channels_last")

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        import torch

        from ..parallel.devices import gpu_count
        from ..parallel.fully_shard import FullyShardedStrategy
        from ..parallel.launch import ranks_per_node

        p = cfg.processes
        per_node, nodes = ranks_per_node(p, self.name)  # srun or torchrun may spread them over nodes
        if accelerator in ("gpu", "cuda"):
            if gpu_count() < per_node:
                raise ConfigError(f"strategy=fsdp strategy.processes={p} with trainer.accelerator={accelerator} needs "
                                  f"{per_node} GPU(s) per node, this machine has {gpu_count()}; use strategy.processes="
                                  f"{max(1, gpu_count()) * nodes} or trainer.accelerator=cpu")
            devices = [torch.device(f"cuda:{i}") for i in range(per_node)]
        else:
            warn_oversubscription(self.name, per_node, "processes")
            devices = [torch.device("cpu")] * per_node
        shard_size = self._shard_size(cfg, per_node)
        strategy = FullyShardedStrategy(devices, cfg.sharding, pin_cores=cfg.pin_cores, timeout_s=cfg.timeout_s,
                                        shard_size=shard_size)
        strategy.recompute = recomputes(cfg)
        return StrategyPlan(
            trainer_kwargs={"strategy": strategy, "devices": per_node, "num_nodes": nodes,
                            "accelerator": "gpu" if devices[0].type == "cuda" else "cpu"},
            tags={"processes": str(p), "nodes": str(nodes), "sharding": cfg.sharding, "checkpoint": cfg.checkpoint,
                  **({"shard_size": str(shard_size)} if cfg.sharding == "hybrid" else {})},
            data_parallel=self.data_parallel(cfg), replicas_per_machine=per_node, recompute=strategy.recompute,
            refused_precisions=self.refused_precisions(cfg),
        )

    @staticmethod
    def _shard_size(cfg, per_node: int) -> int | None:
        """``shard_size``, checked: it divides a node's ranks (a group never spans nodes) and
        belongs to sharding=hybrid; null there: the node's ranks."""
        size = cfg.shard_size
        if cfg.sharding != "hybrid":
            if size is not None:
                raise ConfigError(f"strategy.shard_size={size} sets the groups of strategy.sharding=hybrid, not of "
                                  f"sharding={cfg.sharding}; use strategy.sharding=hybrid or drop strategy.shard_size")
            return None
        if size is None:
            return per_node
        if per_node % size:
            divisors = [d for d in range(1, per_node + 1) if per_node % d == 0]
            raise ConfigError(f"strategy.shard_size={size} does not divide the {per_node} ranks of a node "
                              f"(strategy.processes={cfg.processes}): each shard group is ranks of one node; "
                              f"use one of {divisors}")
        return size

    def refused_precisions(self, knobs) -> dict[str, str]:
        return no_loss_scaling("each rank holds only its shard of the gradients")

    def compile_unit(self, knobs) -> str:
        """Each layer, before it is sharded (torchtitan compiles each block, then fully_shard's it):
        the gathers and reduce-scatters stay outside the compiled graphs."""
        return EACH_LAYER

    def candidates(self, hw, job) -> list[Setup]:
        """Every device of a node, full or grad_op; with several nodes, every device of the
        cluster, full or hybrid (HSDP: a shard group per node)."""
        n, total = hw.devices_per_node, hw.total_devices
        plain = [self.setup(processes=n, sharding=s) for s in ("full", "grad_op")] if n > 1 else []
        if hw.nodes > 1:
            plain += [self.setup(processes=total, sharding="full"), self.setup(processes=total, sharding="hybrid", shard_size=n)]
        return [*plain, *(self.with_knobs(s, checkpoint="always") for s in plain)]

    def cost(self, setup, job, hw, profile, seq):
        """DDP's Eq. 5.1 with FSDP's ring volume (``VOLUME``): the gathers and the reduce-scatter
        run per layer beside the computation on GPUs, in turn with it on CPU (shared cores)."""
        w, shared_bus, sharding = setup.processes, hw.device_kind == "cpu", setup.sharding
        work = job.batch_size * (seq.per_sample_at(job.batch_size / w) * recompute_factor(setup) + seq.load_per_sample_s)
        volume = VOLUME[sharding] * profile.gradient_mb
        largest = max(profile.layer_mb)  # one unit's transfer
        local, fixed = (min(w, hw.devices_per_node) if shared_bus else 1), hw.allreduce_fixed_us * 1e-6
        compute = work / computing_at_once(hw, w)
        if sharding == "hybrid":  # full inside each group, then its shard averaged across the groups
            k = shard_ranks(setup, hw)
            groups = [link(hw.link(rank_device(hw, i * k), rank_device(hw, (i + 1) % (w // k) * k))) for i in range(w // k)]
            comm = (data_parallel_s(0.0, k, volume, largest, ring(hw, k), fixed, overlap=not shared_bus)
                    + data_parallel_s(0.0, w // k, profile.gradient_mb / k, largest / k, groups, fixed, overlap=not shared_bus))
        elif not shared_bus and sharding in ("full", "grad_op") and (layers := seq.layers_s_at(job.batch_size / w, profile)):
            comm = exposed_sharded_s([f for f, _ in layers], [b for _, b in layers], profile.layer_mb, w, ring(hw, w), fixed,
                                     regather=sharding == "full")  # per unit, as the GPU model times the layers
        else:
            comm = data_parallel_s(0.0, w, volume, largest, ring(hw, w), fixed, overlap=not shared_bus)
        return cost(compute, compute + comm + weight_traffic_s(seq, hw, local, local))

    def memory(self, setup, job, hw, profile, seq=None):
        """A replica's activations at its share of the batch; the state sharded by level: full
        keeps 1/W of the weights, gradients and momentum plus the largest layer gathered (hybrid:
        1/shard_size), grad_op the whole weights and 1/W of the rest, none all of it."""
        w, sharding = setup.processes, setup.sharding
        replica = replica_bytes(job, job.batch_size // w, recompute=recomputes(setup))
        state = profile.state_bytes(profile.params)
        cast = profile.params * profile.cast_bytes  # autocast's copies of the gathered weights: each rank its own
        weights = profile.params * profile.param_bytes
        largest = max(layer.params for layer in profile.layers) * profile.param_bytes
        if sharding in ("full", "hybrid"):  # hybrid: sharded over its group
            shards = shard_ranks(setup, hw)
            kept = (state - cast) / shards + 2 * largest + cast  # the layer in use and the next, prefetched
        elif sharding == "grad_op":
            kept = weights + (state - cast - weights) / w + cast
        else:
            kept = state
        return memory_need(hw, replica - state + kept, min(w, hw.devices_per_node))


def shard_ranks(setup, hw) -> int:
    """The ranks one shard of the weights is spread over on ``hw``: a hybrid group's (``shard_size``;
    unset, a node's ranks, as the plan resolves it), every rank's otherwise."""
    if setup.sharding != "hybrid":
        return setup.processes
    return setup.shard_size or ranks_on_a_node(setup.processes, hw)


SPECS = (Fsdp(),)
