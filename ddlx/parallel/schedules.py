"""PyTorch's pipeline schedules as ddlx names them (no torch import: the config schema and the
recommender read this table)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    torch_class: str  # in torch.distributed.pipelining
    stages_per_rank: int
    placement: str  # "loop": rank r runs stages r, r+W, ...; "v": rank r runs r and 2W-1-r
    micro_at_least_ranks: bool = False  # PyTorch refuses fewer micro-batches than stages
    backward_passes: int = 1  # ZB-V: input and weight gradients in two passes (a recomputed block: twice)


SCHEDULES = {
    "gpipe": Schedule("ScheduleGPipe", 1, "loop"),
    "1f1b": Schedule("Schedule1F1B", 1, "loop", micro_at_least_ranks=True),
    "interleaved_1f1b": Schedule("ScheduleInterleaved1F1B", 2, "loop"),
    "zero_bubble": Schedule("ScheduleZBVZeroBubble", 2, "v", backward_passes=2),
}


def bubble_steps(schedule: str, ranks: int, micro: int) -> float:
    """Idle micro-batch steps of the slowest rank in one batch (in units of its time per
    micro-batch): GPipe's W-1 (Jansen's thesis Eq. 6.1); 1F1B the same bubble (PipeDream-flush,
    Narayanan et al. 2021: it saves memory, not time); interleaving v stages per rank divides it
    by v (Narayanan et al., SC'21); ZB-V fills it with deferred weight gradients once there are at
    least 2W micro-batches (Qi et al., ICLR 2024), and is interleaved's otherwise."""
    spec = SCHEDULES[schedule]
    if schedule == "zero_bubble" and micro >= 2 * ranks:
        return 0.0
    return (ranks - 1) / spec.stages_per_rank


def in_flight(schedule: str, rank: int, ranks: int, micro: int) -> int:
    """Micro-batches whose activations a stage of ``rank`` holds at its peak: all of them under
    GPipe; at most W - rank under 1F1B; about W for the interleaved and zero-bubble schedules
    (their papers report 1F1B's peak, a factor 1 + (W-1)/(vW) above it for interleaving)."""
    if schedule == "gpipe":
        return micro
    if schedule == "1f1b":
        return min(micro, ranks - rank)
    return min(micro, ranks)


def stages_of(schedule: str, rank: int, ranks: int) -> list[int]:
    """The pipeline stages process ``rank`` of ``ranks`` runs under ``schedule``."""
    spec = SCHEDULES[schedule]
    if spec.placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(spec.stages_per_rank)]


def stage_owners(schedule: str, ranks: int) -> list[int]:
    """The rank that runs each pipeline stage, in stage order."""
    spec = SCHEDULES[schedule]
    return [r for i in range(ranks * spec.stages_per_rank) for r in range(ranks) if i in stages_of(schedule, r, ranks)]


def micro_batches(batch: int, chunks: int) -> int:
    """Equal micro-batches for ``batch``: ``chunks`` when it divides, else the largest count below that does
    (an epoch's last, smaller batch), so every step stays the mean over the batch."""
    return max(c for c in range(1, min(chunks, batch) + 1) if batch % c == 0)
