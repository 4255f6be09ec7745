"""fairscale ``Pipe``: GPipe micro-batch pipelining over devices (Jansen's thesis, chapter 6).

The batch is split into ``chunks`` micro-batches that flow through the partitions, so the
devices work at once on different micro-batches; gradients of all micro-batches are summed
before the (synchronous) optimizer step, so the maths is the sequential step's. BatchNorm
layers see micro-batch statistics. fairscale gives each distinct device one worker thread, so
on [cpu, cpu] both stages share one worker: the pipeline runs, without overlap.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import torch

from ..models import LayeredModel
from ..models.layered import out_of_place
from .autocast import CarriedAutocast
from .balance import balance_by_time
from .two_device_split import DevicesOf

log = logging.getLogger(__name__)


class PipeForward:
    def __init__(self, model: LayeredModel, balance: list[int], devices: list[torch.device], chunks: int, checkpoint: str) -> None:
        if checkpoint != "never":
            # fairscale recomputes a checkpointed partition from a leaf input that requires
            # grad, which an in-place first layer (ReLU) rejects: run partition heads out of place.
            start = 0
            for size in balance:
                out_of_place(model[start])
                start += size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "upstreamed to torch": torch has since removed it
            from fairscale.nn import Pipe

            self.pipe = Pipe(model, balance=balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
        self.stage_layers = list(balance)
        self.first = devices[0]
        self.autocast = CarriedAutocast(list(self.pipe.partitions))  # the partitions run in fairscale's worker threads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast.capture()
        return self.pipe(x.to(self.first)).to(self.first)

    def close(self) -> None:
        self.autocast.remove()


def pipe_parallelizer(devices_of: DevicesOf, chunks: int, balance: Sequence[int] | str, checkpoint: str, sample_shape: tuple[int, ...]):
    def parallelize(model: LayeredModel, local_rank: int) -> PipeForward:
        devices = devices_of(local_rank)
        sizes = balance_by_time(model, len(devices), sample_shape, devices[0]) if balance == "auto" else list(balance)
        return PipeForward(model, sizes, devices, chunks, checkpoint)

    return parallelize
