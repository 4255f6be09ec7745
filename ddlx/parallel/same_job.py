"""Every rank trains the same job: a check once the ranks can talk.

Ranks started by mpirun, srun or torchrun each compose their own config, on their own node:
from its copy of the project, its view of the data and the shared folder, its environment. Where
those differ (an override given to one node only, a folder only some nodes see, a requeued job's
marker that one node cannot read), the ranks would train different jobs under one MLflow run, or
wait for each other forever. Ranks started by ddlx's own launcher read rank 0's resolved config,
so for them the check can only pass.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytorch_lightning as pl

from ..errors import RanksDisagree

# Where things are may differ from node to node (each mounts the shared folder at its own path);
# only rank 0 logs, so its store is the one that counts.
MAY_DIFFER = ("paths.", "data.root", "data.synthetic_dir", "logger.")


def disagreements(params_of_ranks: Sequence[Mapping[str, str]], hosts: Sequence[str]) -> list[str]:
    """Each value in which a rank's job differs from rank 0's, as ``rank R (HOST): KEY=V where rank
    0 has KEY=V0``."""
    first, found = params_of_ranks[0], []
    for rank, params in enumerate(params_of_ranks[1:], start=1):
        for key in sorted(set(first) | set(params)):
            if key.startswith(MAY_DIFFER) or params.get(key) == first.get(key):
                continue
            found.append(f"rank {rank} ({hosts[rank]}): {key}={params.get(key, '<missing>')} "
                         f"where rank 0 ({hosts[0]}) has {key}={first.get(key, '<missing>')}")
    return found


class SameJobOnEveryRank(pl.Callback):
    """At setup, after the process group is up: the ranks exchange their resolved configs, and
    all refuse to train (:class:`RanksDisagree`, naming the values) when one differs."""

    def __init__(self, params: Mapping[str, str]) -> None:
        self.params = dict(params)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import socket

        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (socket.gethostname(), self.params))
        found = disagreements([params for _, params in gathered], [host for host, _ in gathered])
        if found:
            shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
            raise RanksDisagree(f"the ranks composed different jobs: {shown}. Every node must run the same command "
                              f"on the same project and see the same data and shared folder (docs/multi-node.md)")
