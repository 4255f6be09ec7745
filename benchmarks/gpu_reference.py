"""The per-layer GPU time model against the published one-GPU training throughputs it is fitted to.

    python benchmarks/gpu_reference.py              # fitted to all, and each figure left out in turn (~5 min)
    python benchmarks/gpu_reference.py --no-loo     # the fit only

Prints the fitted parameters, then a row per published figure (ddlx/costmodel/reference/
gpu_training_throughput.csv): gpu | model | precision | batch | predicted | published | error
(fitted to all) | leave-one-out | source; the figures left out of the fit, with why, last.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddlx.costmodel.gpu_reference import (  # noqa: E402
    DEFAULT_HW_DIR,
    arrays_of,
    fit,
    fitted_steps,
    leave_one_out,
    load_reference,
    predicted_images_per_s,
)
from ddlx.costmodel.hardware import hw_file  # noqa: E402


def summary(errors: list[float]) -> str:
    absolute = [abs(e) for e in errors]
    return (f"median |error| {100 * statistics.median(absolute):.1f}%, {sum(e <= 0.15 for e in absolute)} of {len(absolute)} "
            f"within 15%, {sum(e > 0.30 for e in absolute)} beyond 30%, largest {100 * max(absolute):.1f}%")


# The goal's cells: these networks on each GPU, in each precision (fp32 with or without the optimizer step).
GOAL_MODELS = ("resnet50", "resnet18", "vgg16", "alexnet")


def by_cell(figures: list, errors: list[float]) -> list[float]:
    """Each cell's error (GPU as its hw file names it, network, precision; the goal's networks
    only): the median of its published figures' errors, as sources disagree on one cell by up to
    25% (Lambda's A100 PCIe ResNet-50 AMP at batch 720: 1117 and 1393 img/s)."""
    cells: dict[tuple, list[float]] = {}
    for figure, error in zip(figures, errors):
        if figure.model in GOAL_MODELS:
            cells.setdefault((figure.hw, figure.model, figure.precision), []).append(error)
    return [statistics.median(e) for e in cells.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-loo", action="store_true", help="skip the leave-one-out fits")
    args = parser.parse_args()
    steps = fitted_steps(DEFAULT_HW_DIR)
    params = fit(steps)
    print(f"fitted to {len(steps)} published figures: {params}\n")
    loo = dict((id(f), p) for f, p in leave_one_out(steps)) if not args.no_loo else {}
    print("| gpu | model | precision | batch | predicted img/s | published img/s | error | leave-one-out | source |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors, held, held_figures = [], [], []
    for step, figure in steps:
        predicted = predicted_images_per_s(step, figure.batch, params)
        errors.append(predicted / figure.images_per_s - 1)
        out = loo.get(id(figure))
        if out is not None:
            held.append(out / figure.images_per_s - 1)
            held_figures.append(figure)
        step_note = "" if figure.optimizer_step else " (no optimizer step)"
        print(f"| {figure.gpu} | {figure.model} | {figure.precision}{step_note} | {figure.batch} | {predicted:.0f} "
              f"| {figure.images_per_s:.0f} | {100 * errors[-1]:+.1f}% | {f'{100 * held[-1]:+.1f}%' if out is not None else '-'} "
              f"| {figure.source} |")
    print(f"\nfitted to all: {summary(errors)}")
    if held:
        print(f"leave-one-out: {summary(held)}")
    figures = [figure for _, figure in steps]
    print(f"per cell ({', '.join(GOAL_MODELS)}; a cell's error the median of its figures'), fitted to all: "
          f"{summary(by_cell(figures, errors))}")
    if held:
        print(f"per cell, leave-one-out: {summary(by_cell(held_figures, held))}")
    print("\nLeft out of the fit (the model's prediction beside them where it has the GPU and a stated batch):\n")
    print("| gpu | model | precision | batch | published img/s | predicted img/s | why left out | source |\n|---|---|---|---|---|---|---|---|")
    for figure in load_reference():
        if figure.fit:
            continue
        predicted = "-"
        if figure.hw and figure.batch and figure.image_size and figure.precision in ("32-true", "16-mixed"):
            predicted = f"{predicted_images_per_s(arrays_of(figure, hw_file(figure.hw, DEFAULT_HW_DIR)), figure.batch, params):.0f}"
        print(f"| {figure.gpu} | {figure.model} | {figure.precision} | {figure.batch or '?'} | {figure.images_per_s:.0f} "
              f"| {predicted} | {figure.excluded_because} | {figure.source} |")


if __name__ == "__main__":
    main()
