"""Custom multi-process data parallelism on CPU: the paper's fastest CPU setup (Lerat et al. 2022, 4.1).

``processes`` ranks on one machine, each pinned to its own equal share of the cores with that
many intra-op threads (so ranks never oversubscribe), its own data shard (Lightning's
DistributedSampler) and its own loader workers (which inherit the pinning). The ranks train one
copy of the weights in shared memory, each reducing and stepping its own slice of it
(:mod:`.shared_memory`), instead of DDP's socket allreduce and a full optimizer step per rank.
The large fully connected layers are split by rows between the ranks instead of run whole by
each (:mod:`.split_linear`). Processes start like DDP's (the script re-launched per rank); the
process group carries barriers, the split layers' activations, metric reductions and, at a
checkpoint, the optimizer state's slices.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .launch import RelaunchingDDPStrategy, plain_optimizer
from .pinning import Restore, pin_rank, unpin
from .shared_memory import SharedWeights
from .split_linear import split_linears


class CpuMultiProcessStrategy(RelaunchingDDPStrategy):
    strategy_name = "ddlx_cpu_mp"

    def __init__(self, processes: int, pin_cores: bool = True, timeout_s: float = 300.0,
                 split_linear_batch: int | None = None) -> None:
        super().__init__(
            accelerator=None,
            parallel_devices=[torch.device("cpu")] * processes,
            process_group_backend="gloo",
            timeout=timedelta(seconds=timeout_s),
        )
        self.pin_cores = pin_cores
        self.split_linear_batch = split_linear_batch  # the global batch the split is judged at; None: no layer split
        self._shared: SharedWeights | None = None
        self._restore: Restore | None = None

    def setup_environment(self) -> None:
        # Before the process group and the model: threads and affinity are per process.
        self._restore = pin_rank(self.num_processes, self.local_rank, self.pin_cores, "cpu_mp")
        super().setup_environment()
        if self.num_nodes > 1:
            raise RuntimeError("cpu_mp averages through shared memory and runs on one machine; use strategy=mpi for several")

    def configure_ddp(self) -> None:
        # No DDP wrapper: every rank's parameters become views of one shared copy (rank 0's start weights).
        split = ([] if self.split_linear_batch is None
                 else split_linears(self.model, self.split_linear_batch, self.global_rank, self.world_size))
        owned = {p: rows for layer in split for p, rows in layer.owned_rows().items()}
        self._shared = SharedWeights(list(self.model.parameters()), rank=self.global_rank, world_size=self.world_size,
                                     barrier=dist.barrier, broadcast_name=self._broadcast_name, owned_rows=owned)
        for layer in split:
            layer.rows = [self._shared.rows(p) for p in layer.owned_rows()]

    @staticmethod
    def _broadcast_name(name: str | None) -> str:
        holder = [name]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """The configured optimizer's step, taken by :class:`.SharedWeights` on this rank's slice."""
        if self._shared is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return super().optimizer_step(_SliceStep(plain_optimizer(optimizer), self._shared), closure, model, **kwargs)

    def optimizer_state(self, optimizer) -> dict:
        """The full state (every rank's slice, gathered: collective), on rank 0."""
        optimizer = plain_optimizer(optimizer)
        if self._shared is None:
            return optimizer.state_dict()
        slices = [None] * self.world_size
        dist.all_gather_object(slices, self._shared.slice_state())
        return self._shared.full_state(optimizer, slices) if self.is_global_zero else {}

    def load_optimizer_state_dict(self, checkpoint) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self._shared.load_state(plain_optimizer(optimizer), state)

    def teardown(self) -> None:
        self._shared = None
        unpin(self._restore, self.pin_cores)
        self._restore = None
        super().teardown()


class _SliceStep:
    """What the precision plugin steps: the closure (forward, backward), the reduce, then the
    configured optimizer's step on this rank's slice of the shared weights. The rest is the
    optimizer's own (hooks read its groups)."""

    def __init__(self, optimizer, shared: SharedWeights) -> None:
        self._optimizer, self._shared = optimizer, shared

    def step(self, closure=None, **kwargs):
        loss = closure() if closure is not None else None
        # After the step's last backward: with accumulate_grad_batches the gradients of several.
        self._shared.reduce()
        self._shared.step(self._optimizer)
        return loss

    def __getattr__(self, name):
        return getattr(self._optimizer, name)
