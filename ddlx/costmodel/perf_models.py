"""Performance models: seconds per training batch of each strategy, from the sequential time.

Small pure functions of documented inputs (Jansen's thesis, chapters 5-6, symbols of its Table 5.1):
``t_seq`` seconds per batch on one device, ``W`` workers, ``G`` gradient MB, ``th`` the
allreduce bucket threshold in MB (``bucket_cap_mb``), links as (latency s, bandwidth MB/s).
Each returns the model's time; calibration against measured runs is applied by the caller.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    latency_s: float
    bandwidth_mb_s: float

    def send_s(self, mb: float) -> float:
        return self.latency_s + mb / self.bandwidth_mb_s


def ring_allreduce_s(workers: int, mb: float, ring: Sequence[Link], fixed_s: float = 0.0) -> float:
    """One ring allreduce of ``mb`` MB: 2(W-1) steps of mb/W over the slowest link of the ring
    (Eq. 5.1's communication term), plus ``fixed_s``: the negotiation, buffer allocation and copy
    that the thesis found dominating small allreduces (section 5.2) and left out."""
    if workers <= 1:
        return 0.0
    slowest = max(link.latency_s + mb / (workers * link.bandwidth_mb_s) for link in ring)
    return 2 * (workers - 1) * slowest + fixed_s


def data_parallel_s(
    t_seq: float, workers: int, gradient_mb: float, bucket_mb: float, ring: Sequence[Link],
    fixed_s: float = 0.0, overlap: bool = True,
) -> float:
    """Eq. 5.1 with the fixed per-allreduce cost. ``overlap=True`` (GPUs: communication runs beside
    the backward pass): only the last bucket, min(G, th), is exposed, as the thesis assumed.
    ``overlap=False`` (CPU: gloo and the backward pass share the cores): every bucket is."""
    compute = t_seq / workers
    if workers <= 1:
        return compute
    if overlap:
        return compute + ring_allreduce_s(workers, min(gradient_mb, bucket_mb), ring, fixed_s)
    full, last = divmod(gradient_mb, bucket_mb)
    sizes = [bucket_mb] * int(full) + ([last] if last > 1e-9 else [])
    return compute + sum(ring_allreduce_s(workers, size, ring, fixed_s) for size in sizes)


FIRST_BUCKET_MB = 1.0  # DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES): the last layers' gradients go at once


def exposed_allreduce_s(backward_s: Sequence[float], gradient_mb: Sequence[float], workers: int, bucket_mb: float,
                        ring: Sequence[Link], fixed_s: float = 0.0) -> float:
    """What DDP's allreduces add after the backward pass, on a device that runs them beside it (a
    GPU): the gradients are bucketed in backward order (the last layer's first; the first bucket
    of ``FIRST_BUCKET_MB``), each bucket's allreduce starts once its last gradient is computed and
    the previous bucket's is done, and the step waits for the last. ``backward_s`` and
    ``gradient_mb`` per layer, in the model's order."""
    if workers <= 1:
        return 0.0
    buckets, clock, filled, cap = [], 0.0, 0.0, FIRST_BUCKET_MB
    for seconds, mb in zip(reversed(backward_s), reversed(gradient_mb)):
        clock += seconds
        filled += mb
        if filled >= cap:
            buckets.append((clock, filled))
            filled, cap = 0.0, bucket_mb
    if filled > 1e-12:
        buckets.append((clock, filled))
    done = 0.0
    for ready, mb in buckets:
        done = max(done, ready) + ring_allreduce_s(workers, mb, ring, fixed_s)
    return max(0.0, done - clock)


def ring_gather_s(workers: int, mb: float, ring: Sequence[Link], fixed_s: float = 0.0) -> float:
    """One ring all-gather (or reduce-scatter) of a unit of ``mb`` MB: W-1 steps of mb/W, half an
    allreduce."""
    if workers <= 1:
        return 0.0
    return (workers - 1) * max(link.latency_s + mb / (workers * link.bandwidth_mb_s) for link in ring) + fixed_s


def exposed_sharded_s(forward_s: Sequence[float], backward_s: Sequence[float], unit_mb: Sequence[float], workers: int,
                      ring: Sequence[Link], fixed_s: float = 0.0, regather: bool = True) -> float:
    """What FSDP's collectives add to a step's compute on a device that runs them beside it (a
    GPU), per unit (a top-level layer) on one communication queue: each unit's weights gathered
    before its forward (the next unit's gather issued as a unit starts: one ahead), gathered again
    before its backward when ``regather`` (full sharding frees them after the forward; grad_op
    keeps them), and its gradients reduce-scattered once its backward is done. 1.5 allreduces'
    traffic in full sharding, one in grad_op: the extra half is what ``regather`` adds."""
    if workers <= 1:
        return 0.0
    gather = [ring_gather_s(workers, mb, ring, fixed_s) for mb in unit_mb]
    comm_free = clock = 0.0

    def issue(at: float, seconds: float) -> float:
        nonlocal comm_free
        comm_free = max(comm_free, at) + seconds
        return comm_free

    ready = issue(0.0, gather[0])
    for i, seconds in enumerate(forward_s):
        start = max(clock, ready)
        if i + 1 < len(forward_s):
            ready = issue(start, gather[i + 1])
        clock = start + seconds
    last = len(backward_s) - 1
    ready = issue(clock, gather[last]) if regather else clock
    done = clock
    for i in range(last, -1, -1):
        start = max(clock, ready)
        ready = issue(start, gather[i - 1]) if regather and i > 0 else start
        clock = start + backward_s[i]
        done = issue(clock, gather[i])  # the reduce-scatter: as long as the gather
    return max(0.0, max(clock, done) - sum(forward_s) - sum(backward_s))


