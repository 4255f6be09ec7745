"""Hardware descriptions (``conf/hw/*.yaml``): what the performance models need to know.

A typed structured config: ``recommend.py`` registers :class:`HardwareSpec` as the schema of
the ``hw`` group, so an unknown key, a wrong type or a missing field is a Hydra error naming
it; :func:`validate` then checks the values. For CPU machines a *device* is a core: CPU
strategies place processes and threads on cores.
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from ..errors import ConfigError

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
    intra_node: LinkSpec = field(default_factory=LinkSpec)  # between devices (processes) of a node
    intra_node_pairs: list[PairLink] = field(default_factory=list)
    inter_node: Optional[LinkSpec] = None
    memory_bandwidth_gb_s: float = 10.0  # a device's memory bandwidth; on CPU one core's copy rate
    node_memory_bandwidth_gb_s: float = 0.0  # CPU: all cores of a node copying at once (0: cores x one core's)
    allreduce_fixed_us: float = 50.0  # fixed cost of one allreduce call: launch, negotiation, copies
    host: str = ""  # the machine the runs of this hardware were measured on ("" = not this machine)
    detect: bool = False  # fill cores, memory and GPUs from this machine (hw=local)

    @property
    def total_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        """The link between global devices ``a`` and ``b`` (node-major numbering)."""
        if a // self.devices_per_node != b // self.devices_per_node:
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


def from_dict(fields: dict) -> HardwareSpec:
    """A description written out as plain data (``dataclasses.asdict``), typed and checked again."""
    from omegaconf import OmegaConf

    return validate(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareSpec), fields)))


def validate(spec: HardwareSpec) -> HardwareSpec:
    """Values the types cannot check; every message names the key and the fix."""
    if spec.device_kind not in ("cpu", "gpu"):
        raise ConfigError(f"hw.device_kind={spec.device_kind!r} for hw={spec.name}; expected cpu or gpu")
    for key in ("nodes", "devices_per_node", "cores_per_node"):
        if getattr(spec, key) < 1:
            raise ConfigError(f"hw.{key}={getattr(spec, key)} for hw={spec.name}; must be 1 or more")
    for key in ("memory_per_device_gb", "ram_per_node_gb", "peak_tflops"):
        if getattr(spec, key) <= 0:
            raise ConfigError(f"hw.{key}={getattr(spec, key)} for hw={spec.name}; must be > 0")
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
    if spec.nodes > 1 and spec.inter_node is None:
        raise ConfigError(f"hw={spec.name} has nodes={spec.nodes} but no inter_node link; add inter_node: "
                          f"{{bandwidth_gb_s: ..., latency_us: ...}} (40 Gbps Ethernet = 5 GB/s)")
    return spec


# fp32 peak TFLOPS of GPUs by name (vendor data sheets), for hw=local on a GPU machine.
GPU_PEAK_TFLOPS = {"H200": 67.0, "H100": 67.0, "A100": 19.5, "V100": 15.7, "TITAN RTX": 16.3, "A10": 31.2, "L4": 30.3, "T4": 8.1}


# The detected figures that are timed, not read, per device kind: they vary by a few percent from
# one measurement to the next, which would move repeated answers and flip near ties, so they
# are measured once per machine and kept (see detect_local). A GPU's peak is its data
# sheet's (GPU_PEAK_TFLOPS), read on every call like the core count.
TIMED_RATES = {"cpu": ("peak_tflops", "memory_bandwidth_gb_s", "node_memory_bandwidth_gb_s"),
               "gpu": ("memory_bandwidth_gb_s",)}


def detect_local(spec: HardwareSpec, cache_dir: Path | None = None, refresh: bool = False) -> HardwareSpec:
    """hw=local: this machine's cores, memory and GPUs (link figures come from the file / probe).

    The timed rates (GEMM rate, copy bandwidths) are read from ``cache_dir/detected_<host>.json``
    when it was written for this same machine (host, device, core and device counts), else
    measured and written there; ``refresh`` measures them again (``mode=probe`` does)."""
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
        spec.peak_tflops = next((v for k, v in GPU_PEAK_TFLOPS.items() if k in props.name.upper()), spec.peak_tflops)
    else:
        spec.device_kind, spec.device_name = "cpu", cpu_model()
        spec.devices_per_node = spec.cores_per_node
        spec.memory_per_device_gb = spec.ram_per_node_gb
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
    return {"peak_tflops": core_gemm_tflops(), "memory_bandwidth_gb_s": copy_gb_s(cpu),
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


def core_gemm_tflops(size: int = 512, repeats: int = 8) -> float:
    """What one core achieves on an fp32 matrix product: the local CPU's practical peak (~0.3 s)."""
    import torch

    with intra_op_threads(1):
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = time.perf_counter() - start
    return 2 * size**3 * repeats / seconds / 1e12


