"""One device: on CPU ``threads`` intra-op threads (1 is the paper's one-core baseline, the
speedups' reference); with trainer=gpu, one GPU."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..knobs import SetupRole, knob
from ..costmodel.costs import cost, memory_need, replica_bytes, weight_traffic_s
from .spec import Setup, StrategyPlan, StrategySpec, warn_oversubscription


@dataclass
class SequentialConfig:
    """One device. On CPU, ``threads`` intra-op threads (1 = the paper's one-core baseline); with
    trainer=gpu, one GPU."""

    name: str = "sequential"
    threads: int = knob(1, low=1, setup=SetupRole(when=(("trainer", None),)))  # names a CPU setup, not a GPU one


class Sequential(StrategySpec):
    name, config, order = "sequential", SequentialConfig, 0
    extra_setup_knobs = (("trainer", Optional[str], None),)  # gpu: one GPU (set by trainer=gpu, not a strategy knob)

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        import torch

        warn_oversubscription(self.name, cfg.threads, "threads")
        torch.set_num_threads(cfg.threads)
        return StrategyPlan(trainer_kwargs={"strategy": "auto", "devices": 1}, tags={"threads": str(cfg.threads)})

    def setup(self, **knobs) -> Setup:
        """On a GPU, its setup is the trainer (``trainer=gpu``): threads do not name it (their role's ``when``)."""
        if knobs.get("trainer") not in (None, "gpu"):
            raise ValueError(f"strategy={self.name}: trainer={knobs['trainer']} does not name a setup; only trainer=gpu does")
        return super().setup(**knobs)

    def setup_of_run(self, params, tags) -> Setup:
        return self.setup(trainer="gpu") if tags.get("accelerator") == "gpu" else super().setup_of_run(params, tags)

    def candidates(self, hw, job) -> list[Setup]:
        if hw.device_kind != "cpu":
            return [self.setup(trainer="gpu")]
        out = [self.setup(threads=1)]
        if hw.devices_per_node > 1:
            out.append(self.setup(threads=hw.devices_per_node))
        return out

    def cost(self, setup, job, hw, profile, seq):
        threads = setup.threads
        compute = job.batch_size * seq.per_sample_s / threads + job.batch_size * seq.load_per_sample_s
        return cost(compute, compute + weight_traffic_s(seq, hw, 1, threads))

    def memory(self, setup, job, hw, profile, seq=None):
        return memory_need(hw, replica_bytes(job, job.batch_size))

    def calibration_group(self, setup) -> str:
        return self.name if setup.threads == 1 else "sequential-threads"


SPECS = (Sequential(),)
