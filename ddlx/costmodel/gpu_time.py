"""Seconds of a training step on a GPU, layer by layer and pass by pass, from the kernels it runs
(:mod:`.kernels`) and the GPU's description (``conf/hw``).

Each matrix product takes the longer of its operations at the rate of the units that run it and
its bytes at the memory's rate; every other kernel its bytes at the memory's rate; every kernel a
launch; the optimizer step reads and writes the weights and their state. The units:

- under autocast (``*-mixed``), the tensor cores at the format's peak (fp16, bf16);
- in fp32, PyTorch's defaults: convolutions on TF32 tensor cores where the GPU has them
  (``torch.backends.cudnn.allow_tf32`` is True), fully connected layers in fp32
  (``torch.backends.cuda.matmul.allow_tf32`` is False); on GPUs without TF32 (Volta, Turing) a
  dense 3x3 stride-1 convolution in fp32 may run as Winograd, which does fewer operations than
  the counted ones;
- grouped (depthwise) convolutions on the fp32 units whatever the precision.

A product reaches less of its units' peak the smaller it is (a small batch leaves them idle):
efficiency x work / (work + half_gflop). The few parameters (:class:`GpuParams`) are fitted to
published one-GPU training throughputs (:mod:`.gpu_reference`), not assumed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .hardware import GB, HardwareSpec
from .kernels import KernelProfile

OPTIMIZER_BYTES_PER_PARAM = 5 * 4  # SGD with momentum on fp32 weights: read weight, gradient, momentum; write weight, momentum
OPTIMIZER_KERNELS = 4  # foreach: a few launches for all the weights


@dataclass(frozen=True)
class GpuParams:
    fp32_efficiency: float  # share of the fp32 units' peak a large product reaches
    tensor_efficiency: float  # share of the tensor cores' peak (TF32, fp16, bf16) a large product reaches
    half_gflop: float  # a product of this many GFLOP reaches half of that
    winograd: float  # how many times fewer operations Winograd runs than counted (dense 3x3 stride-1, fp32 units)
    memory_efficiency: float  # share of the memory bandwidth the other kernels reach
    launch_us: float  # per kernel
    tensor_layout: float  # times a convolution on tensor cores moves its bytes (NCHW to the cores' layout and back)

    @classmethod
    def of(cls, values) -> GpuParams:
        return cls(*(float(v) for v in values))

    def as_tuple(self) -> tuple[float, ...]:
        return (self.fp32_efficiency, self.tensor_efficiency, self.half_gflop, self.winograd, self.memory_efficiency,
                self.launch_us, self.tensor_layout)


# Each parameter's range, what the hardware allows: a fit cannot leave it.
BOUNDS = ((0.05, 1.0), (0.02, 1.0), (0.001, 50.0), (1.0, 4.0), (0.2, 1.0), (1.0, 100.0), (1.0, 4.0))


@dataclass(frozen=True)
class StepTime:
    """One step's seconds: forward and backward of each layer, and the optimizer step."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return sum(self.forward_s) + sum(self.backward_s) + self.optimizer_s


def units(hw: HardwareSpec, mixed: bool, half: str = "fp16") -> tuple[float, bool, float, bool, float]:
    """The peaks (TFLOPS) the products run at on ``hw``, and whether on tensor cores: (dense
    convolutions, on tensor cores, fully connected layers, on tensor cores, grouped convolutions).
    ``half``: the 2-byte format autocast runs in (fp16 or bf16), for its peak."""
    fp32 = hw.peak_tflops
    if mixed:  # a format the GPU has no units for runs on the fp32 ones (bf16 on Volta and Turing)
        peak = hw.peak_tflops_by_type.get(half) or fp32
        return peak, peak > fp32, peak, peak > fp32, fp32
    tf32 = hw.peak_tflops_by_type.get("tf32")
    return (tf32, True, fp32, False, fp32) if tf32 else (fp32, False, fp32, False, fp32)


