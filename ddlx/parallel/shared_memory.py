"""Gradient averaging between processes of one machine through shared memory.

On one machine the gradients need not cross a socket: every rank writes its flat gradient into
its own slot of one shared buffer, each rank then averages its 1/P slice of all slots into a
shared result, and every rank points its ``.grad`` tensors at that result. Per step each rank
moves about 3x the gradient size through memory, and the only messages are two tiny barriers,
where an allreduce over loopback sockets (gloo) moves the whole gradient through the kernel.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence

import torch

SHM_DIR = "/dev/shm"


class SharedMemoryGradientAverager:
    """Averages the gradients of ``params`` across ``world_size`` ranks on one machine.

    ``broadcast_name(name_or_none)`` returns rank 0's name on every rank; ``barrier()`` waits for
    all ranks. Both come from the process group, which carries only these small messages.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        rank: int,
        world_size: int,
        barrier: Callable[[], None],
        broadcast_name: Callable[[str | None], str],
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size, self.barrier = rank, world_size, barrier
        self.numel = sum(p.numel() for p in self.params)
        offsets, total = [], 0
        for p in self.params:
            offsets.append(total)
            total += p.numel()
        self.offsets = offsets
        folder = SHM_DIR if os.path.isdir(SHM_DIR) else None
        name = broadcast_name(os.path.join(folder or "/tmp", f"ddlx-grad-{uuid.uuid4().hex}") if rank == 0 else None)
        size = (world_size + 1) * self.numel
        if rank == 0:
            with open(name, "wb") as f:
                f.truncate(size * 4)
        barrier()
        buffer = torch.from_file(name, shared=True, size=size, dtype=torch.float32)
        barrier()
        if rank == 0:
            os.unlink(name)  # the mapping stays valid; nothing is left behind if a rank dies
        self.slots = buffer[: world_size * self.numel].view(world_size, self.numel)
        self.result = buffer[world_size * self.numel :]
        chunk = -(-self.numel // world_size)
        self.slice = slice(rank * chunk, min((rank + 1) * chunk, self.numel))
        self.result_views = [self.result[o : o + p.numel()].view_as(p) for o, p in zip(offsets, self.params)]

    def average(self) -> None:
        mine = self.slots[self.rank]
        for p, offset in zip(self.params, self.offsets):
            target = mine[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                target.zero_()
            else:
                target.copy_(p.grad)
        self.barrier()  # every slot written (and every rank done reading last step's result)
        s = self.slice
        torch.sum(self.slots[:, s], dim=0, out=self.result[s])
        self.result[s].div_(self.world_size)
        self.barrier()  # the whole result is written
        for p, view in zip(self.params, self.result_views):
            p.grad = view
