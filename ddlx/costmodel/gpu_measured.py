"""Per-layer times measured on a real GPU, and the GPU time model's parameters fitted to them.

``reference/gpu_layers_<gpu>.csv`` holds what ``benchmarks/gpu_layers.py`` measured on one GPU
(studies/gpu_checks.py ran it): the forward and backward time of every layer of the seven networks
at two batch sizes in fp32 (PyTorch's defaults), bf16-mixed and 16-mixed, the whole step and the
optimizer step, with the device, driver, torch and CUDA versions of each row. Fitted to these
(each layer's pass by the squared log-ratio of predicted to measured, weighted by its share of
its step), :class:`~.gpu_time.GpuParams` describe that GPU from measurement instead of from
published throughputs; :func:`leave_one_network_out` says how well they predict a network they
were not fitted to. The recommender uses them for a hw file whose ``device_name`` is the
measured device's.
"""
from __future__ import annotations

import csv
import json
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from .gpu_reference import NUM_CLASSES, imagenet_step, kept_fit, minimize
from .gpu_time import GpuParams, StepArrays, seconds
from .hardware import HardwareSpec

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
FLOOR_S = 1e-6  # a pass timed or predicted below this is taken as this (a Flatten runs no kernel)


@dataclass(frozen=True)
class MeasuredStep:
    """One network, batch and precision on the measured GPU: each layer's forward and backward
    seconds, the whole step's and the optimizer step's."""

    device: str
    versions: str  # driver, torch, CUDA
    model: str
    image_size: int
    batch: int
    precision: str
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    step_s: float
    optimizer_s: float

    @property
    def label(self) -> str:
        return f"{self.model} b{self.batch} {self.precision}"


def measurement_files() -> list[Path]:
    return sorted(REFERENCE_DIR.glob("gpu_layers_*.csv"))


def load_measured(path: Path) -> list[MeasuredStep]:
    steps: OrderedDict[tuple, list[dict]] = OrderedDict()
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            steps.setdefault((row["model"], row["image_size"], row["batch"], row["precision"]), []).append(row)
    out = []
    for (model, size, batch, precision), rows in steps.items():
        rows.sort(key=lambda r: int(r["layer"]))
        first = rows[0]
        out.append(MeasuredStep(first["device"], f"driver {first['driver']}, torch {first['torch']}, CUDA {first['cuda']}",
                                model, int(size), int(batch), precision,
                                tuple(float(r["forward_ms"]) / 1e3 for r in rows),
                                tuple(float(r["backward_ms"]) / 1e3 for r in rows),
                                float(first["step_ms"]) / 1e3, float(first["optimizer_ms"]) / 1e3))
    return out


def arrays_of(step: MeasuredStep, hw: HardwareSpec) -> StepArrays:
    return imagenet_step(step.model, step.image_size, step.batch, step.precision, hw)


def predicted_step_s(arrays: StepArrays, params: GpuParams) -> float:
    per_segment, optimizer_s = seconds(arrays, params)
    return float(per_segment.sum() + optimizer_s)


def fit_to_layers(pairs: list[tuple[StepArrays, MeasuredStep]]) -> GpuParams:
    """Each step counts alike; within it, each layer's pass by its share of the step's time."""
    measured = [np.maximum(np.ravel(np.column_stack([m.forward_s, m.backward_s])), FLOOR_S) for _, m in pairs]
    weights = [t / t.sum() for t in measured]

    def loss(params: GpuParams) -> float:
        total = 0.0
        for (arrays, m), t, w in zip(pairs, measured, weights):
            per_segment, optimizer_s = seconds(arrays, params)
            total += float(np.sum(w * np.square(np.log(np.maximum(per_segment, FLOOR_S) / t))))
            total += math.log((per_segment.sum() + optimizer_s) / m.step_s) ** 2
        return total / len(pairs)

    return minimize(loss)


@dataclass(frozen=True)
class MeasuredFit:
    params: GpuParams
    device: str
    steps: int
    layers: int
    source: str

    @property
    def basis(self) -> str:
        return (f"per-layer GPU model fitted to {self.layers} layer times of {self.steps} training steps measured on "
                f"an {self.device} ({self.source})")


def measured_fit(hw: HardwareSpec) -> MeasuredFit | None:
    """The parameters fitted to the measurements of the GPU ``hw`` describes (its ``device_name``),
    if a file holds them; fitted once and kept on disk."""
    for path in measurement_files():
        steps = [s for s in _measured(path) if s.device == hw.device_name]
        if not steps:
            continue

        def compute() -> dict:
            return {"params": fit_to_layers([(arrays_of(s, hw), s) for s in steps]).as_tuple()}

        kept = kept_fit("gpu-measured", [path], compute, also=json.dumps(asdict(hw), sort_keys=True, default=str))
        return MeasuredFit(GpuParams.of(kept["params"]), hw.device_name, len(steps), sum(len(s.forward_s) for s in steps),
                           f"ddlx/costmodel/reference/{path.name}")
    return None


@lru_cache(maxsize=4)
def _measured(path: Path) -> tuple[MeasuredStep, ...]:
    return tuple(load_measured(path))


def leave_one_network_out(pairs: list[tuple[StepArrays, MeasuredStep]]) -> list[tuple[MeasuredStep, float]]:
    """Each step predicted by the parameters fitted to the other networks' steps: (step, predicted s)."""
    out = []
    for network in dict.fromkeys(m.model for _, m in pairs):
        params = fit_to_layers([p for p in pairs if p[1].model != network])
        out.extend((m, predicted_step_s(arrays, params)) for arrays, m in pairs if m.model == network)
    return out


def memory_files() -> list[Path]:
    return sorted(REFERENCE_DIR.glob("gpu_memory_*.csv"))


def working_memory_residuals(path: Path) -> list[tuple[dict, float]]:
    """Each measured peak (``benchmarks/gpu_layers.py``: ``torch.cuda.max_memory_allocated`` over
    a training step) less what :func:`~.memory.estimate_training_memory` counts: (row, bytes)."""
    from .memory import estimate_training_memory

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        estimate, _ = estimate_training_memory(row["model"], NUM_CLASSES, 3, int(row["image_size"]), int(row["batch"]),
                                               precision=row["precision"])
        out.append((row, float(row["peak_mb"]) * 2**20 - estimate.total_bytes))
    return out


@lru_cache(maxsize=1)
def gpu_working_memory() -> tuple[int, str]:
    """(bytes, basis): what a training step on a GPU holds beyond the counted weights, gradients,
    optimizer state, activations and batch (cuBLAS's and cuDNN's workspaces, the loss and logits'
    buffers): the median of the measured peaks' excess, kept on disk."""
    files = memory_files()
    if not files:
        return 0, "no GPU's peak memory measured"
    here = Path(__file__).parent

    def compute() -> dict:
        excess = [b for path in files for _, b in working_memory_residuals(path)]
        return {"bytes": int(np.median(excess)), "peaks": len(excess)}

    kept = kept_fit("gpu-working-memory", [*files, here / "memory.py", here / "profile.py", here / "numerics.py"], compute)
    names = ", ".join(f"ddlx/costmodel/reference/{p.name}" for p in files)
    return kept["bytes"], f"the median excess of {kept['peaks']} measured peaks over the counted memory ({names})"
