"""Sharded data parallelism: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each process trains its share of the batch like DDP, but keeps only its 1/W shard of every
layer's weights, gradients and optimizer state: a layer's weights are gathered before its
forward (and again before its backward when ``reshard_after_forward``), and its gradients are
reduce-scattered, each rank receiving the average of its own shard. Every top-level layer of
the network with parameters is its own unit, so only one layer is gathered at a time.

FSDP2, not Lightning's ``FSDPStrategy`` (FSDP1): FSDP1 refuses to run without an accelerator
("FSDP needs a non-CPU accelerator device"), while ``fully_shard`` runs over gloo on CPU and
NCCL on GPUs alike. Lightning's ``ModelParallelStrategy`` (FSDP2 too) asks the LightningModule
to shard itself in ``configure_model``; here the strategy shards the network, so the module
stays the same for every strategy.

Sharding levels, as device meshes: ``full`` (ZeRO-3: weights resharded after forward),
``grad_op`` (ZeRO-2: weights kept whole from forward to backward), ``none`` (replicated, DDP's
memory: a mesh of W replicas of one shard), ``hybrid`` (HSDP: ``full`` within groups of
``shard_size`` consecutive ranks, by default one node's, the groups replicas of each other: the
weight gathers stay inside a node, only the gradient average crosses nodes). Checkpoints hold the full state under the
sequential model's names and the optimizer's index keys, so they load under any strategy.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch

from .launch import RelaunchingDDPStrategy, plain_optimizer
from ..models.layered import find_layered_model
from .pinning import Restore, pin_rank, unpin

log = logging.getLogger(__name__)

class FullyShardedStrategy(RelaunchingDDPStrategy):
    strategy_name = "ddlx_fsdp"

    def __init__(self, devices: list[torch.device], sharding: str, pin_cores: bool = True, timeout_s: float = 300.0,
                 shard_size: int | None = None) -> None:
        super().__init__(accelerator=None, parallel_devices=list(devices),
                         process_group_backend="nccl" if devices[0].type == "cuda" else "gloo",
                         timeout=timedelta(seconds=timeout_s))
        self.sharding, self.pin_cores, self.shard_size = sharding, pin_cores, shard_size
        self._restore: Restore | None = None
        self._sharded = False

    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":  # one core share per rank, like cpu_mp's
            self._restore = pin_rank(self.num_processes, self.local_rank, self.pin_cores, "fsdp")
        super().setup_environment()

    def _mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        kind = self.root_device.type
        if self.sharding in ("none", "hybrid"):
            shard = 1 if self.sharding == "none" else self.shard_size or self.num_processes
            return init_device_mesh(kind, (self.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(kind, (self.world_size,))

    def configure_ddp(self) -> None:
        # No DDP wrapper: each layer with parameters becomes an FSDP unit, then the network.
        from torch.distributed.fsdp import fully_shard

        mesh, keep = self._mesh(), self.sharding == "grad_op"
        log.info("fsdp rank %d: sharding=%s over a device mesh of %s", self.global_rank, self.sharding, tuple(mesh.shape))
        network = find_layered_model(self.model)
        if self.recompute:  # before sharding: each block's recomputation gathers its layers again
            from .recompute import recompute_at_cut_points

            recompute_at_cut_points(network)
        for layer in network.children():
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh, reshard_after_forward=not keep)
        fully_shard(network, mesh=mesh, reshard_after_forward=not keep)
        self._sharded = True

    def _options(self, **kwargs):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True, **kwargs)

    def lightning_module_state_dict(self) -> dict:
        """The whole model's state dict under the sequential names (collective)."""
        if not self._sharded:
            return self.lightning_module.state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module, options=self._options())

    def _names(self, optimizer) -> list[str]:
        """Each of ``optimizer``'s parameters' name, in its state dict's (index) order."""
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    def optimizer_state(self, optimizer) -> dict:
        """The whole optimizer state keyed by parameter index, as an unsharded optimizer's (collective)."""
        optimizer = plain_optimizer(optimizer)
        if not self._sharded:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        full = get_optimizer_state_dict(self.lightning_module, optimizer, options=self._options())
        if "state" not in full:  # with cpu_offload, only rank 0 receives it (and only rank 0 saves)
            return {}
        index = {name: i for i, name in enumerate(self._names(optimizer))}
        return {"state": {index[name]: state for name, state in full["state"].items()},
                "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                                 for group in full["param_groups"]]}

    def load_optimizer_state_dict(self, checkpoint) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        for optimizer, doc in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = plain_optimizer(optimizer)
            names = self._names(optimizer)
            full = {"state": {names[i]: state for i, state in doc["state"].items()},
                    "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in doc["param_groups"]]}
            set_optimizer_state_dict(self.lightning_module, optimizer, full, options=self._options())

    def teardown(self) -> None:
        self._sharded = False
        unpin(self._restore, self.pin_cores)
        self._restore = None
        super().teardown()