def gpipe_compute_s(t_seq: float, workers: int, micro_batches: int) -> float:
    """Eq. 6.1: T_seq (W + #mb - 1) / (W #mb). ``t_seq`` is the sequential time of the whole
    batch run as #mb micro-batches (#mb x the time of one micro-batch), as the thesis prescribes."""
    return t_seq * (workers + micro_batches - 1) / (workers * micro_batches)


def pipeline_schedule_s(rank_micro_s: Sequence[float], micro_batches: int, bubble: float) -> float:
    """A synchronous pipeline's batch: #mb steps of its slowest rank plus the schedule's bubble,
    in the same steps. With balanced ranks and GPipe's bubble (W-1) this is Eq. 6.1."""
    return (micro_batches + bubble) * max(rank_micro_s)


def gpipe_comm_s(micro_batch: int, micro_batches: int, boundary_mb: Sequence[float], links: Sequence[Link]) -> float:
    """Eq. 6.2: activations forward and gradients backward over the W-1 boundaries, in lockstep:
    the pipeline fill (W-2 steps), #mb-(W-2) full steps, the drain (W-2 steps), each as slow as
    its slowest active link. ``boundary_mb[j]`` is one sample's activation crossing boundary j."""
    w = len(boundary_mb) + 1
    step = [links[j].send_s(micro_batch * boundary_mb[j]) for j in range(w - 1)]
    if not step:
        return 0.0
    fill = sum(max(step[: i + 1]) for i in range(w - 2))
    full = (micro_batches - (w - 2)) * max(step)
    drain = sum(max(step[i:]) for i in range(1, w - 1))
    return 2 * (fill + full + drain)


def split_s(t_seq: float, batch: int, boundary_mb: float, link: Link) -> float:
    """Two devices, one after the other (no overlap, the Lerat et al. entry 2.4): the whole computation plus
    the cut's activations forward and their gradients backward."""
    return t_seq + 2 * link.send_s(batch * boundary_mb)


def threads_s(t_seq_one_core: float, threads: int, join_s: float = 0.0) -> float:
    """k threads, one sub-batch of b/k each, one core each: the sequential one-core time / k plus
    the join of the sub-batch outputs and gradients."""
    return t_seq_one_core / threads + join_s


def shared_weights_reduce_s(gradient_mb: float, processes: int, bandwidth_mb_s: float, barrier_s: float) -> float:
    """cpu_mp's gradient reduce on one shared copy of the weights: each rank publishes the
    (P-1)/P of its gradient the others own (read and written: 2(P-1)G over all ranks) and sums
    its 1/P slice of all P (read G, written G/P each: (P+1)G), (3P-1)G moved in all by the
    ranks together at ``bandwidth_mb_s``, plus two barriers."""
    if processes <= 1:
        return 0.0
    return (3 * processes - 1) * gradient_mb / bandwidth_mb_s + 2 * barrier_s


def cpu_mp_s(t_seq_one_core: float, processes: int, gradient_mb: float, bandwidth_mb_s: float, barrier_s: float) -> float:
    """p processes on p cores, b/p samples each (one core's time / p), plus the shared-memory
    reduce (the optimizer step, done once over the ranks' slices, is in the weight traffic)."""
    return t_seq_one_core / processes + shared_weights_reduce_s(gradient_mb, processes, bandwidth_mb_s, barrier_s)


def split_exchange_s(layers: Sequence[tuple[int, int]], batch: int, processes: int, activation_bytes: int, link: Link) -> float:
    """The activations of fully connected layers split by rows between ``processes`` ranks
    (:mod:`ddlx.parallel.split_linear`), each ``(in, out)``: per layer and rank, forward an
    all-gather of the batch's inputs and an all-to-all of its block of outputs, backward a
    reduce-scatter and an all-to-all of the same sizes: 2(P-1)(b/P)(in + out/P) values sent,
    over ``link``, four collectives' latency."""
    if processes <= 1 or not layers:
        return 0.0
    share = batch / processes
    values = sum(2 * (processes - 1) * share * (i + -(-o // processes)) for i, o in layers)
    return link.send_s(values * activation_bytes / 1e6) + (4 * len(layers) - 1) * link.latency_s


def hybrid_s(t_local: float, processes: int, gradient_mb: float, bucket_mb: float, ring: Sequence[Link], fixed_s: float) -> float:
    """DDP over ``processes`` groups, each running split/pipe on its own devices: the local
    strategy's time on b/processes, plus the allreduce between groups (the last bucket exposed)."""
    if processes <= 1:
        return t_local
    return t_local + ring_allreduce_s(processes, min(gradient_mb, bucket_mb), ring, fixed_s)
