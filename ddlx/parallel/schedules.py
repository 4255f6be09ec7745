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


SCHEDULES = {
    "gpipe": Schedule("ScheduleGPipe", 1, "loop"),
    "1f1b": Schedule("Schedule1F1B", 1, "loop", micro_at_least_ranks=True),
    "interleaved_1f1b": Schedule("ScheduleInterleaved1F1B", 2, "loop"),
    "zero_bubble": Schedule("ScheduleZBVZeroBubble", 2, "v"),
}


def stages_of(schedule: str, rank: int, ranks: int) -> list[int]:
    """The pipeline stages process ``rank`` of ``ranks`` runs under ``schedule``."""
    spec = SCHEDULES[schedule]
    if spec.placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(spec.stages_per_rank)]


def micro_batches(batch: int, chunks: int) -> int:
    """Equal micro-batches for ``batch``: ``chunks`` when it divides, else the largest count below that does
    (an epoch's last, smaller batch), so every step stays the mean over the batch."""
    return max(c for c in range(1, min(chunks, batch) + 1) if batch % c == 0)
