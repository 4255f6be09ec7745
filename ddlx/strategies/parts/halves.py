"""The model cut in two halves at a named cut point: what strategy=split runs, and each replica of
strategy=mpi or strategy=hybrid with ``local=split`` (the Lerat et al. entry, section 2.4)."""
from __future__ import annotations

from ...errors import ConfigError
from ...costmodel.costs import stage_bytes


def cut_point(cfg, model, name: str) -> str:
    """The knob ``cut_point`` (null: the model's own split point), checked against the model's cut points."""
    cut = cfg.cut_point or model.split_point
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