@dataclass
class StepArrays:
    """A step's kernels at one batch on one GPU, as arrays: what :func:`seconds` prices at any
    parameters (the fit prices many steps at many parameters)."""

    flops: np.ndarray  # per product
    product_bytes: np.ndarray
    peak: np.ndarray  # TFLOPS of the units it runs on
    tensor: np.ndarray  # on tensor cores
    tensor_convolution: np.ndarray  # a convolution on tensor cores (its layout changed on the way)
    winograd: np.ndarray  # the share of the counted operations Winograd may cut
    segment: np.ndarray  # index of its (layer, pass): 2 * layer + (0 forward, 1 backward)
    memory_bytes: np.ndarray  # per (layer, pass): the other kernels' bytes
    kernels: np.ndarray  # per (layer, pass)
    optimizer_bytes: float
    bandwidth: float  # bytes/s at full efficiency


def step_arrays(kernels: KernelProfile, batch: int, hw: HardwareSpec, half: str = "fp16",
                optimizer: bool = True) -> StepArrays:
    conv_peak, conv_tensor, matmul_peak, matmul_tensor, grouped_peak = units(hw, kernels.mixed, half)
    flops, moved, peak, tensor, winograd, segment, memory, launches, convolution = [], [], [], [], [], [], [], [], []
    for index, layer in enumerate(kernels.layers):
        for which, kernels_of_pass in enumerate((layer.forward, layer.backward)):
            for product in kernels_of_pass.products:
                flops.append(product.flops * batch)
                moved.append(product.bytes * batch + product.fixed_bytes)
                if not product.dense:
                    peak.append(grouped_peak), tensor.append(False), winograd.append(0.0)
                elif product.kind == "matmul":
                    peak.append(matmul_peak), tensor.append(matmul_tensor), winograd.append(0.0)
                else:
                    peak.append(conv_peak), tensor.append(conv_tensor), winograd.append(0.0 if conv_tensor else product.winograd)
                segment.append(2 * index + which)
                convolution.append(product.kind == "convolution" and tensor[-1])
            memory.append(kernels_of_pass.memory_bytes * batch + kernels_of_pass.memory_fixed_bytes)
            launches.append(kernels_of_pass.kernels)
    return StepArrays(np.array(flops), np.array(moved), np.array(peak) * 1e12, np.array(tensor), np.array(convolution),
                      np.array(winograd),
                      np.array(segment, dtype=int), np.array(memory), np.array(launches, dtype=float),
                      kernels.params * OPTIMIZER_BYTES_PER_PARAM if optimizer else 0.0, hw.memory_bandwidth_gb_s * GB)


def seconds(step: StepArrays, params: GpuParams) -> tuple[np.ndarray, float]:
    """Seconds per (layer, pass) and of the optimizer step."""
    bandwidth = step.bandwidth * params.memory_efficiency
    launch = params.launch_us * 1e-6
    efficiency = np.where(step.tensor, params.tensor_efficiency, params.fp32_efficiency)
    size = step.flops / 1e9
    counted = step.flops * (1 - step.winograd + step.winograd / params.winograd)
    with np.errstate(divide="ignore", invalid="ignore"):
        compute = np.where(step.flops > 0, counted / (step.peak * efficiency * size / (size + params.half_gflop)), 0.0)
    moved = np.where(step.tensor_convolution, step.product_bytes * params.tensor_layout, step.product_bytes)
    product_s = np.maximum(compute, moved / bandwidth)
    per_segment = step.memory_bytes / bandwidth + step.kernels * launch
    per_segment = per_segment + np.bincount(step.segment, weights=product_s, minlength=len(per_segment))
    optimizer_s = step.optimizer_bytes / bandwidth + (OPTIMIZER_KERNELS * launch if step.optimizer_bytes else 0.0)
    return per_segment, optimizer_s


def step_time(kernels: KernelProfile, batch: int, hw: HardwareSpec, params: GpuParams, half: str = "fp16",
              optimizer: bool = True) -> StepTime:
    """A training step of ``batch`` samples on one GPU of ``hw``."""
    per_segment, optimizer_s = seconds(step_arrays(kernels, batch, hw, half, optimizer), params)
    return StepTime(tuple(per_segment[0::2].tolist()), tuple(per_segment[1::2].tolist()), optimizer_s)
