"""The model cut at a named cut point over two devices, no pipelining (the Lerat et al. entry, section 2.4)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..costmodel.costs import cost, cut_mb, link, memory_need
from ..knobs import SetupRole, knob
from ..costmodel.perf_models import split_s
from .parts.halves import cut_point, halves_bytes
from .spec import Setup, StrategyPlan, StrategySpec, accelerator_of, refuse_compile


@dataclass
class SplitConfig:
    """The model cut at ``cut_point`` (null: the paper's split point) over two devices, no
    pipelining (the Lerat et al. entry, section 2.4). devices: auto = two GPUs when there are, else [cpu, cpu]."""

    name: str = "split"
    devices: Any = knob("auto", setup=SetupRole(resolved=True, absent="cpu,cpu"))  # runs from before the tag: the CPU's
    cut_point: Optional[str] = None


class Split(StrategySpec):
    name, config, order = "split", SplitConfig, 5

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        from ..parallel.devices import resolve_devices
        from ..parallel.network import NetworkStrategy
        from ..parallel.two_device_split import split_parallelizer

        devices = resolve_devices(cfg.devices, 2, self.name)
        cut = cut_point(cfg, model, self.name)
        strategy = NetworkStrategy(devices[0], split_parallelizer(lambda rank: devices, cut))
        return StrategyPlan(trainer_kwargs={"strategy": strategy, "devices": 1, "accelerator": accelerator_of(devices[0])},
                            tags={"devices": ",".join(map(str, devices)), "cut_point": cut})

    def compile_unit(self, knobs) -> str:
        refuse_compile(self.name, "its two halves, cut and placed on their devices with their own hand-off, are "
                       "not compiled by ddlx yet", "use strategy=pipe strategy.engine=torch (stages of compiled layers)")

    def candidates(self, hw, job) -> list[Setup]:
        return [self.setup(devices=("cuda:0", "cuda:1"))] if hw.device_kind != "cpu" and hw.devices_per_node > 1 else []

    def cost(self, setup, job, hw, profile, seq):
        b = job.batch_size
        between = link(hw.link(0, 1)) if hw.devices_per_node > 1 else link(hw.intra_node)
        return cost(b * (seq.per_sample_s + seq.load_per_sample_s), split_s(seq.batch_s(b), b, cut_mb(profile), between))

    def memory(self, setup, job, hw, profile, seq=None):
        return memory_need(hw, halves_bytes(profile, hw, job.batch_size))


SPECS = (Split(),)
