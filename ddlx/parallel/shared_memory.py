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
from collections.abc import Callable, Sequence

import torch

SHM_DIR = "/dev/shm"
KERNEL_CHOICE = ("foreach", "fused")  # how an optimizer computes, not what


class SharedWeights:
    """``params`` (the model's, on every rank) made views of one shared buffer, stepped by slice.

    ``broadcast_name(name_or_none)`` returns rank 0's name on every rank; ``barrier()`` waits for
    all ranks. Both come from the process group, which carries only these small messages.
    """

    def __init__(self, params: Sequence[torch.Tensor], rank: int, world_size: int, barrier: Callable[[], None],
                 broadcast_name: Callable[[str | None], str]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size, self.barrier = rank, world_size, barrier
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        folder = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
        name = broadcast_name(os.path.join(folder, f"ddlx-weights-{uuid.uuid4().hex}") if rank == 0 else None)
        size = (1 + world_size) * total
        dtype = self.params[0].dtype  # the model's format (Lightning's *-true precisions convert it), one for all
        if any(p.dtype != dtype for p in self.params):
            raise RuntimeError(f"cpu_mp shares one buffer of one format; the parameters are in {sorted({str(p.dtype) for p in self.params})}")
        if rank == 0:
            with open(name, "wb") as f:
                f.truncate(size * dtype.itemsize)
        barrier()
        if not os.path.exists(name):
            raise RuntimeError(f"cpu_mp rank {rank}: rank 0's shared weights {name} are not there (another machine?)")
        buffer = torch.from_file(name, shared=True, size=size, dtype=dtype)
        barrier()  # every rank has mapped it (from_file would create a new file once it is unlinked)
        self.weights = buffer[:total]
        self.slots = buffer[total:].view(world_size, total)
        if rank == 0:
            os.unlink(name)  # the mapping stays valid; nothing is left behind if a rank dies
            for p, o in zip(self.params, self.offsets):
                self.weights[o : o + p.numel()].copy_(p.detach().reshape(-1))  # rank 0's start weights for all
        barrier()
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                p.data = self.weights[o : o + p.numel()].view_as(p)
        chunk = -(-total // world_size)
        self.start, self.stop = min(rank * chunk, total), min((rank + 1) * chunk, total)
        self._optimizer: torch.optim.Optimizer | None = None
        self._views: list[torch.Tensor] = []  # the slice optimizer's parameters, one per piece
        self._averaged: dict[int, torch.Tensor] = {}  # this step's averaged gradient of each parameter's part in the slice
        self._pieces: list[tuple[int, int, int, int]] = []  # (group, param index, start, stop) of each slice view

    # ---- one step ---------------------------------------------------------------------------
    def reduce(self) -> None:
        """The parts of this rank's gradient other ranks own into its slot; then its own slice
        of the gradient plus every other rank's, averaged, in place: the gradient its slice of
        the optimizer steps with. Each rank writes into shared memory only what others read."""
        mine = self.slots[self.rank]
        grads = [None if p.grad is None else p.grad.reshape(-1) for p in self.params]
        for grad, (a, b), o in self._outside(grads):
            if grad is None:
                mine[a:b].zero_()
            else:
                mine[a:b].copy_(grad[a - o : b - o])
        self.barrier()  # every slot written, and every rank's step done with the previous result
        others = [r for r in range(self.world_size) if r != self.rank]
        self._averaged = {}
        for i, (grad, (a, b), o) in self._inside(grads):
            # Into the rank's own gradient where it has one: its slot's own slice is never touched (nor resident).
            total = grad[a - o : b - o] if grad is not None else mine[a:b].zero_()
            if grad is not None and len(others) == 1:  # (own + other) / 2 in one pass
                torch.lerp(total, self.slots[others[0], a:b], 0.5, out=total)
            else:
                for other in others:
                    total.add_(self.slots[other, a:b])
                total.div_(self.world_size)
            self._averaged[i] = total

    def _outside(self, grads):
        """(gradient, a flat range of it outside this rank's slice, its offset), every parameter."""
        for grad, p, o in zip(grads, self.params, self.offsets):
            for a, b in ((o, min(o + p.numel(), self.start)), (max(o, self.stop), o + p.numel())):
                if a < b:
                    yield grad, (a, b), o

    def _inside(self, grads):
        """(index, (gradient, its flat range inside this rank's slice, its offset)), every parameter."""
        for i, (grad, p, o) in enumerate(zip(grads, self.params, self.offsets)):
            a, b = max(o, self.start), min(o + p.numel(), self.stop)
            if a < b:
                yield i, (grad, (a, b), o)

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
                o = self.offsets[i]
                a, b = max(o, self.start), min(o + p.numel(), self.stop)
                if a < b:
                    views.append(self.weights[a:b])  # its gradient: set by each step (reduce)
                    self._pieces.append((len(groups), i, a - o, b - o))
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
