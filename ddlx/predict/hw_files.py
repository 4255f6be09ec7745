"""``conf/hw`` files read outside Hydra's composition: the machines one question compares, the
GPUs the published throughputs ran on. They are typed here, with the recommender's entry, on the
same schema Hydra composes ``hw=`` on (omegaconf's structured merge); the cost models below take
the typed :class:`~ddlx.costmodel.hardware.HardwareSpec`."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..costmodel.gpu_reference import FittedModel, cited_names, fitted_model
from ..costmodel.hardware import HardwareSpec, validate

DEFAULT_HW_DIR = Path(__file__).resolve().parents[2] / "conf" / "hw"  # the project's descriptions, the cited GPUs' among them


def load_hw_file(path: Path) -> DictConfig:
    """A ``conf/hw`` file on the typed schema (a DictConfig, as Hydra would compose it)."""
    described = OmegaConf.load(path)
    described.pop("defaults", None)
    return OmegaConf.merge(OmegaConf.structured(HardwareSpec), described)


def hw_file(name: str, hw_dir: Path = DEFAULT_HW_DIR) -> HardwareSpec:
    """``conf/hw/<name>.yaml`` (in ``hw_dir``), typed and checked."""
    return validate(OmegaConf.to_object(load_hw_file(hw_dir / f"{name}.yaml")))


def from_dict(fields: dict) -> HardwareSpec:
    """A description written out as plain data (``dataclasses.asdict``), typed and checked again."""
    return validate(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareSpec), fields)))


def cited_hardware(hw_dir: Path = DEFAULT_HW_DIR) -> dict[str, HardwareSpec]:
    """The descriptions of the GPUs the published throughputs ran on, by name."""
    return {name: hw_file(name, hw_dir) for name in sorted(cited_names())}


@lru_cache(maxsize=4)
def published_fit(hw_dir: Path = DEFAULT_HW_DIR) -> FittedModel:
    """The GPU time model fitted to the published throughputs, on ``hw_dir``'s descriptions of their GPUs."""
    return fitted_model(cited_hardware(hw_dir))


def every_fit(hw_dir: Path = DEFAULT_HW_DIR) -> None:
    """Reads, or fits, every fit a question on ``hw_dir``'s descriptions may need: the published
    throughputs', each measured GPU's and the working memory's (what ``fits.json`` ships)."""
    from ..costmodel.gpu_measured import gpu_working_memory, measured_fit

    # Past the lru caches of the two that have one: a cached answer reads no fit, and
    # gpu_reference.record_fits must see each one read.
    published_fit.__wrapped__(hw_dir)
    for path in sorted(hw_dir.glob("*.yaml")):
        measured_fit(hw_file(path.stem, hw_dir))
    gpu_working_memory.__wrapped__()
