"""Per-layer forward and backward time, whole-step time and peak memory of the seven networks on a GPU.

    python benchmarks/gpu_layers.py --out layers.csv --memory-out memory.csv
    python benchmarks/gpu_layers.py --models resnet50 --batches 32 --precisions bf16-mixed --device cpu  # a dry run

What the GPU time model (:mod:`ddlx.costmodel.gpu_time`) predicts, measured: for every network,
batch size and precision, PyTorch's defaults otherwise (NCHW, ``cudnn.benchmark`` off, TF32
convolutions and fp32 matrix products in fp32; autocast under ``*-mixed``, a gradient scaler
under ``16-mixed``), SGD with momentum as ddlx's module builds it.

- **step**: the median of ``--steps`` training steps (zero_grad, forward, loss, backward,
  optimizer step), timed with CUDA events, after ``--warmup`` steps, no hooks.
- **layers**: the same steps with a CUDA event recorded where each layer of the
  :class:`~ddlx.models.LayeredModel` starts its forward and where the gradient of its output
  and of its input are ready in backward; a layer's backward is the time between the two (its
  weight gradients included). Medians over the steps. In-place activations are made out of place
  for this pass only (a hook on a tensor modified in place would time the wrong node).
- **memory**: ``torch.cuda.max_memory_allocated`` over one training step after the first (the
  momentum buffers exist, the gradients were set to None by zero_grad), with the allocated bytes
  before it (weights and optimizer state); what :func:`ddlx.costmodel.memory.estimate_training_memory`
  predicts is compared with it by ``studies/gpu_calibration.py``, not here, so this script needs a
  GPU and nothing of the predictor.

Each row carries the device name, driver, torch and CUDA versions.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddlx.models import ARCHITECTURES, build_model  # noqa: E402
from handloop import AUTOCAST  # noqa: E402

LAYER_FIELDS = ["device", "driver", "torch", "cuda", "model", "image_size", "batch", "precision", "layer", "name",
                "forward_ms", "backward_ms", "step_ms", "optimizer_ms"]
MEMORY_FIELDS = ["device", "driver", "torch", "cuda", "model", "image_size", "batch", "precision", "before_step_mb",
                 "peak_mb", "peak_forward_mb", "params"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ARCHITECTURES))
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument("--memory-precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("gpu_layers.csv"))
    parser.add_argument("--memory-out", type=Path, default=Path("gpu_memory.csv"))
    return parser.parse_args()


def versions(device: torch.device) -> dict[str, str]:
    if device.type != "cuda":
        return {"device": "cpu", "driver": "", "torch": torch.__version__, "cuda": ""}
    driver = ""
    with contextlib.suppress(Exception):
        import subprocess
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    return {"device": torch.cuda.get_device_name(device), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda or ""}


class Clock:
    """CUDA events on a GPU; on a CPU (a dry run) wall-clock marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else 1000 * (end - start)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Step:
    """One training step as Lightning runs it for ``precision``."""

    def __init__(self, model: nn.Module, precision: str, device: torch.device) -> None:
        self.model, self.device = model, device
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
        self.dtype = AUTOCAST[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        self.loss_fn = nn.CrossEntropyLoss()

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def __call__(self, images, labels, clock: Clock, marks: dict | None = None) -> None:
        self.optimizer.zero_grad()
        with self.autocast():
            loss = self.loss_fn(self.model(images), labels)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if marks is not None:
            marks["backward_end"] = clock.mark()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()


def out_of_place(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "inplace"):
            module.inplace = False


def layer_marks(model, clock: Clock, marks: dict) -> list:
    """Forward pre-hooks mark each layer's start; on its output and input, gradient hooks mark when
    each is ready in backward."""
    handles = []
    for index, layer in enumerate(model):
        def pre(_module, inputs, index=index):
            marks[("fwd", index)] = clock.mark()
            x = inputs[0]
            if x.requires_grad:
                x.register_hook(lambda grad, index=index: marks.__setitem__(("bwd_in", index), clock.mark()))

        def post(_module, _inputs, output, index=index):
            if output.requires_grad:
                output.register_hook(lambda grad, index=index: marks.__setitem__(("bwd_out", index), clock.mark()))

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    return handles


def measure_layers(model, step: Step, images, labels, clock: Clock, warmup: int, steps: int):
    count = len(model)
    forward = [[] for _ in range(count)]
    backward = [[] for _ in range(count)]
    optimizer = []
    marks: dict = {}
    handles = layer_marks(model, clock, marks)
    try:
        for i in range(warmup + steps):
            marks.clear()
            step(images, labels, clock, marks)
            marks["end"] = clock.mark()
            clock.sync()
            if i < warmup:
                continue
            for index in range(count):
                forward_end = marks[("fwd", index + 1)] if index + 1 < count else marks.get(("bwd_out", count - 1))
                if forward_end is not None:
                    forward[index].append(clock.ms(marks[("fwd", index)], forward_end))
                start = marks.get(("bwd_out", index))
                end = marks.get(("bwd_in", index)) if index > 0 else marks["backward_end"]
                if start is not None and end is not None:
                    backward[index].append(clock.ms(start, end))
            optimizer.append(clock.ms(marks["backward_end"], marks["end"]))
    finally:
        for handle in handles:
            handle.remove()
    median = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return [median(f) for f in forward], [median(b) for b in backward], median(optimizer)


def measure_step(step: Step, images, labels, clock: Clock, warmup: int, steps: int) -> float:
    times = []
    for i in range(warmup + steps):
        start = clock.mark()
        step(images, labels, clock)
        end = clock.mark()
        clock.sync()
        if i >= warmup:
            times.append(clock.ms(start, end))
    return statistics.median(times)


def measure_memory(base, precision, images, labels, device, clock: Clock) -> dict:
    model = copy.deepcopy(base).to(device)
    step = Step(model, precision, device)
    step(images, labels, clock)
    clock.sync()
    if device.type != "cuda":
        return {}
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step.optimizer.zero_grad()
    with step.autocast():
        loss = step.loss_fn(model(images), labels)
    peak_forward = torch.cuda.max_memory_allocated(device)
    (step.scaler.scale(loss) if step.scaler else loss).backward()
    if step.scaler:
        step.scaler.step(step.optimizer)
        step.scaler.update()
    else:
        step.optimizer.step()
    clock.sync()
    peak = torch.cuda.max_memory_allocated(device)
    del model, step, loss
    return {"before_step_mb": before / 2**20, "peak_mb": peak / 2**20, "peak_forward_mb": peak_forward / 2**20}


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    clock = Clock(device)
    info = versions(device)
    print(info, file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as layers_file, open(args.memory_out, "w", newline="") as memory_file:
        layer_rows = csv.DictWriter(layers_file, LAYER_FIELDS)
        memory_rows = csv.DictWriter(memory_file, MEMORY_FIELDS)
        layer_rows.writeheader()
        memory_rows.writeheader()
        for name in args.models:
            torch.manual_seed(0)
            base = build_model(name, args.num_classes, 3, args.image_size)
            params = sum(p.numel() for p in base.parameters())
            for batch in args.batches:
                images = torch.randn(batch, 3, args.image_size, args.image_size, device=device)
                labels = torch.randint(0, args.num_classes, (batch,), device=device)
                for precision in args.precisions:
                    key = {**info, "model": name, "image_size": args.image_size, "batch": batch, "precision": precision}
                    started = time.perf_counter()
                    if precision in args.memory_precisions:
                        memory = measure_memory(base, precision, images, labels, device, clock)
                        if memory:
                            memory_rows.writerow({**key, **memory, "params": params})
                    model = copy.deepcopy(base).to(device)
                    step = Step(model, precision, device)
                    step_ms = measure_step(step, images, labels, clock, args.warmup, args.steps)
                    out_of_place(model)
                    forward, backward, optimizer_ms = measure_layers(model, step, images, labels, clock, 1, args.steps)
                    for index, (layer, f, b) in enumerate(zip(model, forward, backward)):
                        layer_rows.writerow({**key, "layer": index, "name": type(layer).__name__, "forward_ms": f"{f:.4f}",
                                             "backward_ms": f"{b:.4f}", "step_ms": f"{step_ms:.4f}",
                                             "optimizer_ms": f"{optimizer_ms:.4f}"})
                    layers_file.flush()
                    memory_file.flush()
                    print(f"{name} b{batch} {precision}: step {step_ms:.2f} ms, layers fwd {sum(forward):.2f} + bwd "
                          f"{sum(backward):.2f} + opt {optimizer_ms:.2f} ms ({time.perf_counter() - started:.1f} s)",
                          file=sys.stderr, flush=True)
                    del model, step
                    if device.type == "cuda":
                        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
