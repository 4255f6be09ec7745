"""A model compiled layer by layer (as fsdp and PyTorch's pipelines compile it), for symbolic
shapes (torch's default, ``dynamic=None``) against static ones (``dynamic=False``, ddlx's choice):
steady training step and compile seconds, interleaved rounds, each run a fresh process.

    python studies/compile_layer_shapes.py [--model resnet18] [--image-size 64] [--batch-size 16] [--rounds 2]

Inductor on the CPU, one thread: about 5 minutes a round for ResNet-18 at 64 px on 2 cores (the
first round compiles cold; later ones mostly read inductor's cache). A step and a smaller last
batch are compiled first, then 30 steps timed (median of the last 25).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def one_run(model_name: str, dynamic: bool | None, image_size: int, batch: int) -> None:
    import torch

    from ddlx.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(model_name, 10, 3, image_size, 0.0)
    config = torch._dynamo.config
    config.recompile_limit = config.accumulated_recompile_limit = 1000  # no layer left eager
    for layer in model.children():
        layer.forward = types.MethodType(torch.compile(layer.forward.__func__, dynamic=dynamic), layer)
    start = time.perf_counter()
    for size in (batch, batch * 3 // 4, batch):
        model(torch.randn(size, 3, image_size, image_size)).sum().backward()
    compile_s = time.perf_counter() - start
    images, steps = torch.randn(batch, 3, image_size, image_size), []
    for _ in range(30):
        start = time.perf_counter()
        model(images).sum().backward()
        steps.append(time.perf_counter() - start)
    print(f"{compile_s:.1f} {1000 * statistics.median(steps[5:]):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=["symbolic", "static"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_run(args.model, None if args.one == "symbolic" else False, args.image_size, args.batch_size)
        return
    print(f"{args.model}, {args.image_size} px, batch {args.batch_size}, one thread, compiled layer by layer")
    print("| round | shapes | compile s | step ms | symbolic / static step |\n|---|---|---|---|---|")
    for round_ in range(1, args.rounds + 1):
        got = {}
        for shapes in ("symbolic", "static"):
            out = subprocess.run([sys.executable, __file__, "--one", shapes, "--model", args.model, "--image-size",
                                  str(args.image_size), "--batch-size", str(args.batch_size)], capture_output=True,
                                 text=True, cwd=PROJECT, check=True)
            got[shapes] = tuple(map(float, out.stdout.split()[-2:]))
        for shapes, (compile_s, step_ms) in got.items():
            ratio = f"{got['symbolic'][1] / got['static'][1]:.2f}" if shapes == "static" else ""
            print(f"| {round_} | {shapes} | {compile_s:.1f} | {step_ms:.1f} | {ratio} |")


if __name__ == "__main__":
    sys.path.insert(0, str(PROJECT))
    main()
