"""Hardware descriptions (``conf/hw/*.yaml``): what the performance models need to know.

A typed structured config: ``recommend.py`` registers :class:`HardwareSpec` as the schema of
the ``hw`` group, so an unknown key, a wrong type or a missing field is a Hydra error naming
it (a file read outside Hydra is typed on the same schema by :mod:`ddlx.predict.hw_files`);
:func:`validate` then checks the values. For CPU machines a *device* is a core: CPU
strategies place processes and threads on cores.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from ..knobs import MISSING
from .numerics import NUMBER_TYPES, Numerics

GB = 1e9


@dataclass
class LinkSpec:
    bandwidth_gb_s: float = MISSING  # GB/s in one direction
    latency_us: float = MISSING


@dataclass
class PairLink(LinkSpec):
    """A link between two devices of a node that differs from the node's default (e.g. NVLink)."""

    devices: list[int] = MISSING


@dataclass
class HardwareSpec:
    name: str = MISSING
    nodes: int = 1
    device_kind: str = MISSING  # cpu | gpu
    device_name: str = ""
    devices_per_node: int = MISSING  # GPUs; for device_kind=cpu, the cores
    cores_per_node: int = MISSING  # CPU cores (loader workers, CPU strategies)
    memory_per_device_gb: float = MISSING  # a GPU's memory; for device_kind=cpu, the node's RAM
    ram_per_node_gb: float = MISSING
    peak_tflops: float = MISSING  # fp32, per device (per core for device_kind=cpu)
    # Peaks of the other number formats (numerics.NUMBER_TYPES: fp64, tf32, bf16, fp16; GPUs'
    # dense tensor-core figures): what mixed and low precision run at. A format not given is
    # taken at the fp32 peak, and the prediction's basis says so.
    peak_tflops_by_type: dict[str, float] = field(default_factory=dict)
    intra_node: LinkSpec = field(default_factory=LinkSpec)  # between devices (processes) of a node
    intra_node_pairs: list[PairLink] = field(default_factory=list)
    inter_node: Optional[LinkSpec] = None
    memory_bandwidth_gb_s: float = 10.0  # a device's memory bandwidth; on CPU one core's copy rate
    node_memory_bandwidth_gb_s: float = 0.0  # CPU: all cores of a node copying at once (0: cores x one core's)
    allreduce_fixed_us: float = 50.0  # fixed cost of one allreduce call: launch, negotiation, copies
    host: str = ""  # the machine the runs of this hardware were measured on ("" = not this machine)
    detect: bool = False  # fill cores, memory and GPUs from this machine (hw=local)
    # What renting one device costs an hour, and where that figure comes from (a provider's list
    # price and its date): an epoch's cost beside its time. None: the answer shows no cost.
    price_per_device_hour: Optional[float] = None
    price_basis: str = ""

    def peak_for(self, numerics: Numerics) -> tuple[float, str]:
        """The peak TFLOPS the matrix products of ``numerics`` run at, and which it is."""
        compute, given = numerics.compute, self.peak_tflops_by_type
        if compute == "fp32":
            # cuDNN runs fp32 convolutions in TF32 by default where the GPU has it, matrix
            # products stay fp32: fp32's peak, and what TF32 gains is left to calibration.
            return self.peak_tflops, "fp32 peak"
        if compute in given:
            return given[compute], f"{compute} peak"
        return self.peak_tflops, f"fp32 peak (hw.peak_tflops_by_type gives no {compute} peak)"

    @property
    def total_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        """The link between global devices ``a`` and ``b`` (node-major numbering; past the last
        device, the numbering starts again at the first node's: CPU processes sharing cores)."""
        if (a // self.devices_per_node) % self.nodes != (b // self.devices_per_node) % self.nodes:
            if self.inter_node is None:
                raise ConfigError(f"hw={self.name} has {self.nodes} nodes but no inter_node link; describe it")
            return self.inter_node
        la, lb = a % self.devices_per_node, b % self.devices_per_node
        for pair in self.intra_node_pairs:
            if sorted(pair.devices) == sorted([la, lb]):
                return pair
        return self.intra_node

    def ring_links(self, devices: list[int]) -> list[LinkSpec]:
        return [self.link(devices[i], devices[(i + 1) % len(devices)]) for i in range(len(devices))]


def _numbers(value, key: str):
    """(key, number) of every float in a hw description (its links, lists and peaks by type)."""
    if isinstance(value, float):
        yield key, value
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _numbers(getattr(value, f.name), f"{key}.{f.name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{key}[{i}]")
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _numbers(item, f"{key}.{name}")


def validate(spec: HardwareSpec) -> HardwareSpec:
    """Values the types cannot check; every message names the key and the fix."""
    if spec.device_kind not in ("cpu", "gpu"):
        raise ConfigError(f"hw.device_kind={spec.device_kind!r} for hw={spec.name}; expected cpu or gpu")
    for key, value in _numbers(spec, "hw"):  # NaN passes every comparison below
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value} for hw={spec.name}; expected a finite number")
    for key in ("nodes", "devices_per_node", "cores_per_node"):
        if getattr(spec, key) < 1:
            raise ConfigError(f"hw.{key}={getattr(spec, key)} for hw={spec.name}; must be 1 or more")
    for key in ("memory_per_device_gb", "ram_per_node_gb", "peak_tflops", "memory_bandwidth_gb_s"):
        if getattr(spec, key) <= 0:
            raise ConfigError(f"hw.{key}={getattr(spec, key)} for hw={spec.name}; must be > 0")
    for key in ("node_memory_bandwidth_gb_s", "allreduce_fixed_us"):  # 0: node bandwidth from one core's
        if getattr(spec, key) < 0:
            raise ConfigError(f"hw.{key}={getattr(spec, key)} for hw={spec.name}; must be >= 0")
    for key, value in spec.peak_tflops_by_type.items():
        if key not in NUMBER_TYPES or value <= 0:
            raise ConfigError(f"hw.peak_tflops_by_type.{key}={value} for hw={spec.name}: expected a format of "
                              f"{', '.join(NUMBER_TYPES)} with a peak > 0 (fp32's is hw.peak_tflops)")
    links = [("intra_node", spec.intra_node)] + [(f"intra_node_pairs[{i}]", p) for i, p in enumerate(spec.intra_node_pairs)]
    if spec.inter_node is not None:
        links.append(("inter_node", spec.inter_node))
    for key, link in links:
        if link.bandwidth_gb_s <= 0 or link.latency_us < 0:
            raise ConfigError(f"hw.{key} of hw={spec.name}: bandwidth_gb_s={link.bandwidth_gb_s} must be > 0 and "
                              f"latency_us={link.latency_us} >= 0")
    for i, pair in enumerate(spec.intra_node_pairs):
        if len(pair.devices) != 2 or not all(0 <= d < spec.devices_per_node for d in pair.devices):
            raise ConfigError(f"hw.intra_node_pairs[{i}].devices={list(pair.devices)} for hw={spec.name}: expected two "
                              f"device indices in 0..{spec.devices_per_node - 1}")
    if spec.price_per_device_hour is not None and (spec.price_per_device_hour <= 0 or not spec.price_basis):
        raise ConfigError(f"hw.price_per_device_hour={spec.price_per_device_hour} for hw={spec.name}: expected a price "
                          f"> 0 with its source in hw.price_basis (e.g. hw.price_basis='my cluster's internal rate, 2026')")
    if spec.nodes > 1 and spec.inter_node is None:
        raise ConfigError(f"hw={spec.name} has nodes={spec.nodes} but no inter_node link; add inter_node: "
                          f"{{bandwidth_gb_s: ..., latency_us: ...}} (40 Gbps Ethernet = 5 GB/s)")
    return spec


