"""Training memory of one replica: parameters, gradients, optimizer state and activations.

Activations are counted, not guessed: :mod:`.profile` runs a training forward on fake tensors
(shapes only, no memory, no compute) and counts every tensor autograd saves for backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..job import FP32
from .numerics import numerics_of
from .profile import profile_model

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # for the whole batch on this device
    input_bytes: int = 0  # the fp32 batch the step holds where autograd keeps only its cast (autocast)

    @property
    def total_bytes(self) -> int:
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes + self.input_bytes


def estimate_training_memory(
    arch: str,
    num_classes: int,
    in_channels: int,
    image_size: int,
    batch_size: int,
    optimizer_slots: int = 1,
    precision: str | None = FP32,
    recompute: bool = False,
) -> tuple[MemoryEstimate, int]:
    """Memory of one replica training ``arch`` on ``batch_size`` images, and the activation bytes per sample.

    ``optimizer_slots`` is the number of parameter-sized buffers the optimizer keeps (SGD with
    momentum: 1, Adam: 2); ``precision``: Lightning's ``trainer.precision`` (:mod:`.numerics`:
    its bytes per parameter and activation, and autocast's weight copies, counted with the parameters);
    ``recompute``: activation checkpointing at the model's cut points (:meth:`ModelProfile.kept_bytes`).
    """
    profile = profile_model(arch, num_classes, in_channels, image_size).at(numerics_of(precision))
    per_sample = profile.kept_bytes(recompute=recompute)
    param_bytes = profile.params * profile.param_bytes
    estimate = MemoryEstimate(
        parameters_bytes=param_bytes + profile.params * profile.cast_bytes,
        gradients_bytes=param_bytes,
        optimizer_bytes=param_bytes * optimizer_slots,
        activations_bytes=per_sample * batch_size + (0 if recompute else profile.fixed_activation_bytes),
        # Autograd keeps the first layer's input, which is the batch itself in fp32; under autocast
        # it keeps the cast, while the step still holds the fp32 batch.
        input_bytes=batch_size * profile.input_bytes if profile.cast_bytes else 0,
    )
    return estimate, per_sample
