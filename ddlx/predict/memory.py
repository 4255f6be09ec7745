"""Training memory per device: parameters, gradients, optimizer state and activations.

Activations are measured, not guessed: the model runs once on PyTorch's ``meta`` device (shapes
only, no memory, no compute) and every layer's output size is counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models import build_model

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # for the whole batch on this device

    @property
    def total_bytes(self) -> int:
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes


def activation_bytes_per_sample(model: nn.Module, in_channels: int, image_size: int, dtype_bytes: int = 4) -> int:
    """Bytes of layer outputs kept for the backward pass, for one sample.

    In-place activations share their input's storage and are not counted twice.
    """
    total = in_channels * image_size * image_size
    sizes: list[int] = []

    def hook(module: nn.Module, _inputs, output) -> None:
        if getattr(module, "inplace", False):
            return
        if isinstance(output, torch.Tensor):
            sizes.append(output.numel())

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.no_grad():
            model(torch.empty(1, in_channels, image_size, image_size, device="meta"))
    finally:
        for handle in handles:
            handle.remove()
    return (total + sum(sizes)) * dtype_bytes


def estimate_training_memory(
    arch: str,
    num_classes: int,
    in_channels: int,
    image_size: int,
    batch_size: int,
    optimizer_slots: int = 1,
    dtype_bytes: int = 4,
) -> tuple[MemoryEstimate, int]:
    """Memory of one replica training ``arch`` on ``batch_size`` images, and the activation bytes per sample.

    ``optimizer_slots`` is the number of parameter-sized buffers the optimizer keeps (SGD with
    momentum: 1, Adam: 2).
    """
    with torch.device("meta"):
        model = build_model(arch, num_classes, in_channels, image_size)
    n_params = sum(p.numel() for p in model.parameters())
    per_sample = activation_bytes_per_sample(model, in_channels, image_size, dtype_bytes)
    estimate = MemoryEstimate(
        parameters_bytes=n_params * dtype_bytes,
        gradients_bytes=n_params * dtype_bytes,
        optimizer_bytes=n_params * dtype_bytes * optimizer_slots,
        activations_bytes=per_sample * batch_size,
    )
    return estimate, per_sample
