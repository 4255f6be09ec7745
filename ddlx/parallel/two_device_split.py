"""The manual two-device model split without pipelining (the Lerat et al. entry, section 2.4).

The first part of the model, up to its named split point (AlexNet after its 4th convolution,
VGG16 after its 8th), runs on the first device, the rest on the second; activations cross once
per batch in each direction. No micro-batches: the devices take turns, so the result is the
sequential computation exactly.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..models import LayeredModel

DevicesOf = Callable[[int], list[torch.device]]  # local rank -> that process's devices


class SplitForward:
    def __init__(self, model: LayeredModel, cut: int, devices: list[torch.device]) -> None:
        self.head, self.tail = model[:cut].to(devices[0]), model[cut:].to(devices[1])
        self.devices = devices

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.head(x.to(self.devices[0]))
        out = self.tail(hidden.to(self.devices[1]))
        return out.to(self.devices[0])  # the loss and metrics live with the first device


def split_parallelizer(devices_of: DevicesOf, cut_point: str | None = None):
    def parallelize(model: LayeredModel, local_rank: int) -> SplitForward:
        return SplitForward(model, model.cut_points[cut_point or model.split_point], devices_of(local_rank))

    return parallelize
