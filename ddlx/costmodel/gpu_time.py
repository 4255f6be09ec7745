"""Seconds of a training step on a GPU, layer by layer and pass by pass, from the kernels it runs
(:mod:`.kernels`) and the GPU's description (``conf/hw``).

Each matrix product takes the longer of its operations at the rate of the units that run it and
its bytes at the memory's rate; every other kernel its bytes at the memory's rate; every kernel a
little GPU time of its own; the optimizer step reads and writes the weights and their state. The
units:

- under autocast (``*-mixed``), the tensor cores at the format's peak (fp16, bf16);
- in fp32, PyTorch's defaults: convolutions on TF32 tensor cores where the GPU has them
  (``torch.backends.cudnn.allow_tf32`` is True), fully connected layers in fp32
  (``torch.backends.cuda.matmul.allow_tf32`` is False); on GPUs without TF32 (Volta, Turing) a
  dense 3x3 stride-1 convolution in fp32 may run as Winograd, which does fewer operations than
  the counted ones;
- grouped (depthwise) convolutions on the fp32 units whatever the precision, and so a dense
  convolution of fewer than 8 input channels (the first, on an image's 3), at its own share of
  their peak: it fills no tensor-core tile.

The memory's rate is a share of its bandwidth that depends on the kernel: element-wise kernels
stream (a smaller share for 2-byte elements under autocast: PyTorch vectorizes by elements, so
fewer bytes are in flight); batch normalization reduces over the batch and reads its input again;
max pooling's backward scatters through its indices.

A product reaches less of its units' peak the smaller it is (a small batch leaves them idle):
efficiency x work / (work + half_gflop). The host issues each kernel in ``issue_us`` while the GPU
runs the ones before it, so a layer's pass takes the longer of the two: a small batch is bound by
the host. The parameters (:class:`GpuParams`) are fitted to published one-GPU training
throughputs (:mod:`.gpu_reference`), not assumed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .hardware import GB, HardwareSpec
from .kernels import KernelProfile

OPTIMIZER_BYTES_PER_PARAM = 5 * 4  # SGD with momentum on fp32 weights: read weight, gradient, momentum; write weight, momentum
NARROW_CHANNELS = 8  # fewer input channels (an image's 3) fill no tensor-core tile (8 of fp16): on the fp32 units
OPTIMIZER_KERNELS = 4  # foreach: a few launches for all the weights


@dataclass(frozen=True)
class GpuParams:
    fp32_efficiency: float  # share of the fp32 units' peak a large product reaches
    tensor_efficiency: float  # share of the tensor cores' peak (TF32, fp16, bf16) a large product reaches
    half_gflop: float  # a product of this many GFLOP reaches half of that
    winograd: float  # how many times fewer operations Winograd runs than counted (dense 3x3 stride-1, fp32 units)
    memory_efficiency: float  # share of the memory bandwidth element-wise kernels on 4-byte elements reach
    issue_us: float  # the host's time to issue one kernel (PyTorch's dispatch, autograd, the launch)
    tensor_layout: float  # times a convolution on tensor cores moves its bytes (NCHW to the cores' layout and back)
    half_memory_efficiency: float  # the same under autocast (2-byte elements)
    normalization_efficiency: float  # batch normalization's share of the element-wise kernels' rate
    pooling_efficiency: float  # max pooling's share of it
    kernel_us: float  # a kernel's own GPU time beyond its work (start, tail)
    narrow_efficiency: float  # share of the fp32 units' peak a convolution of an image's few channels reaches

    @classmethod
    def of(cls, values) -> GpuParams:
        return cls(*(float(v) for v in values))

    def as_tuple(self) -> tuple[float, ...]:
        return (self.fp32_efficiency, self.tensor_efficiency, self.half_gflop, self.winograd, self.memory_efficiency,
                self.issue_us, self.tensor_layout, self.half_memory_efficiency, self.normalization_efficiency,
                self.pooling_efficiency, self.kernel_us, self.narrow_efficiency)


# Each parameter's range, what the hardware allows: a fit cannot leave it.
BOUNDS = ((0.05, 1.0), (0.02, 1.0), (0.001, 50.0), (1.0, 4.0), (0.2, 1.0), (1.0, 100.0), (1.0, 4.0), (0.1, 1.0),
          (0.05, 1.0), (0.05, 1.0), (0.0, 10.0), (0.01, 1.0))  # a kernel's own time: a few microseconds, not the host's


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
    narrow: np.ndarray  # a convolution of fewer input channels than a tile of the units takes (an image's 3)
    segment: np.ndarray  # index of its (layer, pass): 2 * layer + (0 forward, 1 backward)
    memory_bytes: np.ndarray  # per (layer, pass): the other kernels' bytes
    normalization_bytes: np.ndarray  # per (layer, pass): the share of memory_bytes batch normalization moves
    pooling_bytes: np.ndarray  # per (layer, pass): the share max pooling moves
    kernels: np.ndarray  # per (layer, pass)
    optimizer_bytes: float
    bandwidth: float  # bytes/s at full efficiency
    mixed: bool  # under autocast: 2-byte activations


def step_arrays(kernels: KernelProfile, batch: int, hw: HardwareSpec, half: str = "fp16",
                optimizer: bool = True) -> StepArrays:
    conv_peak, conv_tensor, matmul_peak, matmul_tensor, grouped_peak = units(hw, kernels.mixed, half)
    flops, moved, peak, tensor, winograd, segment, memory, launches, convolution = [], [], [], [], [], [], [], [], []
    normalization, pooling, narrow = [], [], []
    for index, layer in enumerate(kernels.layers):
        for which, kernels_of_pass in enumerate((layer.forward, layer.backward)):
            for product in kernels_of_pass.products:
                flops.append(product.flops * batch)
                moved.append(product.bytes * batch + product.fixed_bytes)
                is_narrow = product.kind == "convolution" and product.dense and product.channels_in < NARROW_CHANNELS
                if not product.dense or is_narrow:  # on the fp32 units
                    peak.append(grouped_peak), tensor.append(False), winograd.append(0.0)
                elif product.kind == "matmul":
                    peak.append(matmul_peak), tensor.append(matmul_tensor), winograd.append(0.0)
                else:
                    peak.append(conv_peak), tensor.append(conv_tensor), winograd.append(0.0 if conv_tensor else product.winograd)
                segment.append(2 * index + which)
                narrow.append(is_narrow)
                convolution.append(product.kind == "convolution" and tensor[-1])
            memory.append(kernels_of_pass.memory_bytes * batch + kernels_of_pass.memory_fixed_bytes)
            launches.append(kernels_of_pass.kernels)
            normalization.append(kernels_of_pass.normalization_bytes * batch)
            pooling.append(kernels_of_pass.pooling_bytes * batch)
    return StepArrays(np.array(flops), np.array(moved), np.array(peak) * 1e12, np.array(tensor), np.array(convolution),
                      np.array(winograd), np.array(narrow, dtype=bool),
                      np.array(segment, dtype=int), np.array(memory), np.array(normalization), np.array(pooling),
                      np.array(launches, dtype=float),
                      kernels.params * OPTIMIZER_BYTES_PER_PARAM if optimizer else 0.0, hw.memory_bandwidth_gb_s * GB,
                      kernels.mixed)


def seconds(step: StepArrays, params: GpuParams) -> tuple[np.ndarray, float]:
    """Seconds per (layer, pass) and of the optimizer step."""
    bandwidth = step.bandwidth * (params.half_memory_efficiency if step.mixed else params.memory_efficiency)
    efficiency = np.where(step.narrow, params.narrow_efficiency,
                          np.where(step.tensor, params.tensor_efficiency, params.fp32_efficiency))
    size = step.flops / 1e9
    counted = step.flops * (1 - step.winograd + step.winograd / params.winograd)
    with np.errstate(divide="ignore", invalid="ignore"):
        compute = np.where(step.flops > 0, counted / (step.peak * efficiency * size / (size + params.half_gflop)), 0.0)
    moved = np.where(step.tensor_convolution, step.product_bytes * params.tensor_layout, step.product_bytes)
    product_s = np.maximum(compute, moved / bandwidth)
    slower = (step.normalization_bytes * (1 / params.normalization_efficiency - 1)
              + step.pooling_bytes * (1 / params.pooling_efficiency - 1))
    gpu_s = (step.memory_bytes + slower) / bandwidth + step.kernels * params.kernel_us * 1e-6
    gpu_s = gpu_s + np.bincount(step.segment, weights=product_s, minlength=len(gpu_s))
    per_segment = np.maximum(gpu_s, step.kernels * params.issue_us * 1e-6)
    if not step.optimizer_bytes:
        return per_segment, 0.0
    weights_bandwidth = step.bandwidth * params.memory_efficiency  # fp32 weights and state, autocast or not
    optimizer_s = max(step.optimizer_bytes / weights_bandwidth + OPTIMIZER_KERNELS * params.kernel_us * 1e-6,
                      OPTIMIZER_KERNELS * params.issue_us * 1e-6)
    return per_segment, optimizer_s


def step_time(kernels: KernelProfile, batch: int, hw: HardwareSpec, params: GpuParams, half: str = "fp16",
              optimizer: bool = True) -> StepTime:
    """A training step of ``batch`` samples on one GPU of ``hw``."""
    per_segment, optimizer_s = seconds(step_arrays(kernels, batch, hw, half, optimizer), params)
    return StepTime(tuple(per_segment[0::2].tolist()), tuple(per_segment[1::2].tolist()), optimizer_s)
