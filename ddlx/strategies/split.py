"""The model cut at a named cut point over two devices, no pipelining (the Lerat et al. entry, section 2.4)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ConfigError
from ..costmodel.costs import cost, cut_mb, link, memory_need, stage_bytes
from ..costmodel.perf_models import split_s
from .spec import Setup, StrategyPlan, StrategySpec, accelerator_of, refuse_compile


@dataclass
class SplitConfig:
    """The model cut at ``cut_point`` (null: the paper's split point) over two devices, no
    pipelining (the Lerat et al. entry, section 2.4). devices: auto = two GPUs when there are, else [cpu, cpu]."""

    name: str = "split"
    devices: Any = "auto"
    cut_point: Optional[str] = None


def cut_point(cfg, model, name: str) -> str:
    """The knob ``cut_point`` (null: the model's own split point), checked against the model's cut points."""
    cut = cfg.get("cut_point") or model.split_point
    if cut not in model.cut_points:
        raise ConfigError(
            f"strategy.cut_point={cut!r} for strategy={name} is not a cut point of {model.arch}; "
            f"expected one of {', '.join(model.cut_points)} (default: the paper's {model.split_point})"
        )
    return cut


def halves_bytes(profile, hw, batch: int) -> float:
    """The two halves' bytes at the model's split point: on GPUs the larger (one per device), on
    CPU both (one memory)."""
    halves = stage_bytes(profile, [profile.split_index, len(profile.layers) - profile.split_index], batch, 1, "never")
    return sum(halves) if hw.device_kind == "cpu" else max(halves)


class Split(StrategySpec):
    name, config, order = "split", SplitConfig, 5
    knob_tags = ("devices", "cut_point")

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        from ..parallel.devices import resolve_devices
        from ..parallel.network import NetworkStrategy
        from ..parallel.split import split_parallelizer

        devices = resolve_devices(cfg.get("devices"), 2, self.name)
        cut = cut_point(cfg, model, self.name)
        strategy = NetworkStrategy(devices[0], split_parallelizer(lambda rank: devices, cut))
        return StrategyPlan(trainer_kwargs={"strategy": strategy, "devices": 1, "accelerator": accelerator_of(devices[0])},
                            tags={"devices": ",".join(map(str, devices)), "cut_point": cut})

    def compile_unit(self, knobs) -> str:
        refuse_compile(self.name, "its two halves, cut and placed on their devices with their own hand-off, are "
                       "not compiled by ddlx yet", "use strategy=pipe strategy.engine=torch (stages of compiled layers)")

    def setup_of_run(self, params, tags) -> Setup:
        return Setup(self.name, (("devices", tuple(tags.get("devices", "cpu,cpu").split(","))),))

    def candidates(self, hw, job) -> list[Setup]:
        return [Setup(self.name, (("devices", ("cuda:0", "cuda:1")),))] if hw.device_kind != "cpu" and hw.devices_per_node > 1 else []

    def cost(self, setup, job, hw, profile, seq):
        b = job.batch_size
        between = link(hw.link(0, 1)) if hw.devices_per_node > 1 else link(hw.intra_node)
        return cost(b * (seq.per_sample_s + seq.load_per_sample_s), split_s(seq.batch_s(b), b, cut_mb(profile), between))

    def memory(self, setup, job, hw, profile):
        return memory_need(hw, halves_bytes(profile, hw, job.batch_size))


SPECS = (Split(),)
