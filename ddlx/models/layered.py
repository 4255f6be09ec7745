"""The model form every strategy relies on: an ordered list of layers with named cut points.

Pipe, split and hybrid strategies cut a model between layers; they ask the model where
(``cut_points``) instead of hard-coding indices.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn


class LayeredModel(nn.Sequential):
    """``nn.Sequential`` plus named cut points.

    ``cut_points[name] = i`` means the model can be cut between layer ``i - 1`` and layer ``i``:
    ``model[:i]`` then ``model[i:]`` computes the same function as ``model``.
    ``split_point`` names the cut used by the two-device split (the Lerat et al. entry, section 2.4).
    """

    def __init__(
        self,
        layers: Iterable[nn.Module],
        cut_points: Mapping[str, int],
        split_point: str,
        arch: str,
        small_input: bool,
    ) -> None:
        super().__init__(*layers)
        n = len(self)
        for name, index in cut_points.items():
            if not 0 < index < n:
                raise ValueError(f"cut point {name!r}={index} must lie strictly inside 0..{n}")
        if split_point not in cut_points:
            raise ValueError(f"split_point {split_point!r} is not one of the cut points {sorted(cut_points)}")
        self.cut_points = dict(cut_points)
        self.split_point = split_point
        self.arch = arch
        self.small_input = small_input

    def __getitem__(self, idx):
        # A slice is a stage of the model, not a model with cut points: a plain Sequential.
        if isinstance(idx, slice):
            return nn.Sequential(*list(self._modules.values())[idx])
        return super().__getitem__(idx)

    @property
    def split_index(self) -> int:
        return self.cut_points[self.split_point]

    def cut(self, name: str) -> tuple[nn.Sequential, nn.Sequential]:
        """The two halves of the model at the named cut point."""
        if name not in self.cut_points:
            raise KeyError(f"{self.arch} has no cut point {name!r}; it has {sorted(self.cut_points)}")
        index = self.cut_points[name]
        return self[:index], self[index:]

    def extra_repr(self) -> str:
        return f"arch={self.arch}, split_point={self.split_point}@{self.split_index}"


def find_layered_model(module: nn.Module) -> LayeredModel:
    """The one :class:`LayeredModel` inside ``module`` (a LightningModule, a wrapper)."""
    found = [m for m in module.modules() if isinstance(m, LayeredModel)]
    if len(found) != 1:
        raise TypeError(f"expected exactly one LayeredModel inside {type(module).__name__}, found {len(found)}")
    return found[0]


def out_of_place(layer: nn.Module) -> None:
    """Have ``layer`` (an activation built with ``inplace=True``) write a new tensor: where its
    input must survive it (a stage's or a recomputed block's input, a profiled layer's)."""
    if getattr(layer, "inplace", False):
        layer.inplace = False


def blocks_between(cuts: Iterable[int], start: int, stop: int) -> list[tuple[int, int]]:
    """The blocks of layers ``start``..``stop`` of a model cut at ``cuts`` (layer indices): the
    units activation checkpointing recomputes."""
    edges = [start, *sorted(c for c in set(cuts) if start < c < stop), stop]
    return list(zip(edges[:-1], edges[1:]))


def flatten_children(*modules: nn.Module) -> list[nn.Module]:
    """Expand ``nn.Sequential`` containers (one level) into their layers."""
    layers: list[nn.Module] = []
    for module in modules:
        if isinstance(module, nn.Sequential):
            layers.extend(module.children())
        else:
            layers.append(module)
    return layers


def conv_cut_points(layers: list[nn.Module], prefix: str = "after_conv") -> dict[str, int]:
    """Cut points after each convolution's activation, named ``after_conv<k>`` (1-based).

    The cut falls after the activation (and pooling, if any) that follows the k-th convolution,
    i.e. just before the next convolution or the end of the feature extractor, which is where
    the paper splits AlexNet and VGG16.
    """
    conv_positions = [i for i, layer in enumerate(layers) if isinstance(layer, nn.Conv2d)]
    points: dict[str, int] = {}
    for k, pos in enumerate(conv_positions, start=1):
        end = conv_positions[k] if k < len(conv_positions) else _end_of_block(layers, pos)
        points[f"{prefix}{k}"] = end
    return points


def _end_of_block(layers: list[nn.Module], pos: int) -> int:
    """Index just past the activation/pooling layers that follow position ``pos``."""
    i = pos + 1
    while i < len(layers) and isinstance(layers[i], (nn.ReLU, nn.MaxPool2d, nn.BatchNorm2d)):
        i += 1
    return i
