"""The per-layer GPU time model against the published one-GPU training throughputs it is fitted to.

    python benchmarks/gpu_reference.py              # fitted to all, and each figure left out in turn (~17 min on 2 cores)
    python benchmarks/gpu_reference.py --no-loo     # the fit only
    python benchmarks/gpu_reference.py --measured   # the GPUs ddlx measured per layer (~1 min): each step predicted
    python benchmarks/gpu_reference.py --ship-fits  # rewrite ddlx/costmodel/reference/fits.json (after a change to the
                                                    # model, its reference files or conf/hw; ~1 min with an empty cache)

Prints the fitted parameters, then a row per published figure (ddlx/costmodel/reference/
gpu_training_throughput.csv): gpu | model | precision | batch | predicted | published | error
(fitted to all) | leave-one-out | source; the figures left out of the fit, with why, last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddlx.costmodel.gpu_reference import (  # noqa: E402
    GOAL_MODELS,
    SHIPPED_FITS,
    arrays_of,
    by_cell,
    fit,
    fitted_steps,
    leave_one_out,
    load_reference,
    predicted_images_per_s,
    record_fits,
)
from ddlx.costmodel.gpu_measured import arrays_of as measured_arrays  # noqa: E402
from ddlx.costmodel.gpu_measured import (  # noqa: E402
    leave_one_network_out,
    load_measured,
    measured_fit,
    measurement_files,
    predicted_step_s,
)
from ddlx.predict.hw_files import DEFAULT_HW_DIR, cited_hardware, every_fit, hw_file, published_fit  # noqa: E402


def summary(errors: list[float]) -> str:
    absolute = [abs(e) for e in errors]
    return (f"median |error| {100 * statistics.median(absolute):.1f}%, {sum(e <= 0.15 for e in absolute)} of {len(absolute)} "
            f"within 15%, {sum(e > 0.30 for e in absolute)} beyond 30%, largest {100 * max(absolute):.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-loo", action="store_true", help="skip the leave-one-out fits")
    parser.add_argument("--measured", action="store_true",
                        help="only the GPUs measured per layer (ddlx/costmodel/reference/gpu_layers_*.csv): their steps "
                             "predicted from the published fit, from their own layers, and leaving each network out")
    parser.add_argument("--ship-fits", action="store_true", help=f"rewrite {SHIPPED_FITS.relative_to(ROOT)}")
    args = parser.parse_args()
    if args.measured:
        return measured()
    if args.ship_fits:
        return ship_fits()
    steps = fitted_steps(cited_hardware())
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


def measured() -> None:
    for path in measurement_files():
        steps = load_measured(path)
        described = (hw_file(p.stem, DEFAULT_HW_DIR) for p in sorted(DEFAULT_HW_DIR.glob("*.yaml")))
        hw = next(h for h in described if h.device_name == steps[0].device)
        pairs = [(measured_arrays(s, hw), s) for s in steps]
        print(f"\n{path.name}: {len(steps)} steps on an {steps[0].device} (hw={hw.name})\n")
        print("| on its steps | median error | within 15% | largest |\n| --- | --- | --- | --- |")
        published, own = published_fit().params, measured_fit(hw).params
        for name, predicted in (("fitted to the published throughputs (other GPUs)",
                                 [(m, predicted_step_s(a, published)) for a, m in pairs]),
                                ("fitted to its layers", [(m, predicted_step_s(a, own)) for a, m in pairs]),
                                ("leave one network out (fitted to the others)", leave_one_network_out(pairs))):
            errors = [(p / m.step_s - 1, m.label) for m, p in predicted]
            worst = max(errors, key=lambda e: abs(e[0]))
            absolute = [abs(e) for e, _ in errors]
            print(f"| {name} | {100 * statistics.median(absolute):.1f}% | {sum(e <= 0.15 for e in absolute)} of "
                  f"{len(absolute)} | {100 * worst[0]:+.1f}% ({worst[1]}) |")


def ship_fits() -> None:
    fits = record_fits(every_fit)
    SHIPPED_FITS.write_text(json.dumps(fits, indent=1, sort_keys=True) + "\n")
    print(f"{SHIPPED_FITS.relative_to(ROOT)}: " + ", ".join(f"{f['name']} ({key})" for key, f in fits.items()))


if __name__ == "__main__":
    main()
