"""The recommender on whole workloads it has not seen: each named workload is predicted as
``recommend.py`` would before it was measured (none of its runs used, its baseline probed now),
then compared with its measured runs. Stricter than ``recommend.py mode=validate``, which holds
out one configuration at a time.

    python studies/cpu-2core/recommend_holdout.py                       # cpu_study.sh's check and check2-check8 sets
    python studies/cpu-2core/recommend_holdout.py resnet18:96 alexnet:64
    python studies/cpu-2core/recommend_holdout.py --cpu-allocator system  # glibc's default's runs (default: as recommend.py)

Workloads are MODEL:IMAGE_SIZE as measured by studies/cpu-2core/cpu_study.sh (runs in the project's
mlflow.db, experiment ddlx). Prints predicted vs measured (median of repeats) per setup, the
pick against the measured fastest, and the median absolute error.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# The workloads predicted before they were measured: cpu_study.sh's "check" and "check2" to "check8" sets.
CHECK_SET = ["vgg16:64", "mobilenet_v2:96", "resnet50:96", "alexnet:160", "mobilenet_v2:128", "resnet18:160",
             "resnet18:112", "resnet50:80", "mobilenet_v2:160", "resnet18:80", "mobilenet_v2:112",
             "mobilenet_v2:80", "mobilenet_v2:144", "resnet18:144", "resnet50:112", "mobilenet_v2:176", "resnet18:176",
             "resnet18:120", "resnet18:136", "resnet50:104", "resnet50:120", "mobilenet_v2:192",
             "resnet18:104", "resnet18:152", "resnet50:128", "mobilenet_v2:120", "vgg11:96"]


def main() -> None:
    from omegaconf import OmegaConf

    defaults = OmegaConf.load(ROOT / "conf" / "recommend.yaml")  # recommend.py's own settings
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=CHECK_SET, help="MODEL:IMAGE_SIZE")
    parser.add_argument("--close-call", type=float, default=defaults.close_call)
    parser.add_argument("--cpu-allocator", default=defaults.cpu_allocator,
                        help="the population: only runs with this allocator; the probes use it (default: as recommend.py's)")
    args = parser.parse_args()

    from ddlx.allocator import apply_allocator, resolve_allocator
    from ddlx.tracking import load_runs
    from ddlx.predict.cli import hardware, load_hw_file
    from ddlx.records import job_of_run
    from ddlx.predict.prediction import Predictor, data_config_of_job
    from ddlx.predict.validation import ValidationRow, pick, pick_figures
    from ddlx.predict.setups import calibration_group
    from ddlx.predict.sequential_time import probe_batches

    held = {tuple(w.split(":")) for w in args.workloads}
    allocator = resolve_allocator(args.cpu_allocator)
    apply_allocator(allocator)  # the probes train as the held-out runs did
    runs = [r for r in load_runs(f"sqlite:///{ROOT / 'mlflow.db'}", ["ddlx"]) if r.workload.cpu_allocator == allocator]

    def held_out(run) -> bool:
        return (run.params.get("model.name"), run.params.get("data.image_size")) in held

    def probe(job):  # as recommend.py probes: one core, the data config the job was measured with
        return probe_batches(data_config_of_job(job, runs), job.model, 1, 30)

    hw = hardware(load_hw_file(ROOT / "conf" / "hw" / "local.yaml"), ROOT / "outputs" / "hw")  # recommend.py's kept rates
    predictor = Predictor(hw, [r for r in runs if not held_out(r)], hw, probe)
    errors, picks = [], []
    for model, size in sorted(held):
        mine = [r for r in runs if held_out(r) and r.params["model.name"] == model and r.params["data.image_size"] == size
                and r.status == "FINISHED" and "mean_epoch_time_s" in r.metrics]
        if not mine:
            raise SystemExit(f"no finished runs of {model} at {size} px with cpu_allocator={allocator}: measure them "
                             f"with studies/cpu-2core/cpu_study.sh")
        measured: dict[str, list[float]] = {}
        for r in mine:
            measured.setdefault(r.strategy_setup.label, []).append(r.metrics["mean_epoch_time_s"])
        rec = predictor.recommend(job_of_run(mine[0]))
        print(f"\n{model} {size}px (T_seq {rec.sequential.basis})")
        rows = []  # the measured setups, as validation sees them
        for p in rec.predictions:
            if p.setup.label in measured:
                times = measured[p.setup.label]
                m = statistics.median(times)
                errors.append(abs(p.epoch_s / m - 1))
                rows.append(ValidationRow("", f"{model} {size}px", p.setup.label, calibration_group(p.setup), p.epoch_s,
                                          p.basis, tuple(times)))
                print(f"  {p.setup.label:24s} predicted {p.epoch_s:7.2f}  measured {m:7.2f}  {100 * (p.epoch_s / m - 1):+6.1f}%"
                      f"  ({len(times)} runs)")
        picks.append(pick(rows))
        close = [p.setup.label for p in rec.close_calls(args.close_call)]
        print(f"  recommended {picks[-1].recommended}; measured fastest {picks[-1].fastest} "
              f"({100 * picks[-1].slowdown:.1f}% faster); close calls {close or 'none'}")
    figures, n = pick_figures(picks), len(picks)
    print(f"\npicks {round(n * figures['correct_fraction'])}/{n}, measured {100 * figures['mean_slowdown']:.1f}% slower "
          f"than the fastest on average (at most {100 * figures['max_slowdown']:.1f}%); median absolute error "
          f"{100 * statistics.median(errors):.1f}% over {len(errors)} setups")
    print(f"(cpu_allocator={allocator})")
    print(f"resampling each setup's runs: the measured fastest is the fastest again in "
          f"{100 * figures['fastest_reproduced_fraction']:.0f}% of resamples, the recommended setup in "
          f"{100 * figures['recommended_fastest_fraction']:.0f}%")


if __name__ == "__main__":
    main()
