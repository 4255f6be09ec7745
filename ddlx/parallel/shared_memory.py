"""One copy of the weights for the ranks of one machine, in shared memory, each rank stepping
its own slice (ZeRO-1/2 on shared memory rather than over sockets).

Every rank's parameters are views into one shared buffer. After each backward a rank writes the
parts of its gradient that other ranks own into its slot of a shared gradient buffer; once every
slot is written, rank r adds the others' parts of its 1/P slice to its own and steps the
optimizer on that slice of the shared weights, with the optimizer state of that slice only; once
every slice is stepped, every rank trains on the new weights. Per step each rank publishes
(P-1)/P of its gradient, and the whole model is reduced once and stepped once in total, not once
per rank; the only messages are two tiny barriers. The optimizer is the one the LightningModule configured (any ``torch.optim``
optimizer that updates element by element: SGD, Adam, AdamW, ...), rebuilt over the slice's
views with the same parameter groups and hyperparameters, which are read again at every step
(learning-rate schedules). The checkpoint holds the full state, gathered on save.
"""
from __future__ import annotations

import inspect
import os
import uuid
from collections.abc import Callable, Mapping, Sequence

import torch

SHM_DIR = "/dev/shm"
KERNEL_CHOICE = ("foreach", "fused")  # how an optimizer computes, not what


def shared_file(size: int, dtype: torch.dtype, creator: bool, barrier: Callable[[], None],
                broadcast_name: Callable[[str | None], str], what: str) -> torch.Tensor:
    """``size`` zeroed elements of ``dtype`` that every caller maps from one file in shared
    memory (one machine's processes). The ``creator`` makes the file and ``broadcast_name``
    gives every caller its name; once all have mapped it the file is unlinked, so nothing is
    left behind however the processes end. Collective: every caller, with the same ``size``."""
    folder = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
    name = broadcast_name(os.path.join(folder, f"ddlx-{what}-{uuid.uuid4().hex}") if creator else None)
    if creator:
        with open(name, "wb") as f:
            f.truncate(size * dtype.itemsize)
    barrier()
    if not os.path.exists(name):
        raise RuntimeError(f"the shared {what} {name} are not there: made on another machine?")
    buffer = torch.from_file(name, shared=True, size=size, dtype=dtype)
    barrier()  # everyone has mapped it (from_file would create a new file once it is unlinked)
    if creator:
        os.unlink(name)  # the mappings stay valid
    return buffer


