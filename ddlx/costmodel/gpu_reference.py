"""Published one-GPU training throughputs, and the GPU time model's parameters fitted to them.

``reference/gpu_training_throughput.csv`` holds every figure found, each with its source (a
repository, a file and its commit, where in it); those marked ``fit=yes`` (PyTorch, mixed
precision as AMP, the batch stated, NCHW as ddlx trains, a GPU with a description in
``conf/hw``) are what the parameters of :class:`~.gpu_time.GpuParams` are fitted to, by least
squares on the logarithm of predicted over published images/s; the others say why they are left
out. :func:`leave_one_out` predicts each fitted figure from the others. The GPUs' descriptions
come typed from the caller (``ddlx.predict.hw_files.cited_hardware`` reads ``conf/hw``).
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .gpu_time import BOUNDS, GpuParams, StepArrays, seconds, step_arrays
from .hardware import HardwareSpec
from .kernels import kernel_profile
from .numerics import numerics_of
from .profile import _cache_path

# The goal's cells (issue 41): these networks on each GPU, in each precision.
GOAL_MODELS = ("resnet50", "resnet18", "vgg16", "alexnet")
REFERENCE = Path(__file__).resolve().parent / "reference" / "gpu_training_throughput.csv"
NUM_CLASSES = 1000  # ImageNet's: every published figure is of it


@dataclass(frozen=True)
class Figure:
    hw: str  # the conf/hw description of the GPU
    gpu: str
    model: str
    precision: str
    batch: int
    image_size: int
    images_per_s: float
    optimizer_step: bool  # False: forward and backward only (the source times no optimizer step)
    fit: bool
    excluded_because: str
    source: str  # repository + path @ commit, and where in it

    @property
    def label(self) -> str:
        return f"{self.gpu} {self.model} {self.precision} b{self.batch}"


def by_cell(figures: list[Figure], errors: list[float]) -> list[float]:
    """Each cell's error (GPU as its hw file names it, network, precision; the goal's networks
    only): the median of its published figures' errors, as sources disagree on one cell by up to
    25% (Lambda's A100 PCIe ResNet-50 AMP at batch 720: 1117 and 1393 img/s)."""
    cells: dict[tuple, list[float]] = {}
    for figure, error in zip(figures, errors):
        if figure.model in GOAL_MODELS:
            cells.setdefault((figure.hw, figure.model, figure.precision), []).append(error)
    return [statistics.median(e) for e in cells.values()]


def load_reference(path: Path = REFERENCE) -> list[Figure]:
    with open(path, newline="") as f:
        return [Figure(row["hw"], row["gpu"], row["model"], row["precision"], int(row["batch"] or 0), int(row["image_size"]) if row["image_size"].isdigit() else 0,
                       float(row["images_per_s"]), row["optimizer_step"] == "yes", row["fit"] == "yes",
                       row["excluded_because"], f"{row['source']} {row['path']} @ {row['commit'][:10]}: {row['where']}")
                for row in csv.DictReader(f)]


def arrays_of(figure: Figure, hw: HardwareSpec) -> StepArrays:
    return imagenet_step(figure.model, figure.image_size, figure.batch, figure.precision, hw, figure.optimizer_step)


def imagenet_step(model: str, image_size: int, batch: int, precision: str, hw: HardwareSpec,
                  optimizer: bool = True) -> StepArrays:
    """The kernels of a training step of ``model`` on ImageNet's classes (RGB) at ``image_size``."""
    numerics = numerics_of(precision)
    kernels = kernel_profile(model, NUM_CLASSES, 3, image_size, numerics.precision.endswith("-mixed"))
    return step_arrays(kernels, batch, hw, numerics.compute, optimizer)


def predicted_images_per_s(step: StepArrays, batch: int, params: GpuParams) -> float:
    per_segment, optimizer_s = seconds(step, params)
    return batch / (per_segment.sum() + optimizer_s)


def fit(steps: list[tuple[StepArrays, Figure]]) -> GpuParams:
    """The parameters that minimize the squared log-ratio of predicted to published images/s."""
    def loss(params: GpuParams) -> float:
        errors = [math.log(predicted_images_per_s(step, f.batch, params) / f.images_per_s) for step, f in steps]
        return float(np.mean(np.square(errors)))

    return minimize(loss)


def minimize(loss) -> GpuParams:
    """The parameters that minimize ``loss(params)`` within :data:`~.gpu_time.BOUNDS`
    (Nelder-Mead on a transform that keeps them there)."""
    lows, highs = (np.array(b) for b in zip(*BOUNDS))

    def unpack(z: np.ndarray) -> GpuParams:
        return GpuParams.of(lows + (highs - lows) * 0.5 * (1 + np.tanh(z / 2)))  # a logistic that cannot overflow

    start = np.zeros(len(BOUNDS))
    best = _nelder_mead(lambda z: loss(unpack(z)), start)
    for _ in range(2):  # restarts from the best point: Nelder-Mead can stall on a ridge
        best = _nelder_mead(lambda z: loss(unpack(z)), best)
    return unpack(best)


def _nelder_mead(f, x0: np.ndarray, step: float = 1.0, iterations: int = 1500, tolerance: float = 1e-10) -> np.ndarray:
    n = len(x0)
    points = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(p) for p in points]
    for _ in range(iterations):
        order = np.argsort(values)
        points, values = [points[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centroid = np.mean(points[:-1], axis=0)
        reflected = centroid + (centroid - points[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - points[-1])
            fe = f(expanded)
            points[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            points[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (points[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                points[-1], values[-1] = contracted, fc
            else:
                points = [points[0] + 0.5 * (p - points[0]) for p in points]
                values = [values[0]] + [f(p) for p in points[1:]]
    return points[int(np.argmin(values))]


def fitted_steps(hws: Mapping[str, HardwareSpec], figures: list[Figure] | None = None) -> list[tuple[StepArrays, Figure]]:
    """Each fitted figure's step on its GPU (``hws``: the descriptions by the names the figures cite)."""
    figures = [f for f in (figures if figures is not None else load_reference()) if f.fit]
    return [(arrays_of(f, hws[f.hw]), f) for f in figures]


def cited_names(figures: list[Figure] | None = None) -> set[str]:
    """The ``conf/hw`` names of the GPUs the fitted figures ran on."""
    return {f.hw for f in (figures if figures is not None else load_reference()) if f.fit}


@dataclass(frozen=True)
class FittedModel:
    params: GpuParams
    figures: int  # how many published figures it was fitted to

    @property
    def basis(self) -> str:
        return f"per-layer GPU model fitted to {self.figures} published one-GPU training throughputs"


def fitted_model(hws: Mapping[str, HardwareSpec]) -> FittedModel:
    """The parameters fitted to the reference table, kept on disk beside the model profiles (the
    fit takes seconds) and keyed by the table, the descriptions it is given and this code."""
    def compute() -> dict:
        steps = fitted_steps(hws)
        return {"params": fit(steps).as_tuple(), "figures": len(steps)}

    described = json.dumps({name: asdict(hw) for name, hw in sorted(hws.items())}, sort_keys=True, default=str)
    kept = kept_fit("gpu-model", [REFERENCE], compute, also=described)
    return FittedModel(GpuParams.of(kept["params"]), kept["figures"])


# Fits shipped with ddlx, keyed as on disk: a first question on a new machine reads them instead
# of tracing every reference network and fitting (over a minute on 2 cores). A key from other
# inputs or code finds none and fits, as before; tests/test_gpu_model.py says when to refresh them.
SHIPPED_FITS = REFERENCE.with_name("fits.json")
_recorded: dict[str, dict] = {}  # what record_fits() collects


def kept_fit(name: str, sources: list[Path], compute, also: str = "") -> dict:
    """``compute()``'s JSON-able result, keyed by the files it reads (``sources``), ``also`` and
    the model's code: read from :data:`SHIPPED_FITS`, else from the disk beside the model
    profiles, else computed and kept there (a fit takes seconds, a question should not)."""
    key = hashlib.sha256((name + also).encode())
    here = Path(__file__)
    for source in [*sources, here, here.with_name("gpu_time.py"), here.with_name("kernels.py")]:
        key.update(source.read_bytes())
    digest = key.hexdigest()[:16]
    result = shipped_fits().get(digest, {}).get("result")
    path = _cache_path("gpu-model", 0, 0, 0).with_name(f"{name}-{digest}.json")
    if result is None:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            result = run_fit(compute)
            _keep(path, result)
    _recorded[digest] = {"name": name, "result": result}
    return result


def run_fit(compute) -> dict:
    return compute()


def _keep(path: Path, result: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(result))
        os.replace(partial, path)
    except OSError:
        pass


def shipped_fits() -> dict[str, dict]:
    try:
        return json.loads(SHIPPED_FITS.read_text())
    except (OSError, ValueError):
        return {}


def record_fits(calls) -> dict[str, dict]:
    """The fits that ``calls()`` reads or computes, by key: what :data:`SHIPPED_FITS` holds."""
    _recorded.clear()
    calls()
    return dict(sorted(_recorded.items()))


def leave_one_out(steps: list[tuple[StepArrays, Figure]]) -> list[tuple[Figure, float]]:
    """Each figure predicted by the model fitted to all the others: (figure, predicted images/s)."""
    out = []
    for i, (step, figure) in enumerate(steps):
        params = fit(steps[:i] + steps[i + 1:])
        out.append((figure, predicted_images_per_s(step, figure.batch, params)))
    return out
