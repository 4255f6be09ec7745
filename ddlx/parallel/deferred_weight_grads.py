"""A pipeline stage's fully connected weight gradients computed once per batch, not once per
micro-batch.

Autograd computes a ``Linear``'s weight gradient in every micro-batch's backward (a matrix
product of a few rows) and adds it into ``.grad``: with m micro-batches it writes and reads the
whole gradient about 3m times. For a classifier of wide layers (VGG's 120M weights, AlexNet's
58M) that traffic, not the arithmetic, is most of a stage's backward. Here each micro-batch's
backward computes only the gradient of the layer's input (which the previous stage waits for)
and keeps the layer's input and output gradient, a few rows each; after the schedule, one
product over all the batch's rows gives the weight gradient (the sum of the micro-batches', the
same sum in another order: float rounding apart, the sequential gradient). Zero-bubble
schedules defer weight gradients into the bubble themselves, so they keep autograd's.
"""
from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn


class _InputGradOnly(torch.autograd.Function):
    """``F.linear``, whose backward gives the input's gradient and leaves the weight's and bias's
    to :meth:`DeferredWeightGrads.flush`, keeping what that needs."""

    @staticmethod
    def forward(ctx, x, weight, bias, kept, forward_pass):
        ctx.save_for_backward(x, weight)  # through the saved-tensor hooks, so activation checkpointing still recomputes x
        ctx.kept, ctx.forward_pass = kept, forward_pass
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.kept.append((ctx.forward_pass, x.detach(), grad.detach()))
        return grad @ weight.to(grad.dtype), None, None, None, None


class _Passes:
    """The forward passes with gradients of one of the modules (a stage): what its Linears keep
    is numbered by them, so a flush can tell the passes apart whatever the number of uses of a
    layer in one."""

    def __init__(self) -> None:
        self.run = self.flushed = 0

    def __call__(self, module: nn.Module, args) -> None:  # a forward pre-hook
        if torch.is_grad_enabled():  # not a validation forward
            self.run += 1


class DeferredWeightGrads:
    """The ``Linear`` layers of ``modules`` with their weight gradients deferred to :meth:`flush`
    (until :meth:`close` puts their own forward back)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.layers: list[nn.Linear] = []
        self.kept: dict[nn.Linear, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # (forward pass, input, output grad)
        self._passes_of: dict[nn.Linear, _Passes] = {}
        self._hooks = []
        for module in modules:
            passes = _Passes()
            self._hooks.append(module.register_forward_pre_hook(passes))
            for layer in module.modules():
                if type(layer) is nn.Linear and layer not in self._passes_of:
                    self.layers.append(layer)
                    self.kept[layer], self._passes_of[layer] = [], passes
                    layer.forward = MethodType(self._forward, layer)

    def _forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and layer.weight.requires_grad):
            return F.linear(x, layer.weight, layer.bias)
        passes = self._passes_of.get(layer)  # none for a copy of the model made after this
        return _InputGradOnly.apply(x, layer.weight, layer.bias, self.kept.setdefault(layer, []),
                                    passes.run if passes else 0)

    def flush(self, micro_batches: int | None = None) -> None:
        """Each layer's weight and bias gradient over the last ``micro_batches`` forward passes of
        its module (None: all) since the last flush, added to ``.grad`` as autograd would. Before
        its first step, PyTorch's pipeline stage runs one forward and backward of made-up inputs
        to learn the shapes it sends (dynamic metadata inference): what the passes before the
        last ``micro_batches`` kept is dropped."""
        first_kept = {}  # per module: its first pass to keep (none: all)
        for passes in set(self._passes_of.values()):
            if micro_batches:  # the passes before the last micro_batches: metadata inference's
                first_kept[passes] = passes.flushed + 1 + max(0, passes.run - passes.flushed - micro_batches)
            passes.flushed = passes.run
        for layer, kept in self.kept.items():
            first = first_kept.get(self._passes_of.get(layer), 0)
            entries = [(x, g) for forward_pass, x, g in kept if forward_pass >= first]
            kept.clear()
            if not entries:
                continue
            grads = torch.cat([g.reshape(-1, g.shape[-1]) for _, g in entries])
            inputs = torch.cat([x.reshape(-1, x.shape[-1]) for x, _ in entries]).to(grads.dtype)
            _accumulate(layer.weight, (grads.t() @ inputs).to(layer.weight.dtype))
            if layer.bias is not None and layer.bias.requires_grad:  # a frozen bias gets none, as under autograd
                _accumulate(layer.bias, grads.sum(0).to(layer.bias.dtype))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
            self.kept[layer].clear()


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad.add_(grad)