class SharedWeights:
    """``params`` (the model's, on every rank) made views of one shared buffer, stepped by slice.

    ``broadcast_name(name_or_none)`` returns rank 0's name on every rank; ``barrier()`` waits for
    all ranks. Both come from the process group, which carries only these small messages.
    ``owned_rows`` maps the parameters of layers split by rows (:mod:`.split_linear`) to the rows
    of them this rank computes alone: its slice of those parameters is those rows, and their
    gradient reaches it complete, through the leaves :meth:`rows` gives the layers.
    """

    def __init__(self, params: Sequence[torch.Tensor], rank: int, world_size: int, barrier: Callable[[], None],
                 broadcast_name: Callable[[str | None], str],
                 owned_rows: Mapping[torch.Tensor, tuple[int, int]] | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size, self.barrier = rank, world_size, barrier
        rows = {id(p): r for p, r in (owned_rows or {}).items()}
        # Where each parameter lies in the weights and, unless split by rows, in each rank's gradient slot.
        self.offsets, self.slot_offsets, total, averaged = [], [], 0, 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
            self.slot_offsets.append(None if id(p) in rows else averaged)
            averaged += 0 if id(p) in rows else p.numel()
        dtype = self.params[0].dtype  # the model's format (Lightning's *-true precisions convert it), one for all
        if any(p.dtype != dtype for p in self.params):
            raise RuntimeError(f"cpu_mp shares one buffer of one format; the parameters are in {sorted({str(p.dtype) for p in self.params})}")
        buffer = shared_file(total + world_size * averaged, dtype, rank == 0, barrier, broadcast_name, "weights")
        self.weights = buffer[:total]
        self.slots = buffer[total:].view(world_size, averaged)
        if rank == 0:
            for p, o in zip(self.params, self.offsets):
                self.weights[o : o + p.numel()].copy_(p.detach().reshape(-1))  # rank 0's start weights for all
        barrier()
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                p.data = self.weights[o : o + p.numel()].view_as(p)
        # This rank's slice: [a, b) of each parameter's elements (empty: a == b). The averaged
        # parameters are cut in equal runs of their concatenation; the split ones by their rows.
        chunk = -(-averaged // world_size)
        start, stop = min(rank * chunk, averaged), min((rank + 1) * chunk, averaged)
        self.owned: list[tuple[int, int]] = []
        self._leaves: dict[int, torch.Tensor] = {}
        for i, (p, o, s) in enumerate(zip(self.params, self.offsets, self.slot_offsets)):
            if s is None:
                first, last = rows[id(p)]
                per_row = p[0].numel() if p.dim() else 1
                a, b = first * per_row, last * per_row
                self._leaves[i] = self.weights[o + a : o + b].view(last - first, *p.shape[1:]).detach().requires_grad_()
            else:
                a, b = max(start, s) - s, min(stop, s + p.numel()) - s
            self.owned.append((a, b) if a < b else (0, 0))
        self._optimizer: torch.optim.Optimizer | None = None
        self._views: list[torch.Tensor] = []  # the slice optimizer's parameters, one per piece
        self._averaged: dict[int, torch.Tensor] = {}  # this step's averaged gradient of each parameter's part in the slice
        self._pieces: list[tuple[int, int, int, int]] = []  # (group, param index, start, stop) of each slice view

    def rows(self, param: torch.Tensor) -> torch.Tensor:
        """The leaf a split layer computes with: this rank's rows of ``param``, in the shared
        weights, whose gradient :meth:`reduce` takes (the parameter itself gets none)."""
        return self._leaves[next(i for i, p in enumerate(self.params) if p is param)]

    # ---- one step ---------------------------------------------------------------------------
    def reduce(self) -> None:
        """The parts of this rank's gradient other ranks own into its slot; then its own slice
        of the gradient plus every other rank's, averaged, in place: the gradient its slice of
        the optimizer steps with. Each rank writes into shared memory only what others read.
        The rows of split layers need no exchange: this rank's gradient of them is the sum of
        every rank's loss's, divided here by the ranks as the others are averaged."""
        mine = self.slots[self.rank]
        grads = [None if p.grad is None else p.grad.reshape(-1) for p in self.params]
        for grad, p, s, (a, b) in zip(grads, self.params, self.slot_offsets, self.owned):
            if s is None:
                continue
            for lo, hi in ((0, a), (b, p.numel())):
                if lo < hi:
                    if grad is None:
                        mine[s + lo : s + hi].zero_()
                    else:
                        mine[s + lo : s + hi].copy_(grad[lo:hi])
        self.barrier()  # every slot written, and every rank's step done with the previous result
        others = [r for r in range(self.world_size) if r != self.rank]
        self._averaged = {}
        for i, (grad, s, (a, b)) in enumerate(zip(grads, self.slot_offsets, self.owned)):
            if a == b:
                continue
            if s is None:
                leaf = self._leaves[i]
                total = leaf.grad.reshape(-1) if leaf.grad is not None else torch.zeros(b - a, dtype=leaf.dtype)
                leaf.grad = None  # the next backward starts a new one
                total.div_(self.world_size)
            else:
                # Into the rank's own gradient where it has one: its slot's own slice is never touched (nor resident).
                total = grad[a:b] if grad is not None else mine[s + a : s + b].zero_()
                if grad is not None and len(others) == 1:  # (own + other) / 2 in one pass
                    torch.lerp(total, self.slots[others[0], s + a : s + b], 0.5, out=total)
                else:
                    for other in others:
                        total.add_(self.slots[other, s + a : s + b])
                    total.div_(self.world_size)
            self._averaged[i] = total

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer``'s step (its class, groups and current hyperparameters) on this rank's
        slice of the shared weights; returns once every rank's slice is stepped."""
        sliced = self.sliced(optimizer)
        for view, (_, i, _, _) in zip(self._views, self._pieces):
            view.grad = self._averaged[i]
        for group, theirs in zip(sliced.param_groups, self._groups):
            group.update({k: v for k, v in optimizer.param_groups[theirs].items() if k not in ("params", *KERNEL_CHOICE)})
        sliced.step()
        for view in self._views:  # let the gradients go with the model's (zero_grad): not kept through the next backward
            view.grad = None
        self._averaged = {}
        self.barrier()  # every slice stepped: the next forward reads the new weights

    def sliced(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer of this rank's slice: ``optimizer``'s class over views of the shared
        weights (their gradients: this step's averaged slice), grouped as its groups are."""
        if self._optimizer is not None:
            return self._optimizer
        indices = iter(self._indices(optimizer))
        groups, self._groups = [], []
        for g, group in enumerate(optimizer.param_groups):
            views = []
            for p in group["params"]:
                i = next(indices)
                o, (a, b) = self.offsets[i], self.owned[i]
                if a < b:
                    views.append(self.weights[o + a : o + b])  # its gradient: set by each step (reduce)
                    self._pieces.append((len(groups), i, a, b))
            if views:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": views})
                self._groups.append(g)
            self._views += views
        if not groups:  # more ranks than elements: a placeholder group that never changes
            empty = torch.zeros(0)
            empty.grad = torch.zeros(0)
            groups, self._groups = [{**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"},
                                     "params": [empty]}], [0]
        # Each group carries every hyperparameter; the defaults its constructor takes are passed too.
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        self._optimizer = None
        if "fused" in accepted and all(g.get(k) is None for g in groups for k in KERNEL_CHOICE):
            # The kernel left to torch: its fused one, a pass over the slice instead of one per operation.
            try:
                self._optimizer = type(optimizer)([g | {"fused": True} for g in groups], **defaults | {"fused": True})
            except (RuntimeError, ValueError, TypeError):
                self._optimizer = None
        if self._optimizer is None:
            self._optimizer = type(optimizer)(groups, **defaults)
        return self._optimizer

    def _indices(self, optimizer: torch.optim.Optimizer) -> list[int]:
        """The index in :attr:`params` of each of ``optimizer``'s parameters, in its state dict's order."""
        order = {id(p): i for i, p in enumerate(self.params)}
        return [order[id(p)] for g in optimizer.param_groups for p in g["params"]]

    # ---- checkpoints ------------------------------------------------------------------------
    def slice_state(self) -> list[tuple[int, int, int, dict]]:
        """This rank's optimizer state: (param index, start, stop, state) per slice view."""
        if self._optimizer is None:
            return []
        out = []
        for view, (_, i, a, b) in zip(self._views, self._pieces):
            state = self._optimizer.state.get(view, {})
            out.append((i, a, b, {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}))
        return out

    def full_state(self, optimizer: torch.optim.Optimizer, slices: list) -> dict:
        """``optimizer``'s state dict, as if it had stepped the whole model, from every rank's
        :meth:`slice_state`."""
        state: dict[int, dict] = {}
        for i, a, b, part in (piece for rank in slices for piece in rank):
            p = self.params[i]
            into = state.setdefault(i, {})
            for key, value in part.items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == b - a:
                    into.setdefault(key, torch.zeros(p.numel(), dtype=value.dtype))[a:b] = value
                else:
                    into.setdefault(key, value)
        for i, values in state.items():
            for key, value in values.items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == self.params[i].numel():
                    values[key] = value.view_as(self.params[i])
        doc = optimizer.state_dict()
        doc["state"] = {n: state[i] for n, i in enumerate(self._indices(optimizer)) if i in state}
        return doc

    def load_state(self, optimizer: torch.optim.Optimizer, doc: dict) -> None:
        """Resume: ``optimizer``'s hyperparameters from ``doc``, this rank's slice of its state."""
        optimizer.load_state_dict({**doc, "state": {}})
        ids = self._indices(optimizer)
        full = {ids[n]: values for n, values in doc["state"].items()}
        sliced = self.sliced(optimizer)
        for view, (_, i, a, b) in zip(self._views, self._pieces):
            if i in full:
                sliced.state[view] = {k: v.reshape(-1)[a:b].clone() if torch.is_tensor(v) and v.numel() == self.params[i].numel()
                                      else v for k, v in full[i].items()}
