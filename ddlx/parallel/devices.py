"""Device lists for the model-parallel strategies: ``auto``, or explicit and checked."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def present_devices() -> list[str]:
    return ["cpu", *(f"cuda:{i}" for i in range(gpu_count()))]


def resolve_devices(spec: str | Sequence[str] | None, count: int, strategy: str) -> list[torch.device]:
    """``auto``: ``count`` GPUs when there are, otherwise ``count`` x cpu (said in the log)."""
    present = present_devices()
    gpus = [d for d in present if d.startswith("cuda")]
    if spec in (None, "auto"):
        if len(gpus) >= count:
            return [torch.device(d) for d in gpus[:count]]
        log.info("strategy=%s: %d GPU(s) here, fewer than %d: running its %d stages on [%s]", strategy, len(gpus), count, count, ", ".join(["cpu"] * count))
        return [torch.device("cpu")] * count
    example = "[" + ",".join(["cpu"] * max(count, 2)) + "]"
    if isinstance(spec, str) or len(spec) != count or count == 0:  # pipe: as many stages as devices listed
        many = f"{count} devices" if count else "devices, one per stage"
        raise ConfigError(f"strategy.devices={spec!r} for strategy={strategy}; expected auto or a list of {many}, "
                          f"e.g. strategy.devices={example}")
    wanted = [str(d) for d in spec]
    for name in wanted:
        try:
            known = torch.device(name).type in ("cpu", "cuda")
        except RuntimeError:
            known = False
        if not known:
            raise ConfigError(f"strategy.devices={spec!r} for strategy={strategy}: {name!r} is not a device; expected "
                              f"cpu or cuda:N, e.g. strategy.devices={example}")
    missing = [d for d in wanted if torch.device(d).type == "cuda" and _normal(d) not in present]
    if missing:
        fallback = "[" + ",".join((gpus * count)[:count]) + "]" if gpus else "[" + ",".join(["cpu"] * count) + "]"
        raise ConfigError(
            f"strategy={strategy} asks for devices [{', '.join(wanted)}] but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not here (this machine has: {', '.join(present)}); "
            f"use strategy.devices=auto or strategy.devices={fallback}"
        )
    return [torch.device(d) for d in wanted]


def _normal(name: str) -> str:
    device = torch.device(name)
    return f"cuda:{device.index or 0}" if device.type == "cuda" else device.type
