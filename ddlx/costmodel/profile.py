"""What a model costs, layer by layer, counted without memory or compute: on PyTorch's meta
device, and on fake tensors (shapes and dtypes only) where autocast must run.

Per top-level layer of the :class:`~ddlx.models.LayeredModel`: parameters, forward FLOPs
(torch's FlopCounterMode; a multiply-add counts 2) and the bytes autograd saves for the backward
pass in its forward (every tensor ``saved_tensors_hooks`` sees, each storage once across the
model, the parameters and autocast's copies of them left out: they are the model state's), all
per sample, in fp32 and under autocast; plus the bytes of the layer's output, which is what
crosses a device boundary when the model is cut after it. The performance and memory models read
only this.
Apart: the size of every tensor a training step allocates (:func:`step_allocations`), which
decides what glibc's allocator maps afresh each step (:func:`mapped_bytes`).
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..models import build_model
from ..models.layered import blocks_between

FLOAT_BYTES = 4
BACKWARD_FLOPS_FACTOR = 2.0  # backward = 2x forward (input and weight gradients)


@dataclass(frozen=True)
class LayerProfile:
    params: int
    forward_flops: float  # per sample
    activation_bytes: int  # per sample: what autograd saves for backward in its forward (the profile's format)
    output_bytes: int  # per sample: what the next layer receives
    linears: tuple[tuple[int, int], ...] = ()  # (in, out) features of each fully connected layer in it
    # The same two under autocast (bf16 and fp16 alike: 2-byte products, fp32 where autocast keeps it).
    mixed_activation_bytes: int = 0
    mixed_output_bytes: int = 0
    # Saved for backward once per batch, whatever its size (batch norm's per-channel statistics).
    fixed_activation_bytes: int = 0
    mixed_fixed_activation_bytes: int = 0


@dataclass(frozen=True)
class ModelProfile:
    arch: str
    image_size: int
    input_bytes: int  # per sample
    layers: tuple[LayerProfile, ...]
    cut_points: tuple[tuple[str, int], ...]
    split_index: int
    param_bytes: int = FLOAT_BYTES  # per parameter, and per gradient and optimizer slot
    cast_bytes: int = 0  # per parameter: a low-precision copy of the weights held through the step (autocast)

    def at(self, numerics) -> ModelProfile:
        """This profile (counted in fp32) in the bytes of ``numerics`` (:mod:`.numerics`): autocast's
        counts for a 2-byte format, mixed or whole (counted alike: the same layers run in it), and
        fp32's at the element's width for another (64-true)."""
        def layer_at(layer: LayerProfile) -> LayerProfile:
            if numerics.activation_bytes == 2:
                return replace(layer, activation_bytes=layer.mixed_activation_bytes, output_bytes=layer.mixed_output_bytes,
                               fixed_activation_bytes=layer.mixed_fixed_activation_bytes)
            width = numerics.activation_bytes
            return replace(layer, activation_bytes=layer.activation_bytes * width // FLOAT_BYTES,
                           output_bytes=layer.output_bytes * width // FLOAT_BYTES,
                           fixed_activation_bytes=layer.fixed_activation_bytes * width // FLOAT_BYTES)

        return replace(self, input_bytes=self.input_bytes * numerics.input_bytes // FLOAT_BYTES,
                       layers=tuple(layer_at(layer) for layer in self.layers),
                       param_bytes=numerics.param_bytes, cast_bytes=numerics.cast_bytes)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def gradient_mb(self) -> float:
        return self.params * self.param_bytes / 1e6

    @property
    def layer_mb(self) -> list[float]:
        """Each top-level layer's parameters (or gradients) in MB, in the model's order."""
        return [layer.params * self.param_bytes / 1e6 for layer in self.layers]

    def state_bytes(self, params: int) -> int:
        """What ``params`` of the model's parameters hold through a step: weights, gradients and
        momentum (SGD's one slot), and autocast's copies of the weights."""
        return params * (3 * self.param_bytes + self.cast_bytes)

    @property
    def forward_flops_per_sample(self) -> float:
        return sum(layer.forward_flops for layer in self.layers)

    @property
    def train_flops_per_sample(self) -> float:
        return (1 + BACKWARD_FLOPS_FACTOR) * self.forward_flops_per_sample

    @property
    def activation_bytes_per_sample(self) -> int:
        return self.kept_bytes()

    @property
    def fixed_activation_bytes(self) -> int:
        """What a training step saves for backward once per batch, whatever its size."""
        return sum(layer.fixed_activation_bytes for layer in self.layers)

    def kept_bytes(self, start: int = 0, stop: int | None = None, recompute: bool = False) -> int:
        """Per sample: what layers ``start``..``stop`` keep for backward (a layer's input among
        them when it saves it: the model's, a stage's received one); with ``recompute``
        (activation checkpointing at the cut points) each block's input, and one block's
        activations at a time while backward recomputes it."""
        stop = len(self.layers) if stop is None else stop
        if recompute:
            return self.block_inputs_bytes(start, stop) + self.largest_block_bytes(start, stop)
        return sum(layer.activation_bytes for layer in self.layers[start:stop])

    def _blocks(self, start: int, stop: int) -> list[tuple[int, int]]:
        return blocks_between((index for _, index in self.cut_points), start, stop)

    def block_inputs_bytes(self, start: int, stop: int) -> int:
        """Per sample: the inputs of the blocks of layers ``start``..``stop``, kept under recomputation."""
        return sum(self.input_bytes if a == 0 else self.layers[a - 1].output_bytes for a, _ in self._blocks(start, stop))

    def largest_block_bytes(self, start: int, stop: int) -> int:
        """Per sample: the activations of the largest block of layers ``start``..``stop``."""
        return max(sum(layer.activation_bytes for layer in self.layers[a:b]) for a, b in self._blocks(start, stop))

    def partitions(self, balance: list[int]) -> list[tuple[LayerProfile, ...]]:
        if sum(balance) != len(self.layers):
            raise ValueError(f"balance {balance} does not cover the {len(self.layers)} layers of {self.arch}")
        parts, start = [], 0
        for count in balance:
            parts.append(self.layers[start : start + count])
            start += count
        return parts

    def boundary_bytes(self, balance: list[int]) -> list[int]:
        """Per sample: the activation sent from partition i to i + 1 (its gradient comes back)."""
        ends = [sum(balance[: i + 1]) for i in range(len(balance) - 1)]
        return [self.layers[end - 1].output_bytes for end in ends]

    def even_balance(self, parts: int) -> list[int]:
        """Layers per partition so forward FLOPs are as even as contiguous runs allow (fairscale's
        balance-by-time does this with measured times; FLOPs stand in for them here)."""
        flops = [max(layer.forward_flops, 1.0) for layer in self.layers]
        total, balance, acc, count = sum(flops), [], 0.0, 0
        for i, f in enumerate(flops):
            remaining_layers, remaining_parts = len(flops) - i, parts - len(balance)
            if count and (acc + f / 2 > total * (len(balance) + 1) / parts or remaining_layers < remaining_parts):
                balance.append(count)
                count = 0
            acc += f
            count += 1
        balance.append(count)
        while len(balance) < parts:  # tiny models: split the largest partition
            i = max(range(len(balance)), key=lambda k: balance[k])
            balance[i : i + 1] = [balance[i] - balance[i] // 2, balance[i] // 2]
        return balance


@lru_cache(maxsize=1)
def _code_key() -> str:
    """What a profile depends on besides its arguments: torch (its FLOP counting), the model
    builders and this counting code. A cached profile from other code is not read."""
    digest = hashlib.sha256(torch.__version__.encode())
    models = Path(__file__).resolve().parents[1] / "models"
    for source in [*sorted(models.glob("*.py")), Path(__file__).resolve()]:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _cache_path(arch: str, num_classes: int, in_channels: int, image_size: int) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "ddlx" / "profiles" / f"{arch}-{num_classes}-{in_channels}-{image_size}-{_code_key()}.json"


@lru_cache(maxsize=64)
def profile_model(arch: str, num_classes: int, in_channels: int, image_size: int) -> ModelProfile:
    """The model's profile, kept on disk (``$XDG_CACHE_HOME/ddlx/profiles``): recommend.py profiles
    every measured workload's model, about 0.1 s each, on every call."""
    path = _cache_path(arch, num_classes, in_channels, image_size)
    try:
        kept = json.loads(path.read_text())
        return ModelProfile(**{**kept, "layers": tuple(LayerProfile(**{**layer, "linears": tuple(map(tuple, layer["linears"]))})
                                                       for layer in kept["layers"]),
                               "cut_points": tuple(tuple(point) for point in kept["cut_points"])})
    except (OSError, ValueError, TypeError, KeyError):
        pass  # not kept yet, or unreadable: count it again
    profile = _count_profile(arch, num_classes, in_channels, image_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent writers: each renames its own whole file
        partial.write_text(json.dumps(asdict(profile)))
        os.replace(partial, path)
    except OSError:
        pass  # a read-only home: counted on every call, as before
    return profile


def _count_profile(arch: str, num_classes: int, in_channels: int, image_size: int) -> ModelProfile:
    with torch.device("meta"):  # eval: batch norm of one sample at 1x1 px has no batch statistics (the FLOPs are the same)
        model = build_model(arch, num_classes, in_channels, image_size).eval()
    x = torch.empty(1, in_channels, image_size, image_size, device="meta")
    flops = []
    with torch.no_grad():
        for layer in model:
            with FlopCounterMode(display=False) as counter:
                x = layer(x)
            flops.append(float(counter.get_total_flops()))
    fp32, mixed = saved_by_layer(arch, num_classes, in_channels, image_size)
    layers = [LayerProfile(
        params=sum(p.numel() for p in layer.parameters()),
        forward_flops=flops[i],
        activation_bytes=fp32.per_sample[i],
        output_bytes=fp32.outputs[i],
        linears=tuple((m.in_features, m.out_features) for m in layer.modules() if isinstance(m, nn.Linear)),
        mixed_activation_bytes=mixed.per_sample[i],
        mixed_output_bytes=mixed.outputs[i],
        fixed_activation_bytes=fp32.fixed[i],
        mixed_fixed_activation_bytes=mixed.fixed[i],
    ) for i, layer in enumerate(model)]
    return ModelProfile(
        arch=arch,
        image_size=image_size,
        input_bytes=in_channels * image_size * image_size * FLOAT_BYTES,
        layers=tuple(layers),
        cut_points=tuple(sorted(model.cut_points.items(), key=lambda kv: kv[1])),
        split_index=model.split_index,
    )


def mapped_bytes(arch: str, num_classes: int, in_channels: int, image_size: int, batch: int, ceiling: int) -> int:
    """Bytes of one training step's tensors at ``batch`` samples that are ``ceiling`` bytes or
    larger: what glibc's default allocator maps afresh, and page-faults in, every step."""
    sizes = (fixed + batch * per_sample for fixed, per_sample in step_allocations(arch, num_classes, in_channels, image_size))
    return sum(size for size in sizes if size >= ceiling)


class _FreshTensors(TorchDispatchMode):
    """The bytes of every tensor an op allocates (views and in-place results are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(ret.alias_info is not None for ret in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.sizes.append(t.numel() * t.element_size())
        return out


@lru_cache(maxsize=64)
def step_allocations(arch: str, num_classes: int, in_channels: int, image_size: int) -> tuple[tuple[int, int], ...]:
    """Every tensor one training step allocates (forward, loss, backward), traced on the meta
    device at batches 2 and 4 (batch 1 would trip batch norm on 1x1 maps): each as bytes at any
    batch plus bytes per sample (activations scale with the batch, weight gradients do not).
    Apart from :func:`profile_model`, which the predictions need for every workload: this trace
    takes up to a second on deep networks and only the allocator advice reads it."""
    with torch.device("meta"):
        model = build_model(arch, num_classes, in_channels, image_size)

    def sizes(batch: int) -> list[int]:
        x = torch.empty(batch, in_channels, image_size, image_size, device="meta")
        y = torch.zeros(batch, dtype=torch.long, device="meta")
        with _FreshTensors() as fresh:
            nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad = None
        return fresh.sizes

    two, four = sizes(2), sizes(4)
    if len(two) != len(four):  # the step's ops depend on the batch: nothing to scale from
        return ()
    return tuple((2 * a - b, (b - a) // 2) for a, b in zip(two, four))


# Batches a training forward is counted at: per sample is their difference (batch norm trips on
# one sample where a map is 1x1), the rest is saved once per batch.
SAVED_BATCHES = (2, 4)


@dataclass(frozen=True)
class SavedBytes:
    """Per top-level layer: bytes saved for backward per sample and per batch, and output bytes per sample."""

    per_sample: list[int]
    fixed: list[int]
    outputs: list[int]


def saved_by_layer(arch: str, num_classes: int, in_channels: int, image_size: int) -> tuple[SavedBytes, SavedBytes]:
    """What each top-level layer's training forward saves for backward, in fp32 and under CPU
    autocast to bf16 (whose choice of ops in 2 bytes stands in for the GPU's), each counted at two
    batches. On fake tensors: no memory, no compute; autocast runs on them, where the meta device
    has none. One model serves the four forwards: building it on fake tensors costs as much as one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = build_model(arch, num_classes, in_channels, image_size).train()
        return tuple(_saved_bytes(model, in_channels, image_size, mixed) for mixed in (False, True))


def _saved_bytes(model: nn.Module, in_channels: int, image_size: int, mixed: bool) -> SavedBytes:
    (saved_a, out_a), (saved_b, out_b) = (_saved_at(model, in_channels, image_size, mixed, batch) for batch in SAVED_BATCHES)
    a, b = SAVED_BATCHES
    per_sample = [(y - x) // (b - a) for x, y in zip(saved_a, saved_b)]
    return SavedBytes(per_sample, [max(0, x - a * p) for x, p in zip(saved_a, per_sample)],
                      [(y - x) // (b - a) for x, y in zip(out_a, out_b)])


class _WeightCopies(TorchDispatchMode):
    """The storages of the copies autocast makes of the parameters (counted with the weights)."""

    def __init__(self, parameters: set[int]) -> None:
        super().__init__()
        self.parameters, self.copies = parameters, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage()._cdata in self.parameters:
            self.copies.add(out.untyped_storage()._cdata)
        return out


def _saved_at(model: nn.Module, in_channels: int, image_size: int, mixed: bool, batch: int) -> tuple[list[int], list[int]]:
    """Per top-level layer of ``model`` (on fake tensors) at ``batch`` samples: the bytes of the
    storages autograd saves in its forward that no earlier layer saved, the parameters and
    autocast's copies of them left out, and the bytes of its output."""
    x = torch.empty(batch, in_channels, image_size, image_size)
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    seen, saved, outputs, layer_saved = set(parameters), [], [], [0]
    copies = _WeightCopies(parameters)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in seen and storage._cdata not in copies.copies:
            seen.add(storage._cdata)
            layer_saved[0] += storage.nbytes()
        return tensor

    autocast = torch.autocast("cpu", torch.bfloat16) if mixed else nullcontext()
    with copies, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        for layer in model:
            layer_saved[0] = 0
            x = layer(x)
            saved.append(layer_saved[0])
            outputs.append(x.numel() * x.element_size())
    return saved, outputs
