"""The GPU time model against steps measured at 32 px on an H200: the regime of the thesis's
CIFAR-10 pipelines (micro-batches of 64), where a step is set by the host issuing kernels as much
as by the GPU running them.

    python studies/gpu_small_images.py

The measurements (studies/gpu-h200/layers_32px.csv, memory_32px.csv) are
``benchmarks/gpu_layers.py --models resnet18 resnet50 resnet152 vgg11 vgg16 --image-size 32
--num-classes 10 --batches 64 128 --precisions 32-true`` on the H200 of docs/gpu.md (2026-11-26,
third sitting). They are not in the model's calibration (ddlx/costmodel/reference/), which holds
224 px steps only: here they are held out. Printed:

1. each step against the model with the shipped parameters: the published fit (other GPUs'
   throughputs) and the fit to the H200's 224 px layers; beside it the host's time per forward
   kernel (the forward's measured time over the model's count of its kernels);
2. the imbalance of four pipeline stages cut by time, on the measured layers and on the model's;
3. the H200 fit redone with each layer's pass priced as an asynchronous queue (the host issues
   pass after pass while the GPU runs what was issued, instead of each pass taking the longer of
   the host's and the GPU's time): its error on the 224 px steps it is fitted to and on these.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import ddlx.costmodel.gpu_measured as measured  # noqa: E402
from ddlx.costmodel import gpu_time  # noqa: E402
from ddlx.parallel.cuts import contiguous_balance  # noqa: E402
from ddlx.predict.hw_files import hw_file, published_fit  # noqa: E402

SMALL = HERE / "gpu-h200" / "layers_32px.csv"
SHIPPED = measured.measurement_files()[0]


def queued_seconds(step: gpu_time.StepArrays, params: gpu_time.GpuParams) -> tuple[np.ndarray, float]:
    """Each (layer, pass) as the increase of the GPU's finishing time when the host issues the
    passes one after another (issue_us a kernel) and the GPU runs a pass's work once the host has
    issued it, its last kernel no sooner than the host's issue of it."""
    gpu, optimizer_s = gpu_time.seconds(step, dataclasses.replace(params, issue_us=0.0))  # the GPU's time alone
    issued = np.cumsum(step.kernels * params.issue_us * 1e-6)
    ran = np.cumsum(gpu)
    finish = ran + np.maximum(0.0, np.maximum.accumulate(issued + gpu / np.maximum(step.kernels, 1) - ran))
    return np.diff(finish, prepend=0.0), optimizer_s


def imbalance(layer_s: list[float], stages: int = 4) -> float:
    cut, stage_s, start = contiguous_balance(layer_s, stages), [], 0
    for count in cut:
        stage_s.append(sum(layer_s[start:start + count]))
        start += count
    return max(stage_s) / (sum(stage_s) / stages)


def errors(steps, params, hw) -> list[float]:
    return [measured.predicted_step_s(measured.arrays_of(s, hw), params) / s.step_s - 1 for s in steps]


def summary(e: list[float]) -> str:
    a = [abs(x) for x in e]
    return f"median {100 * statistics.median(a):.1f}%, {sum(x <= 0.15 for x in a)} of {len(a)} within 15%, largest {100 * max(e, key=abs):+.0f}%"


def main() -> None:
    hw = hw_file("h200_1x")
    small, shipped = measured.load_measured(SMALL), measured.load_measured(SHIPPED)
    published, own = published_fit().params, measured.measured_fit(hw).params
    print("| network | batch | measured ms | forward share | forward kernels | host µs a forward kernel | published fit | "
          "H200 224 px fit |\n|---|---|---|---|---|---|---|---|")
    for s, p, o in zip(small, errors(small, published, hw), errors(small, own, hw)):
        share = sum(s.forward_s) / (sum(s.forward_s) + sum(s.backward_s))
        kernels = measured.arrays_of(s, hw).kernels[0::2].sum()  # the model's count of the forward's kernels
        print(f"| {s.model} | {s.batch} | {1e3 * s.step_s:.2f} | {share:.2f} | {kernels:.0f} | {1e6 * sum(s.forward_s) / kernels:.0f} | "
              f"{100 * p:+.0f}% | {100 * o:+.0f}% |")
    print(f"\nThe fits' host time to issue a kernel: published {published.issue_us:.0f} µs, H200 {own.issue_us:.0f} µs.")
    print("\nFour pipeline stages cut as torchgpipe's partitioner cuts them (contiguous, by time): the slowest "
          "stage over a quarter of the layers' time\n")
    print("| network | batch | on the measured layers | on the H200 fit's layers |\n|---|---|---|---|")
    for s in small:
        per_segment, _ = gpu_time.seconds(measured.arrays_of(s, hw), own)
        predicted = list(per_segment[0::2] + per_segment[1::2])
        timed = [f + b for f, b in zip(s.forward_s, s.backward_s)]
        print(f"| {s.model} | {s.batch} | {imbalance(timed):.3f} | {imbalance(predicted):.3f} |")
    print("\nThe H200 fit redone on its 224 px layers (the 32 px steps held out):\n")
    print("| a pass takes | 224 px (fitted) | 32 px (held out) |\n|---|---|---|")
    for name, priced in (("the longer of host and GPU (shipped)", gpu_time.seconds), ("its share of an asynchronous queue", queued_seconds)):
        measured.seconds = priced  # what fit_to_layers and predicted_step_s price with
        try:
            params = measured.fit_to_layers([(measured.arrays_of(s, hw), s) for s in shipped])
            print(f"| {name} | {summary(errors(shipped, params, hw))} | {summary(errors(small, params, hw))} |")
        finally:
            measured.seconds = gpu_time.seconds


if __name__ == "__main__":
    main()
