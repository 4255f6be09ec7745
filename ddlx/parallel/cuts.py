"""Where to cut a sequence of layers into pipeline stages, given each layer's cost: what a run
does with profiled times (:mod:`.balance`) and the recommender with predicted ones. No torch here:
the strategy specs import it, and train.py refuses a bad job through them before torch loads."""
from __future__ import annotations


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
