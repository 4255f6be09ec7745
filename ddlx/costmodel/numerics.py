"""What a training precision (Lightning's ``trainer.precision``) means for the models: the
number format the matrix products run in, which sets the device's peak (``hw.peak_tflops`` for
fp32, ``hw.peak_tflops_by_type`` for the others), and the bytes per parameter and per activation.

- ``*-mixed``: autocast. Weights, gradients and optimizer state stay fp32; convolutions and
  matrix products run in the low format and their outputs (most of the activations kept for
  backward) are stored in it; each weight is also held as a low-format copy, made on its
  first use in a step and freed with the backward that needs it.
- ``*-true``: the whole model in that format (weights, gradients, momentum, activations).
- ``32-true``: fp32 (on GPUs with TF32 units cuDNN runs convolutions in TF32 by default, which
  only runs on the GPU calibrate: its matrix products and layers between stay fp32).

No torch here: the strategy specs import this when the config is composed.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..job import FP32, precision_of

# The number formats a hardware file may give a peak for, beside fp32 (hw.peak_tflops).
NUMBER_TYPES = ("fp64", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class Numerics:
    precision: str  # Lightning's full name
    compute: str  # the number format of the matrix products: fp32 or one of NUMBER_TYPES
    param_bytes: int  # per parameter: weights, gradients and optimizer state
    activation_bytes: int  # per activation element kept for backward or sent between stages
    cast_bytes: int = 0  # per parameter: autocast's low-format copy of the weights, held through the step

    @property
    def input_bytes(self) -> int:
        """Per input element: the loader delivers fp32 images; ``*-true`` casts them to the model's format."""
        return 4 if self.precision.endswith("-mixed") else self.activation_bytes


PRECISION_NUMERICS = {n.precision: n for n in (
    Numerics(FP32, "fp32", 4, 4),
    Numerics("64-true", "fp64", 8, 8),
    Numerics("bf16-mixed", "bf16", 4, 2, cast_bytes=2),
    Numerics("16-mixed", "fp16", 4, 2, cast_bytes=2),
    Numerics("bf16-true", "bf16", 2, 2),
    Numerics("16-true", "fp16", 2, 2),
)}


# Lightning trains 16-mixed on CPU as bf16-mixed (its accelerator connector: "AMP with fp16 is not
# supported on CPU"), which a run recorded as 16-mixed would misstate.
CPU_FP16 = {"16-mixed": "on CPU Lightning trains 16-mixed as bf16-mixed (\"AMP with fp16 is not supported on CPU\"), "
                        "so the run would be recorded under the wrong precision; use trainer.precision=bf16-mixed, "
                        "or 16-true for fp16 weights and activations"}


def numerics_on(precision, device_kind: str) -> Numerics:
    """:func:`numerics_of`, refusing what Lightning would not train as asked on ``device_kind``."""
    numerics = numerics_of(precision)
    if device_kind == "cpu" and numerics.precision in CPU_FP16:
        raise ConfigError(f"trainer.precision={precision} on a CPU machine: {CPU_FP16[numerics.precision]}")
    return numerics


def numerics_of(precision) -> Numerics:
    """The numerics of a ``trainer.precision`` value (Lightning's short names too)."""
    full = precision_of(precision)
    if full not in PRECISION_NUMERICS:
        raise ConfigError(f"trainer.precision={precision}: the recommender models "
                          f"{', '.join(PRECISION_NUMERICS)}; predict one of those")
    return PRECISION_NUMERICS[full]
