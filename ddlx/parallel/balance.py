"""Pipeline stages of about equal time: each layer's forward and backward timed on a sample,
then the contiguous split whose slowest stage is fastest."""
from __future__ import annotations

import copy
import logging
import statistics
import time

import torch
from torch import nn

from ..compiling import drop_compiled
from ..models.layered import out_of_place
from .cuts import contiguous_balance
from .deferred_weight_grads import DeferredWeightGrads

log = logging.getLogger(__name__)


def layer_times(model: nn.Sequential, sample: torch.Tensor, rounds: int = 3, deferred_of: int = 0) -> list[float]:
    """Seconds of each layer's forward plus backward on ``sample`` (a micro-batch), median of
    ``rounds`` after a warm-up. ``deferred_of``: the micro-batches of a batch whose Linear weight
    gradients are computed once for all of them (:mod:`.deferred_weight_grads`); a Linear's time
    is then its forward and input gradient plus its share of that one product."""
    profiled = copy.deepcopy(model).to(sample.device)
    # Timed eager where compile.enable compiled the layers: compiling the copy to time it would
    # compile every layer twice (a minute and more for a ResNet-50). The cut follows eager times.
    drop_compiled(profiled)
    for module in profiled.modules():  # the backward needs each layer's input intact
        out_of_place(module)
    deferred = DeferredWeightGrads(list(profiled)) if deferred_of else None
    samples: list[list[float]] = [[] for _ in profiled]
    for round_ in range(rounds + 1):
        x = sample
        for i, layer in enumerate(profiled):
            x = x.detach().requires_grad_(x.is_floating_point())
            _synchronize(sample.device)
            start = time.perf_counter()
            y = layer(x)
            y.backward(torch.ones_like(y))
            _synchronize(sample.device)
            elapsed = time.perf_counter() - start
            if deferred:
                elapsed += _deferred_share(deferred, layer, deferred_of, sample.device)
            if round_:  # the first round warms up
                samples[i].append(elapsed)
            x = y
    if deferred:
        deferred.close()
    return [statistics.median(s) for s in samples]


def _deferred_share(deferred: DeferredWeightGrads, layer: nn.Module, micro_batches: int, device: torch.device) -> float:
    """A micro-batch's share of the weight gradients of ``layer``'s Linears over ``micro_batches`` like it."""
    kept = [deferred.kept[m] for m in layer.modules() if deferred.kept.get(m)]
    if not kept:
        return 0.0
    for entries in kept:
        entries[:] = entries[-1:] * micro_batches
    start = time.perf_counter()
    deferred.flush()
    _synchronize(device)
    return (time.perf_counter() - start) / micro_batches


def _synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a timer around it times the work, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def balance_by_time(model: nn.Sequential, partitions: int, sample_shape: tuple[int, ...], device: torch.device,
                    deferred_of: int = 0) -> list[int]:
    """Layer counts per stage that roughly equalise layer time profiled on a random micro-batch
    of ``sample_shape`` (``deferred_of``: as :func:`layer_times`). The profile's draws (the
    sample, dropout masks) come from a forked random state: training draws what it would with
    the balance given, and a resumed run what the run it resumes would have drawn."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        times = layer_times(model, torch.randn(sample_shape, device=device), deferred_of=deferred_of)
    balance = contiguous_balance(times, partitions)
    log.info("pipeline: balance by profiled layer time: %s", balance)
    return balance
