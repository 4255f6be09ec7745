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
    def forward(ctx, x, weight, bias, kept):
        ctx.save_for_backward(x, weight)  # through the saved-tensor hooks, so activation checkpointing still recomputes x
        ctx.kept = kept
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.kept.append((x.detach(), grad.detach()))
        return grad @ weight.to(grad.dtype), None, None, None


class DeferredWeightGrads:
    """The ``Linear`` layers of ``modules`` with their weight gradients deferred to :meth:`flush`
    (until :meth:`close` puts their own forward back)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.layers = [m for module in modules for m in module.modules() if type(m) is nn.Linear]
        self.kept: dict[nn.Linear, list[tuple[torch.Tensor, torch.Tensor]]] = {layer: [] for layer in self.layers}
        for layer in self.layers:
            layer.forward = MethodType(self._forward, layer)

    def _forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and layer.weight.requires_grad):
            return F.linear(x, layer.weight, layer.bias)
        return _InputGradOnly.apply(x, layer.weight, layer.bias, self.kept.setdefault(layer, []))

    def flush(self, micro_batches: int | None = None) -> None:
        """Each layer's weight and bias gradient over the last ``micro_batches`` backward passes
        (None: all) kept since the last flush, added to ``.grad`` as autograd would. Before its
        first step, PyTorch's pipeline stage runs one forward and backward of made-up inputs to
        learn the shapes it sends (dynamic metadata inference): what those kept is dropped."""
        for layer, kept in self.kept.items():
            if not kept:
                continue
            if micro_batches:
                del kept[:-micro_batches]
            grads = torch.cat([g.reshape(-1, g.shape[-1]) for _, g in kept])
            inputs = torch.cat([x.reshape(-1, x.shape[-1]) for x, _ in kept]).to(grads.dtype)
            kept.clear()
            _accumulate(layer.weight, (grads.t() @ inputs).to(layer.weight.dtype))
            if layer.bias is not None and layer.bias.requires_grad:  # a frozen bias gets none, as under autograd
                _accumulate(layer.bias, grads.sum(0).to(layer.bias.dtype))

    def close(self) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
            self.kept[layer].clear()


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad.add_(grad)
