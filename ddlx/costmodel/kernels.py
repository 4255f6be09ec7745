"""The kernels one training step of a model runs, per top-level layer and pass, traced on fake
tensors (shapes and dtypes, no memory, no compute): each matrix product (a convolution, a
fully connected layer) with its FLOPs, the bytes it reads and writes and a convolution's input
channels, the other operations as the bytes they move (batch normalization's and max pooling's
told apart: they reach less of the bandwidth than element-wise kernels), and how many kernels
there are. In fp32 and under autocast (2-byte products), per sample and per step (what does not
grow with the batch: the weights). The GPU time model (:mod:`.gpu_time`) reads only this.

Each layer is traced as a pipeline stage runs it: its input a leaf that needs a gradient (but
the first layer's, whose input gradient training never computes), so its backward is its own.
"""
from __future__ import annotations

import json
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..models import build_model
from .profile import _cache_path

BATCHES = (2, 4)  # per sample is their difference; the rest is per step
CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
NORMALIZATION = {torch.ops.aten.native_batch_norm, torch.ops.aten._native_batch_norm_legit,
                 torch.ops.aten._native_batch_norm_legit_functional, torch.ops.aten.native_batch_norm_backward}
POOLING = {torch.ops.aten.max_pool2d_with_indices, torch.ops.aten.max_pool2d_with_indices_backward}
PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.convolution,
            torch.ops.aten.convolution_backward}


@dataclass(frozen=True)
class Product:
    """A matrix-product kernel (or the pair of a convolution's backward)."""

    kind: str  # convolution | matmul (a fully connected layer)
    flops: float  # per sample
    bytes: float  # per sample: activations read and written
    fixed_bytes: float  # per step: the weights read, their gradient written
    winograd: float  # the share of its operations cuDNN may run as Winograd (a dense 3x3 stride-1 convolution's
    #                  forward and input gradient; not its weight gradient)
    dense: bool  # not grouped (depthwise convolutions are bound by memory, not by the product units)
    channels_in: int  # a convolution's input channels per group (an image's 3 are too few for the product units' tiles)


@dataclass(frozen=True)
class PassKernels:
    products: tuple[Product, ...]
    memory_bytes: float  # per sample: what the other kernels read and write
    memory_fixed_bytes: float  # per step
    kernels: int  # launches, products included
    normalization_bytes: float  # per sample: the share of memory_bytes batch normalization moves
    pooling_bytes: float  # per sample: the share max pooling moves (its backward scatters through indices)


@dataclass(frozen=True)
class LayerKernels:
    forward: PassKernels
    backward: PassKernels


@dataclass(frozen=True)
class KernelProfile:
    arch: str
    image_size: int
    mixed: bool  # under autocast to a 2-byte format
    params: int
    layers: tuple[LayerKernels, ...]


@lru_cache(maxsize=64)
def kernel_profile(arch: str, num_classes: int, in_channels: int, image_size: int, mixed: bool) -> KernelProfile:
    """The model's kernels, kept on disk beside its profile (:func:`.profile.profile_model`)."""
    path = _cache_path(arch, num_classes, in_channels, image_size).with_suffix(f".kernels-{int(mixed)}.json")
    try:
        return _from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        pass
    profile = _trace(arch, num_classes, in_channels, image_size, mixed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(asdict(profile)))
        os.replace(partial, path)
    except OSError:
        pass
    return profile


def _from_json(kept: dict) -> KernelProfile:
    def passes(p: dict) -> PassKernels:
        return PassKernels(tuple(Product(**q) for q in p["products"]), p["memory_bytes"], p["memory_fixed_bytes"], p["kernels"],
                           p["normalization_bytes"], p["pooling_bytes"])

    return KernelProfile(kept["arch"], kept["image_size"], kept["mixed"], kept["params"],
                         tuple(LayerKernels(passes(layer["forward"]), passes(layer["backward"])) for layer in kept["layers"]))


@dataclass
class _Op:
    product: str  # "" for a kernel that is no product
    flops: float
    bytes: float
    weight_bytes: float
    winograd: float
    dense: bool
    memory_kind: str = ""  # of a kernel that is no product: normalization | pooling | "" (element-wise and the rest)
    channels_in: int = 0


