"""Measure this machine's links and write them into a hardware file (the thesis used NVIDIA's
p2pBandwidthLatencyTest; this measures what ddlx's strategies actually use).

- between processes: a gloo allreduce between two local processes over a range of sizes; the
  two-worker ring costs 2 L + S / BW (Eq. 5.1 with W = 2): the smallest message (4 bytes) gives
  the latency L (half its time; it includes the fixed per-call cost), the slope of a
  least-squares line through (S, t) gives BW. (The line's intercept is not used for L: set by
  the 32 MB messages' noise, it came out negative on a busy machine.)
- the copy bandwidths of one core and of all cores come from the detected spec (hw=local);
- on CUDA: device-to-device copies between every GPU pair (latency from 4-byte copies,
  bandwidth from 64 MB ones).
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..costmodel.hardware import HardwareSpec

SIZES_BYTES = (4, 64 * 2**10, 2**20, 8 * 2**20, 32 * 2**20)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _allreduce_worker(rank: int, port: int, repeats: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = []
        for size in SIZES_BYTES:
            buf = torch.ones(max(1, size // 4))
            dist.all_reduce(buf)  # warm-up
            dist.barrier()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                dist.all_reduce(buf)
                times.append(time.perf_counter() - start)
            results.append((size, statistics.median(times)))
        if rank == 0:
            out.put(results)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_link(repeats: int = 10) -> tuple[float, float, list[tuple[int, float]]]:
    """(latency µs, bandwidth GB/s, raw (bytes, seconds)) of a gloo allreduce between 2 processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_allreduce_worker, args=(_free_port(), repeats, queue), nprocs=2, join=True, start_method="spawn")
    results = queue.get()
    _, slope = fit_line([s for s, _ in results], [t for _, t in results])
    latency_s = min(results)[1] / 2  # the smallest message: two latencies, no bandwidth to speak of
    bandwidth = 1 / slope if slope > 0 else float("inf")  # bytes/s
    return latency_s * 1e6, bandwidth / 1e9, results


def gpu_pairs() -> list[dict]:
    """Latency and bandwidth of device-to-device copies between every pair of GPUs."""
    pairs = []
    count = torch.cuda.device_count()
    for a in range(count):
        for b in range(a + 1, count):
            small_a, small_b = torch.ones(1, device=f"cuda:{a}"), torch.empty(1, device=f"cuda:{b}")
            big_a, big_b = torch.ones(16 * 2**20, device=f"cuda:{a}"), torch.empty(16 * 2**20, device=f"cuda:{b}")
            latency = _timed(lambda: small_b.copy_(small_a), a, b, 50)
            seconds = _timed(lambda: big_b.copy_(big_a), a, b, 10)
            pairs.append({"devices": [a, b], "bandwidth_gb_s": round(big_a.numel() * 4 / seconds / 1e9, 2),
                          "latency_us": round(latency * 1e6, 2)})
    return pairs


def _timed(fn, a: int, b: int, repeats: int) -> float:
    fn()
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)
    return (time.perf_counter() - start) / repeats


def write_probed_hw(spec: HardwareSpec, hw_dir: Path) -> tuple[Path, dict]:
    """Measure the links and write ``conf/hw/probed_<host>.yaml``: the detected local spec (its
    cores, memory, GEMM rate and copy bandwidths as hw=local measured them) with measured links."""
    import yaml

    latency_us, bandwidth, raw = process_link()
    doc = {
        "defaults": ["schema", "_self_"],
        **asdict(spec),
        "name": f"probed_{spec.host}",
        "detect": False,
        "nodes": 1,
        "allreduce_fixed_us": 0.0,  # folded into the measured latency
        "intra_node": {"bandwidth_gb_s": round(bandwidth, 3), "latency_us": round(latency_us, 2)},
        "intra_node_pairs": gpu_pairs() if torch.cuda.is_available() and torch.cuda.device_count() > 1 else [],
        "inter_node": None,
    }
    path = hw_dir / f"probed_{spec.host}.yaml"
    header = (f"# Written by `python recommend.py mode=probe` on {spec.host} at {time.strftime('%Y-%m-%d %H:%M')}.\n"
              f"# gloo allreduce, 2 processes, (bytes, s): {[(s, round(t, 6)) for s, t in raw]}\n")
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    return path, doc