# Peak TFLOPS of GPUs by name (vendor data sheets; SXM parts; tensor-core figures dense, without
# sparsity; fp64 on tensor cores where the GPU has them), for hw=local on a GPU machine. A format
# left out has no hardware of its own there (no bf16 or tf32 before Ampere).
GPU_PEAKS = {
    "H200": {"fp32": 67.0, "fp64": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H100": {"fp32": 67.0, "fp64": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "A100": {"fp32": 19.5, "fp64": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "V100": {"fp32": 15.7, "fp64": 7.8, "fp16": 125.0},
    "TITAN RTX": {"fp32": 16.3, "fp64": 0.51, "fp16": 130.5},
    "A10": {"fp32": 31.2, "fp64": 0.98, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "L4": {"fp32": 30.3, "fp64": 0.49, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "T4": {"fp32": 8.1, "fp64": 0.25, "fp16": 65.0},
}


# The detected figures that are timed, not read, per device kind: they vary by a few percent from
# one measurement to the next, which would move repeated answers and flip near ties, so they
# are measured once per machine and kept (see detect_local). A GPU's peak is its data
# sheet's (GPU_PEAKS), read on every call like the core count.
TIMED_RATES = {"cpu": ("peak_tflops", "peak_tflops_by_type", "memory_bandwidth_gb_s", "node_memory_bandwidth_gb_s"),
               "gpu": ("memory_bandwidth_gb_s",)}


def detect_local(spec: HardwareSpec, cache_dir: Path | None = None, refresh: bool = False, timed: bool = True) -> HardwareSpec:
    """hw=local: this machine's cores, memory and GPUs (link figures come from the file / probe).

    The timed rates (GEMM rate, copy bandwidths) are read from ``cache_dir/detected_<host>.json``
    when it was written for this same machine (host, device, core and device counts), else
    measured and written there; ``refresh`` measures them again (``mode=probe`` does). Not
    ``timed``: the file's rates are left, for a caller that needs only which machine this is."""
    import psutil
    import torch

    from ..machine import cpu_model

    spec.host = socket.gethostname()
    spec.cores_per_node = len(os.sched_getaffinity(0))
    spec.ram_per_node_gb = psutil.virtual_memory().total / GB
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        spec.device_kind, spec.device_name = "gpu", props.name
        spec.devices_per_node = torch.cuda.device_count()
        spec.memory_per_device_gb = props.total_memory / GB
        peaks = next((v for k, v in GPU_PEAKS.items() if k in props.name.upper()), None)
        if peaks is not None:
            spec.peak_tflops = peaks["fp32"]
            spec.peak_tflops_by_type = {k: v for k, v in peaks.items() if k != "fp32"}
    else:
        spec.device_kind, spec.device_name = "cpu", cpu_model()
        spec.devices_per_node = spec.cores_per_node
        spec.memory_per_device_gb = spec.ram_per_node_gb
    return time_local_rates(spec, cache_dir, refresh) if timed else spec


def time_local_rates(spec: HardwareSpec, cache_dir: Path | None = None, refresh: bool = False) -> HardwareSpec:
    """``spec`` (this machine, detected) with its timed rates, kept or measured (:func:`detect_local`)."""
    machine = machine_identity(spec)
    path = cache_dir / f"detected_{spec.host}.json" if cache_dir is not None else None
    rates = None if refresh or path is None else _cached_rates(path, machine, TIMED_RATES[spec.device_kind])
    if rates is None:
        rates = _measure_rates(spec)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"machine": machine, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                                            "rates": rates}, indent=2))
            except OSError as err:
                raise ConfigError(f"detected_dir={cache_dir}: cannot keep this machine's measured rates there "
                                  f"({err.strerror}); give a writable folder, or detected_dir=null to measure "
                                  f"them on every call") from None
    for key, value in rates.items():
        setattr(spec, key, value)
    return spec