class _Recorder(TorchDispatchMode):
    """Every kernel an operation launches: views and metadata changes launch none."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.weights, self.ops = weights, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(ret.alias_info is not None for ret in func._schema.returns) or func is torch.ops.aten.detach.default:
            return out
        tensors_in = [t for t in _tensors(args) + _tensors(kwargs)]
        tensors_out = _tensors(out)
        if not tensors_out:
            return out
        weight = sum(_nbytes(t) for t in tensors_in if t.untyped_storage()._cdata in self.weights)
        moved = sum(_nbytes(t) for t in tensors_in + tensors_out)
        packet = func.overloadpacket
        if packet in PRODUCTS:
            flops = _flops(func, args, kwargs, out)
            winograd, dense = _convolution_shape(func, args)
            kind = "convolution" if func in CONVOLUTIONS else "matmul"
            channels = 0
            if kind == "convolution":  # the weight's second dimension: input channels per group
                channels = int((args[2] if func is torch.ops.aten.convolution_backward.default else args[1]).shape[1])
            self.ops.append(_Op(kind, float(flops), moved - weight, weight, winograd, dense, channels_in=channels))
        else:
            kind = "normalization" if packet in NORMALIZATION else "pooling" if packet in POOLING else ""
            self.ops.append(_Op("", 0.0, moved - weight, weight, 0.0, True, kind))
        return out


def _flops(func, args, kwargs, out) -> float:
    """A product's FLOPs (a multiply-add counts 2). A convolution's backward counts as its forward
    once per gradient it computes: torch's counter overcounts grouped (depthwise) ones."""
    if func is torch.ops.aten.convolution_backward.default:
        grad_out, x, weight, _bias, stride, padding, dilation, transposed, output_padding, groups, mask = args[:11]
        forward = flop_registry[torch.ops.aten.convolution](x, weight, None, stride, padding, dilation, transposed,
                                                            output_padding, groups, out_val=grad_out)
        return float(forward * (int(mask[0]) + int(mask[1])))
    return float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _convolution_shape(func, args) -> tuple[float, bool]:
    """(The share of its operations Winograd may run: a dense 3x3 convolution of stride 1's
    forward and input gradient, not its weight gradient; dense: not grouped)."""
    if func not in CONVOLUTIONS:
        return 0.0, True
    backward = func is torch.ops.aten.convolution_backward.default
    weight = args[2] if backward else args[1]
    stride, groups = (args[4], args[9]) if backward else (args[3], args[8])
    dense = groups == 1
    if not (dense and tuple(weight.shape[-2:]) == (3, 3) and all(s == 1 for s in stride)):
        return 0.0, dense
    if not backward:
        return 1.0, dense
    mask = args[10]
    return (int(mask[0]) / (int(mask[0]) + int(mask[1])) if mask[0] or mask[1] else 0.0), dense


def _trace(arch: str, num_classes: int, in_channels: int, image_size: int, mixed: bool) -> KernelProfile:
    """The training step traced on fake tensors at both batches, on one model: building it on fake
    tensors costs as much as a step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = build_model(arch, num_classes, in_channels, image_size).train()
        traced = [_trace_at(model, in_channels, image_size, mixed, batch) for batch in BATCHES]
        params = sum(p.numel() for p in model.parameters())
    (a, ops_a), (b, ops_b) = traced[0], traced[1]
    layers = []
    for layer_a, layer_b in zip(ops_a, ops_b):
        passes = []
        for pass_a, pass_b in zip(layer_a, layer_b):
            if len(pass_a) != len(pass_b):
                raise ValueError(f"{arch}: the kernels of a training step depend on the batch; cannot scale them")
            passes.append(_scaled(pass_a, pass_b, a, b))
        layers.append(LayerKernels(*passes))
    return KernelProfile(arch, image_size, mixed, params, tuple(layers))


def _scaled(ops_a: list[_Op], ops_b: list[_Op], a: int, b: int) -> PassKernels:
    """One pass's kernels at batches ``a`` and ``b``: per sample (their difference) and per step."""
    def per_sample(x: float, y: float) -> float:
        return (y - x) / (b - a)

    def fixed(p: _Op, q: _Op) -> float:  # the weights read, and what does not grow with the batch (their gradient)
        return p.weight_bytes + max(0.0, p.bytes - a * per_sample(p.bytes, q.bytes))

    products = tuple(Product(p.product, per_sample(p.flops, q.flops), per_sample(p.bytes, q.bytes), fixed(p, q), p.winograd,
                             p.dense, p.channels_in) for p, q in zip(ops_a, ops_b) if p.product)
    memory = [(p, q) for p, q in zip(ops_a, ops_b) if not p.product]

    def of_kind(kind: str) -> float:
        return sum(per_sample(p.bytes, q.bytes) for p, q in memory if p.memory_kind == kind)

    return PassKernels(products, sum(per_sample(p.bytes, q.bytes) for p, q in memory), sum(fixed(p, q) for p, q in memory),
                       len(ops_a), of_kind("normalization"), of_kind("pooling"))


def _trace_at(model: nn.Module, in_channels: int, image_size: int, mixed: bool, batch: int):
    """Per layer of ``model`` (on fake tensors), (forward ops, backward ops) of a training step at
    ``batch`` samples; the loss's go with the last layer. The weights' gradients are dropped after
    it, so that the next step's backward writes them afresh rather than adding to them."""
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    x = torch.empty(batch, in_channels, image_size, image_size)
    y = torch.zeros(batch, dtype=torch.long)
    autocast = torch.autocast("cpu", torch.bfloat16) if mixed else nullcontext()
    traced = []
    inputs, outputs = [], []
    for i, layer in enumerate(model):
        leaf = x.detach().requires_grad_(i > 0)
        start = leaf.clone() if i > 0 else leaf  # an in-place head must not write into the leaf
        with _Recorder(weights) as forward, autocast:
            out = layer(start)
            if i == len(model) - 1:
                out = torch.nn.functional.cross_entropy(out, y)
        inputs.append(leaf)
        outputs.append(out)
        traced.append([forward.ops, []])
        x = out
    grad = None
    for i in reversed(range(len(model))):
        with _Recorder(weights) as backward:
            torch.autograd.backward(outputs[i], grad)
        traced[i][1] = backward.ops
        grad = inputs[i].grad
    model.zero_grad(set_to_none=True)
    return batch, traced
