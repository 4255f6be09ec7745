"""Multi-process data parallelism on one CPU machine, gradients averaged through shared memory
(source 000, section 4.1): the paper's fastest CPU setup."""
from __future__ import annotations

from dataclasses import dataclass

from ..knobs import knob
from ..predict.costs import cost, memory_need, replica_bytes, weight_traffic_s
from ..predict.perf_models import cpu_mp_s
from .spec import Setup, StrategyPlan, StrategySpec, require_cpu, warn_oversubscription

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
        return StrategyPlan(trainer_kwargs={"strategy": strategy, "devices": cfg.processes, "accelerator": "cpu"},
                            tags={"processes": str(cfg.processes)}, data_parallel=cfg.processes,
                            replicas_per_machine=cfg.processes)

    def setup_of_run(self, params, tags) -> Setup:
        return Setup(self.name, (("processes", int(params["strategy.processes"])),))

    def candidates(self, hw, job) -> list[Setup]:
        n = hw.devices_per_node
        return [Setup(self.name, (("processes", n),))] if hw.device_kind == "cpu" and n > 1 else []

    def cost(self, setup, job, hw, profile, seq):
        p = setup.get("processes")
        work = job.batch_size * (seq.per_sample_s + seq.load_per_sample_s)
        barrier = hw.intra_node.latency_us * 1e-6
        total = cpu_mp_s(work, p, profile.gradient_mb, hw.memory_bandwidth_gb_s * 1e3, barrier) + weight_traffic_s(seq, hw, p, p)
        return cost(work / p, total)

    def memory(self, setup, job, hw, profile):
        p = setup.get("processes")
        return memory_need(hw, replica_bytes(job, job.batch_size // p), min(p, hw.devices_per_node))


SPECS = (CpuMp(),)