def machine_identity(spec: HardwareSpec) -> dict:
    """What tells this machine's kept measurements from another's (another host, or another
    container on this host with other cores or devices)."""
    return {"host": spec.host, "device_name": spec.device_name, "cores_per_node": spec.cores_per_node,
            "devices_per_node": spec.devices_per_node}


def _cached_rates(path: Path, machine: dict, timed: tuple[str, ...]) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    rates = doc.get("rates", {})
    if doc.get("machine") != machine or set(rates) != set(timed):
        return None  # another machine (or another container on this host): measure again
    return rates


def _measure_rates(spec: HardwareSpec) -> dict:
    import torch

    if spec.device_kind == "gpu":
        return {"memory_bandwidth_gb_s": copy_gb_s(torch.device("cuda:0"))}
    cpu = torch.device("cpu")
    by_type = {"fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
    return {"peak_tflops": core_gemm_tflops(), "memory_bandwidth_gb_s": copy_gb_s(cpu),
            "peak_tflops_by_type": {name: core_gemm_tflops(dtype=dtype) for name, dtype in by_type.items()},
            "node_memory_bandwidth_gb_s": copy_gb_s(cpu, threads=spec.cores_per_node)}


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run a measurement on ``threads`` intra-op threads, then give the process its own back."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def copy_gb_s(device, mb: int = 64, repeats: int = 7, threads: int = 1) -> float:
    """Bytes read + written per second by a tensor copy on ``device`` (one core on CPU): the best
    of ``repeats`` copies, as STREAM reports, so a moment of contention does not set the figure."""
    import torch

    with intra_op_threads(threads):
        src = torch.ones(mb * 2**20 // 4, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def core_gemm_tflops(size: int = 512, repeats: int = 8, dtype=None) -> float:
    """What one core achieves on a matrix product in ``dtype`` (fp32 if None): the local CPU's
    practical peak for that format (~0.3 s; a format the CPU has no instructions for, e.g. fp16
    without AVX512-FP16, is emulated and far slower, which is what training in it would see)."""
    import torch

    with intra_op_threads(1):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = time.perf_counter() - start
    return 2 * size**3 * repeats / seconds / 1e12


