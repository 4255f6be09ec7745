"""fairscale ``Pipe``: GPipe micro-batch pipelining over devices (source 004, chapter 6).

The batch is split into ``chunks`` micro-batches that flow through the partitions, so the
devices work at once on different micro-batches; gradients of all micro-batches are summed
before the (synchronous) optimizer step, so the maths is the sequential step's. BatchNorm
layers see micro-batch statistics. fairscale gives each distinct device one worker thread, so
on [cpu, cpu] both stages share one worker: the pipeline runs, without overlap.
"""
from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Sequence

import torch

from ..models import LayeredModel
from .split import DevicesOf

log = logging.getLogger(__name__)


def auto_balance(model: LayeredModel, partitions: int, sample: torch.Tensor, device: torch.device) -> list[int]:
    """Partition sizes that roughly equalise profiled layer time (fairscale's balance_by_time)."""
    from fairscale.nn.pipe.balance import balance_by_time

    # fairscale profiles with a leaf input that requires grad, which in-place ReLUs reject:
    # profile a copy with in-place ops turned off (same work, same timing).
    profiled = copy.deepcopy(model)
    for module in profiled.modules():
        if getattr(module, "inplace", False):
            module.inplace = False
    balance = list(balance_by_time(partitions, profiled, sample, timeout=1.0, device=device))
    log.info("pipe: balance by profiled layer time: %s", balance)
    return balance


class PipeForward:
    def __init__(self, model: LayeredModel, balance: list[int], devices: list[torch.device], chunks: int, checkpoint: str) -> None:
        if checkpoint != "never":
            # fairscale recomputes a checkpointed partition from a leaf input that requires
            # grad, which an in-place first layer (ReLU) rejects: run partition heads out of place.
            start = 0
            for size in balance:
                if getattr(model[start], "inplace", False):
                    model[start].inplace = False
                start += size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "upstreamed to torch": torch has since removed it
            from fairscale.nn import Pipe

            self.pipe = Pipe(model, balance=balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
        self.first = devices[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.pipe(x.to(self.first)).to(self.first)


def pipe_parallelizer(devices_of: DevicesOf, chunks: int, balance: Sequence[int] | str, checkpoint: str, sample_shape: tuple[int, ...]):
    def parallelize(model: LayeredModel, local_rank: int) -> PipeForward:
        devices = devices_of(local_rank)
        sizes = auto_balance(model, len(devices), torch.randn(sample_shape), devices[0]) if balance == "auto" else list(balance)
        return PipeForward(model, sizes, devices, chunks, checkpoint)

    return parallelize
