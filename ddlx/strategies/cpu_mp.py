"""Multi-process data parallelism on one CPU machine, gradients averaged through shared memory
(source 000, section 4.1): the paper's fastest CPU setup."""
from __future__ import annotations

from dataclasses import dataclass

from ..knobs import knob
from ..predict.costs import (
    REPLICA_SHARE,
    cost,
    memory_need,
    node_copy_gb_s,
    replica_bytes,
    weight_traffic_s,
)
from ..predict.perf_models import cpu_mp_s
from .spec import Setup, StrategyPlan, StrategySpec, no_loss_scaling, require_cpu, warn_oversubscription

TIMEOUT_S = 300.0  # a rank that waits longer than this for the others fails instead of hanging


@dataclass
class CpuMpConfig:
    """``processes`` ranks on one machine, each pinned to cores/processes cores with as many
    threads, its own data shard and loader workers; gradients averaged through shared memory
    (source 000, section 4.1)."""

    name: str = "cpu_mp"
    processes: int = knob(2, low=1)
    pin_cores: bool = True
    timeout_s: float = knob(TIMEOUT_S, low=0, low_open=True)


class CpuMp(StrategySpec):
    name, config, order = "cpu_mp", CpuMpConfig, 2
    knob_tags = ("processes",)
    splits_batch = True

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        from ..parallel.cpu_mp import CpuMultiProcessStrategy

        require_cpu(self.name, accelerator)
        warn_oversubscription(self.name, cfg.processes, "processes")
        strategy = CpuMultiProcessStrategy(cfg.processes, pin_cores=cfg.pin_cores, timeout_s=cfg.timeout_s)
        # Lightning would clip each rank's own gradient after the reduce has averaged the slices.
        clipping = ("each rank steps its slice of the averaged gradient, which Lightning's clipping does not see; "
                    "use strategy=ddp_gloo to clip")
        return StrategyPlan(trainer_kwargs={"strategy": strategy, "devices": cfg.processes, "accelerator": "cpu"},
                            tags={"processes": str(cfg.processes)}, data_parallel=cfg.processes,
                            replicas_per_machine=cfg.processes, refused_trainer_args={"gradient_clip_val": clipping},
                            refused_precisions=self.refused_precisions(cfg))

    def refused_precisions(self, knobs) -> dict[str, str]:
        return no_loss_scaling("each rank checks only its slice of the gradient")

    def setup_of_run(self, params, tags) -> Setup:
        return Setup(self.name, (("processes", int(params["strategy.processes"])),))

    def candidates(self, hw, job) -> list[Setup]:
        n = hw.devices_per_node
        return [Setup(self.name, (("processes", n),))] if hw.device_kind == "cpu" and n > 1 else []

    def cost(self, setup, job, hw, profile, seq):
        """One copy of the weights: the optimizer's passes over them are made once in all (each
        rank steps its slice), each extra rank repeats only its forward and backward passes."""
        p = setup.get("processes")
        work = job.batch_size * (seq.per_sample_s + seq.load_per_sample_s)
        barrier = hw.intra_node.latency_us * 1e-6
        total = (cpu_mp_s(work, p, profile.gradient_mb, node_copy_gb_s(hw, p) * 1e3, barrier)
                 + weight_traffic_s(seq, hw, 1 + (p - 1) * REPLICA_SHARE, p))
        return cost(work / p, total)

    def memory(self, setup, job, hw, profile):
        """Each rank's activations and gradient, one shared copy of the weights, the optimizer
        state once over the slices, and the shared gradient slots (one per rank)."""
        p = setup.get("processes")
        shared = (1 + 1 + p) * profile.params * profile.param_bytes  # weights, momentum (split), slots
        ranks = min(p, hw.devices_per_node)
        per_rank = (replica_bytes(job, job.batch_size // p) - profile.state_bytes(profile.params)
                    + profile.params * (profile.param_bytes + profile.cast_bytes))  # its gradient, its autocast copies
        return memory_need(hw, per_rank + shared / ranks, ranks)


SPECS = (CpuMp(),)
