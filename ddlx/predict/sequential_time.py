"""The sequential time T_seq of a job on one device, in order of preference (Jansen's thesis ch. 4):

1. measured: ddlx runs of this network and batch on this hardware on one device
   (``sequential``, one core or one GPU);
2. probe: when the hardware is this machine, train a few batches here (the thesis' statistical
   model: per-batch time is stable within seconds, so extrapolate);
3. measured at another batch, scaled per sample;
4. on a GPU, the per-layer GPU model (:mod:`~ddlx.costmodel.gpu_time`: each kernel at its units'
   peak and the memory's bandwidth) with its parameters fitted to the GPU's own measured layers
   where a file holds them (:mod:`~ddlx.costmodel.gpu_measured`), else to published one-GPU
   training throughputs;
5. scaled: counted training FLOPs / (the device's peak x an efficiency calibrated from the
   measured baselines on hardware whose peak is known; a stated default when there are none).

Every result says which one it is.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..job import FP32, Job
from ..process import wait_for
from ..records import (
    MeasuredRun,
    job_of_run,
    measured_per_batch_s,
    on_hardware,
    same_network,
    usable,
)
from ..costmodel.hardware import HardwareSpec, intra_op_threads
from ..costmodel.numerics import numerics_of
from ..costmodel.profile import ModelProfile
from .setups import SequentialTime, is_baseline, weight_seconds

# Fraction of the peak a training step reaches when no run calibrates it: GPU convolution nets
# in fp32 typically reach 30-50%; CPUs near their GEMM rate.
DEFAULT_EFFICIENCY = {"gpu": 0.35, "cpu": 0.5}
# On tensor cores (bf16, fp16) the layers between the convolutions (norms, activations, pooling)
# are bound by memory, not by the products, so mixed precision trains a convolution net a few
# times faster than fp32, not by the ratio of the peaks (8x on a V100, 15x on an H100): NVIDIA's
# published ResNet-50 training throughputs are 2.5-3x fp32's on V100 and A100 and about 2.3x
# TF32's on H100. Without runs, a tensor-core format is assumed this many times fp32's rate
# (at most its own peak).
TENSOR_CORE_SPEEDUP = 2.7


def baselines_on(hw: HardwareSpec, runs: Sequence[MeasuredRun]) -> list[MeasuredRun]:
    """The finished one-device (one core, one GPU) runs measured on ``hw``."""
    return [r for r in runs if usable(r) and on_hardware(r, hw) and is_baseline(r.strategy_setup)]


def from_runs(job: Job, hw: HardwareSpec, runs: Sequence[MeasuredRun], profile: ModelProfile,
              other_batch: bool = True) -> SequentialTime | None:
    """From baselines of the same batch; with ``other_batch``, else from another batch scaled per
    sample (which misses how per-sample cost changes with the batch)."""
    base = [r for r in baselines_on(hw, runs) if same_network(r, job)]
    same_batch = [r for r in base if int(r.params["data.batch_size"]) == job.batch_size]
    chosen = same_batch or (base if other_batch else [])
    if not chosen:
        return None
    weights = weight_seconds(profile, hw)
    step_per_sample = [(measured_per_batch_s(r) - weights) / int(r.params["data.batch_size"]) for r in chosen]
    if hw.device_kind == "gpu":
        # A GPU step's data wait is the host's loading, which the job's own data.num_workers decides:
        # a wait measured with loaders beside the steps is not the job's loading between steps
        # (data.num_workers=0), nor the reverse. Each run's step without its wait; the job's
        # loading only from runs that loaded as it will (else the loading is timed here).
        per_sample = statistics.median(step - _load_per_sample_s(r) for step, r in zip(step_per_sample, chosen))
        load = statistics.median(_load_per_sample_s(r) if _loads_between_steps(r) == (job.num_workers == 0) else 0.0
                                 for r in chosen)
    else:
        load = statistics.median(_load_per_sample_s(r) for r in chosen)
        per_sample = statistics.median(step_per_sample) - load
    what = "same batch" if same_batch else f"batch {chosen[0].params['data.batch_size']}, scaled per sample"
    return SequentialTime(max(per_sample, 1e-9), weights, f"measured ({len(chosen)} run{'s' * (len(chosen) > 1)}, {what})", load,
                          measured=bool(same_batch))


def with_measured_shares(seq: SequentialTime, job: Job, hw: HardwareSpec, runs: Sequence[MeasuredRun],
                         profile: ModelProfile) -> SequentialTime:
    """``seq`` with a step at n samples (a data-parallel worker's share, a micro-batch) taken from
    the one-device runs measured at batch n where there are any, else ``seq``'s own per sample.
    Scaling per sample misses a step's fixed cost, which at small batches is most of it: with
    ``data.batch_per=worker`` a process's share is the batch a run measured, and its own time is
    what the process pays. ``seq`` as it is where it prices steps of any size already (the GPU model)."""
    if seq.step_s is not None:
        return seq

    @functools.lru_cache(maxsize=32)
    def share(samples: int) -> SequentialTime | None:
        if samples == job.batch_size:
            return None
        return from_runs(dataclasses.replace(job, batch_size=samples), hw, runs, profile, other_batch=False)

    measured = sorted({int(r.params["data.batch_size"]) for r in baselines_on(hw, runs) if same_network(r, job)}
                      - {job.batch_size})
    if not measured:
        return seq

    def step_s(samples: int) -> float:
        own = share(samples)
        return samples * (own or seq).per_sample_s

    return dataclasses.replace(seq, step_s=step_s, basis=f"{seq.basis}; where a process's share or a micro-batch is "
                               f"{' or '.join(map(str, measured))} samples, its step from runs at that batch")


def _loads_between_steps(run: MeasuredRun) -> bool:
    """The run loaded its data in the training process (data.num_workers=0)."""
    return int(run.params.get("data.num_workers") or 0) == 0


def _load_per_sample_s(run: MeasuredRun) -> float:
    """The run's last measured epoch's data wait, per training sample (0 if it has none)."""
    wait = run.metrics.get("data_wait_s")
    return 0.0 if wait is None else wait / job_of_run(run).train_samples


@dataclass(frozen=True)
class ProbedBatch:
    """One probed training batch: its seconds from the end of the previous one, and the part of
    them spent waiting for the loader (and the copy to the device), as a run's ``data_wait_s``."""

    seconds: float
    data_wait_s: float


def from_probe(job: Job, hw: HardwareSpec, profile: ModelProfile, train_batches: Callable[[int], list[ProbedBatch]]) -> SequentialTime:
    """``train_batches(n)`` trains n batches of the job on one device (the first, warm-up, dropped
    by the caller); the medians are the batch time and its loading. The loading is kept apart
    because the strategies share it out differently (see :mod:`.setups`): without it the threads
    strategy is credited with splitting the loading it does in one thread."""
    batches = train_batches(4)
    batch_s = statistics.median(b.seconds for b in batches)
    wait_s = statistics.median(b.data_wait_s for b in batches)
    weights = weight_seconds(profile, hw)
    load = wait_s / job.batch_size
    return SequentialTime(max((batch_s - weights) / job.batch_size - load, 1e-9), weights,
                          f"local probe ({len(batches)} batches, median {batch_s:.3f} s, {wait_s:.3f} s of it loading)", load)


def efficiency_from_runs(runs: Sequence[MeasuredRun], hw_of_run: Callable[[MeasuredRun], HardwareSpec | None],
                         profile_of: Callable[[MeasuredRun], ModelProfile], kind: str) -> list[float]:
    """Achieved fraction of peak of the one-device baselines on hardware of ``kind``, each
    against the peak of its own precision."""
    out = []
    for run in runs:
        hw = hw_of_run(run)
        if hw is None or hw.device_kind != kind or not usable(run) or not is_baseline(run.strategy_setup):
            continue
        profile = profile_of(run)
        batch = int(run.params["data.batch_size"])
        compute_s = measured_per_batch_s(run) - weight_seconds(profile, hw)
        peak, _ = hw.peak_for(numerics_of(run.workload.precision))
        if compute_s > 0:
            out.append(batch * profile.train_flops_per_sample / compute_s / (peak * 1e12))
    return out


def priced_per_layer(numerics) -> bool:
    """Whether the per-layer GPU model prices a step in ``numerics``: fp32 and the 2-byte formats,
    not fp64 (its kernels are traced in the format's activation bytes)."""
    return numerics.activation_bytes in (2, 4) and numerics.compute != "fp64"


def from_gpu_model(job: Job, hw: HardwareSpec, hw_dir=None) -> SequentialTime | None:
    """The per-layer GPU model's step at the job's batch (None where it has none: fp64, a
    format other than fp32 and the 2-byte ones): its optimizer step is the weight traffic, the
    rest is shared out per sample."""
    from ..costmodel.gpu_measured import measured_fit
    from .hw_files import DEFAULT_HW_DIR, published_fit
    from ..costmodel.gpu_time import step_time
    from ..costmodel.kernels import kernel_profile

    numerics = numerics_of(job.precision)
    if hw.device_kind != "gpu" or not priced_per_layer(numerics):
        return None
    model = measured_fit(hw) or published_fit(hw_dir or DEFAULT_HW_DIR)  # the GPU's own layers, where measured
    kernels = kernel_profile(job.model, job.num_classes, job.channels, job.image_size, numerics.activation_bytes == 2)

    @functools.lru_cache(maxsize=64)
    def layers_s(samples: int) -> tuple[tuple[float, float], ...]:
        step = step_time(kernels, samples, hw, model.params, numerics.compute, optimizer=False)
        return tuple(zip(step.forward_s, step.backward_s))

    def compute_s(samples: int) -> float:
        return sum(f + b for f, b in layers_s(samples))

    step = step_time(kernels, job.batch_size, hw, model.params, numerics.compute)
    precision = "" if job.precision == FP32 else f"{job.precision}, "
    if numerics.compute != "fp32" and numerics.compute not in hw.peak_tflops_by_type:
        precision += f"hw.peak_tflops_by_type gives no {numerics.compute} peak: on the fp32 units, "
    return SequentialTime(compute_s(job.batch_size) / job.batch_size, step.optimizer_s,
                          f"estimate: {model.basis} ({precision}{step.total_s * 1e3:.1f} ms a step of {job.batch_size})",
                          estimated=True, step_s=compute_s, layers_s=layers_s)


def default_efficiency(hw: HardwareSpec, precision: str) -> float:
    """The share of the precision's peak assumed when no run of it calibrates it: on a GPU's
    tensor cores, :data:`TENSOR_CORE_SPEEDUP` times fp32's assumed rate, at most the peak's share."""
    numerics = numerics_of(precision)
    peak, _ = hw.peak_for(numerics)
    base = DEFAULT_EFFICIENCY[hw.device_kind]
    if hw.device_kind == "gpu" and numerics.compute in ("bf16", "fp16") and peak > hw.peak_tflops:
        return base * min(peak, TENSOR_CORE_SPEEDUP * hw.peak_tflops) / peak
    return base


def from_flops(job: Job, hw: HardwareSpec, profile: ModelProfile, efficiencies: Sequence[float]) -> SequentialTime:
    """``efficiencies``: of baselines in the job's precision (the caller's runs are of it)."""
    peak, which = hw.peak_for(numerics_of(job.precision))
    if efficiencies:
        eff = statistics.median(efficiencies)
        how = f"efficiency {eff:.2f} of peak from {len(efficiencies)} measured {hw.device_kind} baseline(s)"
    else:
        eff = default_efficiency(hw, job.precision)
        how = f"assumed efficiency {eff:.2f} of peak: no measured {hw.device_kind} baseline to calibrate"
    per_sample = profile.train_flops_per_sample / (peak * 1e12 * eff)
    precision = "" if job.precision == FP32 else f"{job.precision}, "
    return SequentialTime(per_sample, weight_seconds(profile, hw),
                          f"scaled estimate ({profile.train_flops_per_sample / 1e9:.2f} GFLOP/sample at "
                          f"{peak:g} TFLOPS, {precision}{which}, {how})", estimated=True)


# Images a probe writes (or reads) at least, beyond what its batches need: never the whole dataset.
PROBE_IMAGES = 256
# The batch the loading probe times (seconds per sample do not depend on it; fewer images do).
LOADING_PROBE_BATCH = 16


def probe_data(cfg_data, batches: int, batch_size: int | None = None):
    """The data config (a :class:`~ddlx.config.DataConfig`) a probe trains on: the job's, with
    ``batch_size`` if given, cut to enough images for ``batches`` training batches (at least
    :data:`PROBE_IMAGES` and one per class)."""
    batch = batch_size or cfg_data.batch_size
    need = max(PROBE_IMAGES, cfg_data.num_classes, math.ceil(batches * batch / (1 - cfg_data.val_fraction)) + 1)
    have = cfg_data.num_images
    return dataclasses.replace(cfg_data, num_images=need if have is None else min(have, need), batch_size=batch)


def probe_batches(cfg_data, model: str, threads: int = 1, max_seconds: float = 30.0,
                  optim=None, precision: str = FP32) -> Callable[[int], list[ProbedBatch]]:
    """A probe on this machine with ddlx's own datamodule (the real decode and augmentation) and
    the LightningModule train.py trains (its loss, its optimizer with ``optim``'s settings), one
    core or one GPU: train n + 1 batches, return the last n (stops early at ``max_seconds``,
    keeping at least two), in ``precision`` through Lightning's own precision plugin. The steps are
    run by hand: a Trainer's start would cost more than them."""

    def run(n: int) -> list[ProbedBatch]:
        from ..data.image_data import ImageFolderData

        data = probe_data(cfg_data, n + 2)
        writing = ImageFolderData.of_process(data).prepare_data_ahead()  # while the training stack imports (seconds)
        try:
            import torch

            from ..models import build_model
            from ..module import ClassifierModule
            from ..data.datamodule import build_datamodule
        finally:
            wait_for(writing)
        dm = build_datamodule(data)
        dm.workers_to_say = False  # train.py's line about its training processes' cores
        dm.prepare_data()
        dm.setup("fit")
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        plugin = precision_plugin(precision, device.type)
        with intra_op_threads(threads):
            net = build_model(model, cfg_data.num_classes, cfg_data.channels, cfg_data.image_size, None)
            module = ClassifierModule(net, cfg_data.num_classes, **(dataclasses.asdict(optim) if optim is not None else {}))
            module = plugin.convert_module(module).to(device)
            opt = module.configure_optimizers()
            times, start, spent = [], time.perf_counter(), time.perf_counter()
            try:
                for i, (x, y) in enumerate(dm.train_dataloader()):
                    x, y = plugin.convert_input(x.to(device)), y.to(device)
                    loaded = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    with plugin.forward_context():
                        loss = module.loss(module(x), y)
                    loss.backward()
                    opt.step()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    now = time.perf_counter()
                    if i > 0:
                        times.append(ProbedBatch(now - start, loaded - start))
                    start = now
                    if len(times) >= n or (len(times) >= 2 and now - spent > max_seconds):
                        break
            finally:  # the loader's workers, left waiting by the break: at exit multiprocessing would kill
                dm.end_workers()  # them, and torch's SIGCHLD handler print a traceback for each
        return times

    return run


def precision_plugin(precision: str, device_type: str):
    """Lightning's precision plugin for ``precision``, as the Trainer picks it."""
    from pytorch_lightning.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

    if precision.endswith("-mixed"):
        return MixedPrecision(precision, device_type)
    if precision in ("bf16-true", "16-true"):
        return HalfPrecision(precision)
    return DoublePrecision() if precision == "64-true" else Precision()


def probe_loading(cfg_data, max_seconds: float = 30.0) -> Callable[[], float]:
    """A probe of ddlx's data pipeline alone (decode, augmentation, collate) in this process, one
    core (``data.num_workers=0``): seconds per sample, the median over a few batches after the
    first. What a loader worker process does per sample, on this machine's core."""

    def run() -> float:
        from ..data.image_data import ImageFolderData  # not Lightning's datamodule: its import is no part of loading

        dm = ImageFolderData.of_process(dataclasses.replace(
            probe_data(cfg_data, 6, min(cfg_data.batch_size, LOADING_PROBE_BATCH)), num_workers=0))
        writing = dm.prepare_data_ahead()
        try:
            import torchvision.datasets.folder  # noqa: F401 - setup's import (seconds), while the child writes
        finally:
            wait_for(writing)
        dm.prepare_data()
        dm.setup("fit")
        per_sample, start, spent = [], time.perf_counter(), time.perf_counter()
        with intra_op_threads(1):
            for i, (x, _) in enumerate(dm.train_dataloader()):
                now = time.perf_counter()
                if i > 0:
                    per_sample.append((now - start) / len(x))
                start = now
                if len(per_sample) >= 4 or (len(per_sample) >= 2 and now - spent > max_seconds):
                    break
        if not per_sample:
            raise ValueError("the data has fewer than two training batches to time the loading on")
        return statistics.median(per_sample)

    return run
