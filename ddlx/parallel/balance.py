"""Pipeline stages of about equal time: each layer's forward and backward timed on a sample,
then the contiguous split whose slowest stage is fastest."""
from __future__ import annotations

import copy
import logging
import statistics
import time

import torch
from torch import nn

from ..models.layered import out_of_place

log = logging.getLogger(__name__)


def layer_times(model: nn.Sequential, sample: torch.Tensor, rounds: int = 3) -> list[float]:
    """Seconds of each layer's forward plus backward on ``sample``, median of ``rounds`` after a warm-up."""
    profiled = copy.deepcopy(model).to(sample.device)
    for module in profiled.modules():  # the backward needs each layer's input intact
        out_of_place(module)
    samples: list[list[float]] = [[] for _ in profiled]
    for round_ in range(rounds + 1):
        x = sample
        for i, layer in enumerate(profiled):
            x = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            y = layer(x)
            y.backward(torch.ones_like(y))
            if round_:  # the first round warms up
                samples[i].append(time.perf_counter() - start)
            x = y
    return [statistics.median(s) for s in samples]


def contiguous_balance(costs: list[float], partitions: int) -> list[int]:
    """Layer counts of ``partitions`` contiguous, non-empty stages minimising the largest stage cost."""
    n = len(costs)
    if not 1 <= partitions <= n:
        raise ValueError(f"cannot cut {n} layers into {partitions} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest-stage cost of the first i layers in k stages; cut[k][i]: where the last starts.
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(partitions, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def balance_by_time(model: nn.Sequential, partitions: int, sample: torch.Tensor) -> list[int]:
    """Layer counts per stage that roughly equalise profiled layer time."""
    balance = contiguous_balance(layer_times(model, sample), partitions)
    log.info("pipeline: balance by profiled layer time: %s", balance)
    return balance
