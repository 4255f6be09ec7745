"""One process, each batch split into ``threads`` sub-batches trained by ``threads`` threads on
shared weights; gradients summed under autograd's lock (the Lerat et al. entry, section 2.5)."""
from __future__ import annotations

from dataclasses import dataclass

from ..knobs import ALWAYS, knob
from ..costmodel.costs import (
    REPLICA_SHARE,
    cost,
    memory_need,
    replica_bytes,
    weight_traffic_s,
)
from ..costmodel.perf_models import threads_s
from .parts.replicas import thread_share
from .spec import Setup, StrategyPlan, StrategySpec, require_cpu, warn_oversubscription


@dataclass
class ThreadsConfig:
    """One process: each batch split into ``threads`` sub-batches trained by ``threads`` threads on
    shared weights (the Lerat et al. entry, section 2.5)."""

    name: str = "threads"
    threads: int = knob(2, low=1, setup=ALWAYS)


class Threads(StrategySpec):
    name, config, order = "threads", ThreadsConfig, 1
    splits_batch = True

    def smallest_piece(self, cfg, batch: int) -> int:
        return thread_share(cfg.threads, batch)

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        import torch

        from ..parallel.network import NetworkStrategy
        from ..parallel.sub_batch_threads import threads_parallelizer

        require_cpu(self.name, accelerator)
        warn_oversubscription(self.name, cfg.threads, "threads")
        strategy = NetworkStrategy(torch.device("cpu"), threads_parallelizer(cfg.threads))
        return StrategyPlan(trainer_kwargs={"strategy": strategy, "devices": 1, "accelerator": "cpu"},
                            tags={"threads": str(cfg.threads)})

    def candidates(self, hw, job) -> list[Setup]:
        n = hw.devices_per_node
        return [self.setup(threads=n)] if hw.device_kind == "cpu" and n > 1 else []

    def cost(self, setup, job, hw, profile, seq):
        k = setup.threads
        compute, load = job.batch_size * seq.per_sample_s, job.batch_size * seq.load_per_sample_s
        return cost(compute / k + load, threads_s(compute, k) + load + weight_traffic_s(seq, hw, 1 + (k - 1) * REPLICA_SHARE, k))

    def memory(self, setup, job, hw, profile, seq=None):
        return memory_need(hw, replica_bytes(job, job.batch_size))

    def worker_batch(self, setup, job) -> int:
        return job.batch_size // setup.threads


SPECS = (Threads(),)
