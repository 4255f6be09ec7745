"""Activation checkpointing at the model's cut points (``strategy.checkpoint=always`` of ddp_*,
fsdp and pipe engine=torch).

The layers between two cut points (a convolution with its activation and pooling, a residual
block) form a block; in training each block keeps only its input for backward, and backward
runs its forward again to get the rest (``torch.utils.checkpoint``, non-reentrant: it works
under DDP's hooks and FSDP2's per-layer gathers, and replays the RNG so dropout draws the same
mask). The forward is replaced on the module, as the network strategies do, so parameter names
stay those of the sequential model. A recomputed BatchNorm would update its running statistics
a second time: they are put back after each recomputation, so the statistics are those of one
forward, as without checkpointing.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models.layered import blocks_between, out_of_place

_state = threading.local()  # while this thread recomputes a block in backward: the statistics to put back

RUNNING = ("running_mean", "running_var", "num_batches_tracked")


class _Recomputing:
    """A block's recomputation; the BatchNorm statistics it updated are put back when it ends
    (PyTorch may stop a recomputation early, inside a layer, once it has what backward needs).
    Entered once per backward pass through the block: the zero-bubble schedule's input and
    weight gradients are two passes, so it recomputes twice."""

    def __enter__(self) -> None:
        _state.saved = {}

    def __exit__(self, *_exc) -> None:
        saved, _state.saved = _state.saved, None
        with torch.no_grad():
            for module, values in saved.values():
                for name, value in zip(RUNNING, values):
                    getattr(module, name).copy_(value)


def _contexts():
    return nullcontext(), _Recomputing()


class _OneStatisticsUpdate:
    """BatchNorm layers of ``module`` keep the running statistics of the first forward of a step:
    a recomputation saves them before it updates them (and :class:`_Recomputing` puts them back)."""

    def __init__(self, module: nn.Module) -> None:
        norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self.hooks = [m.register_forward_pre_hook(self._keep) for m in norms]

    @staticmethod
    def _keep(module, _inputs) -> None:
        saved = getattr(_state, "saved", None)
        if saved is not None and module.training and id(module) not in saved:
            saved[id(module)] = (module, [getattr(module, name).clone() for name in RUNNING])


def recompute_blocks(layers: nn.Sequential, blocks: Sequence[tuple[int, int]]) -> None:
    """``layers`` (a model or a stage of one) runs each of ``blocks`` (index ranges into it)
    under activation checkpointing when gradients are on."""
    parts = [layers[a:b] if b - a > 1 else layers[a] for a, b in blocks]
    for part in parts:  # an in-place head would overwrite the one input the block keeps
        out_of_place(part[0] if isinstance(part, nn.Sequential) else part)
    keeper = _OneStatisticsUpdate(layers)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            for part in parts:
                x = part(x)
            return x
        for part in parts:
            x = checkpoint(part, x, use_reentrant=False, context_fn=_contexts)
        return x

    layers.forward = forward
    layers._ddlx_recompute = keeper  # the hooks live as long as the layers


def recompute_at_cut_points(module: nn.Module) -> None:
    """The network inside ``module`` (a LightningModule) recomputes each block between its cut points."""
    from ..models.layered import find_layered_model  # names what it found instead

    model = find_layered_model(module)
    recompute_blocks(model, blocks_between(model.cut_points.values(), 0, len(model)))
