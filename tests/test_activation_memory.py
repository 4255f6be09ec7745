"""Activation memory as autograd keeps it: the profile's count (fake tensors, per layer, per sample
and per batch) against what a real training forward on the CPU keeps for backward, for every
network at two image sizes, in fp32 and bf16-mixed, with recomputation off and on."""
from __future__ import annotations

import weakref
from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddlx.models import build_model
from ddlx.models.layered import blocks_between
from ddlx.parallel.recompute import recompute_blocks
from ddlx.costmodel.memory import estimate_training_memory
from ddlx.costmodel.profile import profile_model

NETWORKS = ("alexnet", "vgg11", "vgg16", "resnet18", "resnet50", "resnet152", "mobilenet_v2")
BATCH = 3  # neither of the profile's own counting batches
TOLERANCE = 0.05


class _Alive(TorchDispatchMode):
    """Every tensor the forward makes, weakly: what is still alive once it returns is what the
    graph keeps for backward (or the caller holds); and the storages of the copies autocast makes
    of the weights (``weights``: their storages), which the weights' memory counts."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []
        self.weights, self.weight_copies = weights, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.weights:
            self.weight_copies.add(out.untyped_storage().data_ptr())
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t))
        return out


def kept_alive(model, x: torch.Tensor) -> int:
    """Bytes of the storages a real training forward in fp32 leaves alive, but the weights and
    the output: what the graph keeps for backward (saved tensors, a checkpoint's inputs)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    alive = _Alive(weights)
    with alive:
        x = x.clone()  # made inside: counted when something keeps it
        out = model(x)
    left_out = weights | {out.untyped_storage().data_ptr()}
    storages = {}
    for ref in alive.made:
        t = ref()
        if t is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in left_out)


def saved_for_backward(model, x: torch.Tensor, mixed: bool) -> int:
    """Bytes of every tensor autograd saves for backward in a real training forward, each storage
    once, but the weights and autocast's copies of them (counted with the weights)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tracker = _Alive(weights)
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr not in weights and ptr not in tracker.weight_copies:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", torch.bfloat16) if mixed else nullcontext()
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(x)
    return total[0]


@pytest.mark.parametrize("arch", NETWORKS)
@pytest.mark.parametrize("size,precision", [
    (32, "32-true"), (32, "bf16-mixed"), (64, "32-true"),
    pytest.param(64, "bf16-mixed", marks=pytest.mark.slow),  # bf16 on a CPU without bf16 units: slow
])
def test_the_counted_activations_are_what_autograd_saves(arch, size, precision):
    torch.manual_seed(0)
    model = build_model(arch, 3, 3, size).train()
    kept = saved_for_backward(model, torch.randn(BATCH, 3, size, size), mixed=precision == "bf16-mixed")
    estimate, _ = estimate_training_memory(arch, 3, 3, size, BATCH, precision=precision)
    assert abs(estimate.activations_bytes / kept - 1) <= TOLERANCE, (estimate.activations_bytes, kept)


@pytest.mark.integration
@pytest.mark.parametrize("arch", NETWORKS)
def test_recomputed_blocks_keep_only_their_inputs(arch):
    """With activation checkpointing at the cut points a forward keeps each block's input;
    backward then recomputes one block at a time, whose activations the per-layer counts above hold."""
    size = 64
    torch.manual_seed(0)
    model = build_model(arch, 3, 3, size).train()
    blocks = blocks_between(model.cut_points.values(), 0, len(model))
    recompute_blocks(model, blocks)
    kept = kept_alive(model, torch.randn(BATCH, 3, size, size))
    profile = profile_model(arch, 3, 3, size)
    inputs = profile.block_inputs_bytes(0, len(profile.layers))
    assert abs(inputs * BATCH / kept - 1) <= TOLERANCE, (inputs * BATCH, kept)
