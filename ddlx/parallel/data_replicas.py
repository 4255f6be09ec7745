"""How many processes train on different data, and which of them this one is: every rank of
data-parallel strategies, but the ranks of one pipeline (PyTorch's schedules) all read the same
batches. What the loaders shard by and what a step's global batch counts."""
from __future__ import annotations

import torch


def data_replicas(strategy) -> tuple[int, int]:
    """(data-parallel replicas, this process's) under Lightning ``strategy`` (None: no trainer yet)."""
    sharding = getattr(strategy, "distributed_sampler_kwargs", None)
    if sharding:
        return sharding["num_replicas"], sharding["rank"]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0
