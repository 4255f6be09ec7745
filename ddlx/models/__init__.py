"""Architecture builders: one per family, a registry by name, every model a :class:`LayeredModel`."""
from __future__ import annotations

from functools import partial
from typing import Callable

from ..errors import ConfigError
from ..job import MIN_IMAGE_SIZE
from .alexnet import build_alexnet
from .layered import LayeredModel
from .mobilenet import build_mobilenet_v2
from .resnet import build_resnet
from .vgg import build_vgg

# Inputs smaller than this use the CIFAR/MNIST variants of Jansen's thesis Appendix A.
SMALL_INPUT_BELOW = 64

_BUILDERS: dict[str, Callable[..., LayeredModel]] = {
    "alexnet": build_alexnet,
    "vgg11": partial(build_vgg, "vgg11"),
    "vgg16": partial(build_vgg, "vgg16"),
    "resnet18": partial(build_resnet, "resnet18"),
    "resnet50": partial(build_resnet, "resnet50"),
    "resnet152": partial(build_resnet, "resnet152"),
    "mobilenet_v2": build_mobilenet_v2,
}

ARCHITECTURES = tuple(_BUILDERS)


def check_request(arch: str, num_classes: int, in_channels: int, image_size: int) -> None:
    """The values :func:`build_model` cannot build, as a :class:`ConfigError` naming the fix
    (callers that only predict check them before any work)."""
    if arch not in _BUILDERS:
        raise ConfigError(f"unknown model {arch!r}; expected one of {', '.join(ARCHITECTURES)}")
    if image_size < MIN_IMAGE_SIZE:
        raise ConfigError(f"data.image_size={image_size}: expected a value >= {MIN_IMAGE_SIZE}")  # (as its key's bound)
    if num_classes < 2 or in_channels < 1:
        raise ConfigError(f"data.num_classes={num_classes}, data.channels={in_channels}; expected num_classes >= 2 "
                          f"and channels >= 1")


def build_model(
    arch: str, num_classes: int, in_channels: int = 3, image_size: int = 224, dropout: float | None = None
) -> LayeredModel:
    """Build ``arch`` for ``num_classes`` classes and square ``image_size`` inputs with ``in_channels``.

    ``dropout`` overrides the family's classifier dropout (AlexNet/VGG 0.5, MobileNetV2 0.2;
    ResNet has none); 0 makes training deterministic enough to compare strategies step by step.
    """
    check_request(arch, num_classes, in_channels, image_size)
    kwargs = {} if dropout is None or arch.startswith("resnet") else {"dropout": dropout}
    return _BUILDERS[arch](num_classes=num_classes, in_channels=in_channels, small_input=image_size < SMALL_INPUT_BELOW, **kwargs)


__all__ = ["ARCHITECTURES", "LayeredModel", "build_model", "check_request"]
