"""Data parallelism for the convolutions, model parallelism for the large fully connected layers
(Krizhevsky 2014, "One weird trick for parallelizing convolutional neural networks"), for the
ranks of one machine that share one copy of the weights (cpu_mp).

Under plain data parallelism every rank reads a fully connected layer's whole weight in forward
and again in backward, and writes a whole gradient for it, whatever its share of the batch: for
AlexNet's and VGG's classifiers (54 and 120 M of their 57 and 133 M parameters) that repeated
traffic, not arithmetic, is most of what an extra rank costs. Here each rank computes a block of
the layer's output rows for the whole batch instead: it gathers every rank's inputs, multiplies
them by its rows of the weight, and sends each rank its samples' part of the result. Per step the
weights are read and their gradient written once in all; what travels is activations, a few
hundred KB. Each rank's gradient of its rows is complete without any reduction, and it is the
slice of those parameters the rank steps (:class:`.shared_memory.SharedWeights`).

Every rank must run the same layers on equal shares of the batch (a DistributedSampler's shares
are equal); elementwise layers, dropout and the loss stay with each rank's own samples.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# torch >= 2.14 names the tensor forms of the collectives *_single; earlier ones *_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_to_all = dist.all_to_all_single


def worth_splitting(in_features: int, out_features: int, global_batch: int, world: int) -> bool:
    """Whether splitting a fully connected layer moves fewer bytes per step than every rank
    running all of it (what the recommender assumes too).

    Split, the ranks save (P-1)/P of three passes over the weight (read in forward, read in
    backward, the gradient written); they exchange (P-1)/P of the batch's inputs and outputs,
    twice (forward, backward), each twice over (sent, received).
    """
    if world < 2 or out_features < world:
        return False
    return 3 * in_features * out_features > 4 * global_batch * (in_features + out_features)


class RowSplitLinear(nn.Module):
    """``linear`` computed as one block of its output rows per rank, for the whole batch.

    Keeps ``linear``'s parameters under their names (checkpoints and the shared buffer see the
    whole layer); the rank computes with :attr:`rows`, views of its block that
    :class:`.shared_memory.SharedWeights` makes leaves, whose gradients it steps.
    """

    def __init__(self, linear: nn.Linear, rank: int, world: int, group=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.block = -(-self.out_features // world)  # rows per rank; the last block may be short
        self.first, self.stop = min(rank * self.block, self.out_features), min((rank + 1) * self.block, self.out_features)
        self.world, self.group = world, group
        self.rows: list[torch.Tensor] | None = None  # [weight rows, bias rows]: set by SharedWeights

    def owned_rows(self) -> dict[nn.Parameter, tuple[int, int]]:
        """The rows of each parameter this rank computes the whole gradient of."""
        return {p: (self.first, self.stop) for p in (self.weight, self.bias) if p is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            raise RuntimeError("RowSplitLinear used before SharedWeights gave it its rows")
        weight, bias = self.rows[0], self.rows[1] if len(self.rows) > 1 else None
        everyone = _GatherBatch.apply(x, self.world, self.group)  # [P*b, in]
        mine = F.linear(everyone, weight, bias)  # [P*b, rows]
        if mine.shape[-1] < self.block:  # the short last block, padded to exchange equal pieces
            mine = F.pad(mine, (0, self.block - mine.shape[-1]))
        return _RowsToSamples.apply(mine, self.world, self.group)[..., : self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self.first}..{self.stop}"


def split_linears(model: nn.Module, global_batch: int, rank: int, world: int, group=None) -> list[RowSplitLinear]:
    """Replace in ``model`` each fully connected layer :func:`worth_splitting` by its
    :class:`RowSplitLinear` (same parameters, same names); returns them."""
    split = {}
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and worth_splitting(module.in_features, module.out_features, global_batch, world):
            parent_name, _, child = name.rpartition(".")
            split[name] = RowSplitLinear(module, rank, world, group)
            setattr(model.get_submodule(parent_name) if parent_name else model, child, split[name])
    if split:
        log.info("fully connected layers split by rows between the %d ranks: %s", world,
                 ", ".join(f"{name} ({layer.in_features}x{layer.out_features})" for name, layer in split.items()))
    return list(split.values())


class _GatherBatch(torch.autograd.Function):
    """Every rank's samples, stacked in rank order; backward: each rank's samples' gradient,
    summed over the ranks (each rank's rows contributed to it)."""

    @staticmethod
    def forward(ctx, x, world, group):
        ctx.world, ctx.group = world, group
        x = x.contiguous()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        _all_gather(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // ctx.world, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class _RowsToSamples(torch.autograd.Function):
    """[P*b samples, this rank's block of outputs] to [b own samples, every rank's block]: an
    all-to-all; backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, y, world, group):
        ctx.world, ctx.group = world, group
        y = y.contiguous()
        out = torch.empty_like(y)
        _all_to_all(out, y, group=group)  # sent chunk j: rank j's samples; received chunk j: rank j's block
        b = y.shape[0] // world
        # a tensor of its own, not a view of ``out``: with one sample a rank the reshape would be
        # one, and the next layer's in-place ReLU may not modify a view made inside a Function
        samples = y.new_empty((b, y.numel() // b))
        samples.view(b, world, -1).copy_(out.view(world, b, -1).transpose(0, 1))
        return samples

    @staticmethod
    def backward(ctx, grad):
        world, b = ctx.world, grad.shape[0]
        blocks = grad.reshape(b, world, -1).transpose(0, 1).contiguous()  # [P, b, block]: rank j's block for my samples
        out = torch.empty_like(blocks)
        _all_to_all(out, blocks, group=ctx.group)  # [P, b, block]: my block for rank j's samples
        return out.reshape(world * b, -1), None, None

