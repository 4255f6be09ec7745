"""What ``recommend.py`` does in each mode, from a composed config (no Hydra below this line)."""
from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..allocator import KEEP_FREED, apply_allocator, check_allocator, resolve_allocator
from ..errors import ConfigError
from ..models import check_request
from ..config_check import check_bounds
from ..measure.report import load_runs, store_exists
from ..tracking import check_tracking_uri, experiment_id
from .hardware import HardwareSpec, detect_local, validate
from .job import Job
from .recommender import (Prediction, Predictor, Recommendation, allocator_advice, data_config_of_job, pick_figures,
                          validate as leave_one_out)
from .tseq import probe_batches, probe_loading

MODES = ("recommend", "validate", "probe")
OUTPUTS = ("table", "json")


def hardware(cfg_hw: DictConfig, detected_dir: Path | None = None, refresh: bool = False) -> HardwareSpec:
    """The typed, checked description: unknown keys and missing values are named. ``detected_dir``
    keeps hw=local's timed rates per machine (:func:`~ddlx.predict.hardware.detect_local`)."""
    from dataclasses import fields

    from omegaconf.errors import MissingMandatoryValue

    name = cfg_hw.get("name", "?")
    known = {f.name for f in fields(HardwareSpec)}
    unknown = sorted(set(cfg_hw.keys()) - known - {"defaults"})
    if unknown:
        raise ConfigError(f"hw={name}: {', '.join(f'hw.{k}' for k in unknown)} is not a hardware field; "
                          f"the fields are {', '.join(sorted(known))}")
    try:
        spec: HardwareSpec = OmegaConf.to_object(cfg_hw)
    except MissingMandatoryValue as err:
        raise ConfigError(f"hw={name}: hw.{err.full_key.removeprefix('hw.')} is missing; every machine description "
                          f"needs it (see conf/hw/titanrtx_4x.yaml)") from None
    if spec.detect:
        detect_local(spec, detected_dir, refresh)
    return validate(spec)


def local_hardware(target: HardwareSpec, hw_dir: Path, detected_dir: Path | None = None, refresh: bool = False) -> HardwareSpec:
    """This machine: the target itself when it is this machine, else detected from local.yaml."""
    if target.detect or target.host:
        import socket

        if target.host == socket.gethostname():
            return target
    return hardware(load_hw_file(hw_dir / "local.yaml"), detected_dir, refresh)


def load_hw_file(path: Path) -> DictConfig:
    """A ``conf/hw`` file outside Hydra's composition, on the same typed schema."""
    described = OmegaConf.load(path)
    described.pop("defaults", None)
    return OmegaConf.merge(OmegaConf.structured(HardwareSpec), described)


def job_from_config(cfg: DictConfig) -> Job:
    data = cfg.data
    count = data.num_images
    if count is None:
        if not data.root:
            raise ConfigError("data.num_images=null needs data.root to count the images; give data.num_images=N")
        count = sum(1 for p in Path(data.root).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    train = count - round(count * data.val_fraction)
    check_request(cfg.model.name, data.num_classes, data.channels, data.image_size)
    return Job(cfg.model.name, data.name, data.num_classes, data.channels, data.image_size, data.batch_size, train,
               data.num_workers, cfg.cpu_allocator)


def measured_runs(cfg: DictConfig) -> tuple[list, str]:
    uri = cfg.logger.tracking_uri
    if not store_exists(uri):
        return [], f"no MLflow store at {uri}"
    check_tracking_uri(uri)
    runs, missing = [], []
    for name in cfg.experiments:
        try:
            runs += load_runs(uri, [name])
        except ValueError:
            missing.append(name)
    note = f"{len(runs)} runs from {uri}" + (f" (no experiment {', '.join(missing)})" if missing else "")
    return runs, note


def run(cfg: DictConfig, out_dir: Path, hw_dir: Path, job_overrides: list[str] | None = None) -> None:
    """``job_overrides``: the model/data overrides the job was given, repeated in the train.py
    commands printed for it."""
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode}; expected one of {', '.join(MODES)}")
    check_bounds(cfg)  # the model and data groups' declared ranges
    if cfg.output not in OUTPUTS:
        raise ConfigError(f"output={cfg.output}; expected one of {', '.join(OUTPUTS)}")
    for key, example in (("close_call", 0.05), ("prefer_sequential_within", 0.035)):
        if not 0 <= cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]}; expected a fraction in [0, 1), e.g. {key}={example}")
    started = time.perf_counter()
    cfg.cpu_allocator = resolve_allocator(cfg.cpu_allocator)  # as train.py resolves it on this machine
    check_allocator(cfg.cpu_allocator)
    job = job_from_config(cfg) if cfg.mode == "recommend" else None  # bad values named before any timing
    detected_dir = Path(cfg.detected_dir) if cfg.detected_dir else None
    target = hardware(cfg.hw, detected_dir, refresh=cfg.mode == "probe")
    if cfg.mode == "probe":  # measures everything again, the kept rates included
        from .linkprobe import write_probed_hw

        local = target if target.detect else local_hardware(target, hw_dir, detected_dir, refresh=True)
        path, doc = write_probed_hw(local, hw_dir)
        print(json.dumps(doc, indent=2) if cfg.output == "json" else f"wrote {path}: {doc['intra_node']}, "
              f"memory {doc['memory_bandwidth_gb_s']} GB/s per core; use it with hw={doc['name']}")
        return
    local = local_hardware(target, hw_dir, detected_dir)
    apply_allocator(cfg.cpu_allocator)  # the probes train as the job would
    runs, note = measured_runs(cfg)
    probe = loading = None
    if cfg.probe:
        probe = (lambda job: probe_batches(_probe_data(cfg, job, runs), job.model, 1, cfg.probe_max_s))
        loading = (lambda job: probe_loading(_probe_data(cfg, job, runs), cfg.probe_max_s))
    predictor = Predictor(target, runs, local, probe, cfg.prefer_sequential_within, loading)
    if cfg.mode == "validate":
        report_validation(cfg, predictor, note, out_dir, started)
        return
    rec = predictor.recommend(job)
    elapsed = time.perf_counter() - started
    overrides = job_overrides or []
    if cfg.output == "json":
        print(json.dumps(recommendation_dict(rec, note, elapsed, cfg.close_call, overrides), indent=2))
    else:
        print(recommendation_table(rec, note, elapsed, cfg.close_call, overrides))
    log_recommendation(cfg, rec, note, out_dir, overrides)


def _probe_data(cfg: DictConfig, job: Job, runs) -> DictConfig:
    """The data config to probe ``job`` with: the composed one when it is that job, else the
    config of a measured run of exactly that job (validation probes the runs' own workloads)."""
    if (cfg.model.name, cfg.data.image_size, cfg.data.batch_size) == (job.model, job.image_size, job.batch_size):
        return cfg.data
    measured = data_config_of_job(job, runs)
    return cfg.data if measured is None else measured


def train_command(rec: Recommendation, prediction: Prediction, job_overrides: list[str]) -> str:
    """The train.py command that runs ``prediction``'s setup on the job: model and data, the
    user's own model/data overrides (the later of two for one key wins, as in Hydra), the setup."""
    parts = {"model": f"model={rec.job.model}", "data": f"data={rec.job.data}"}
    for override in job_overrides:
        parts[override.split("=")[0]] = override
    return " ".join(["python train.py", *parts.values(), prediction.setup.overrides])


def recommendation_dict(rec: Recommendation, note: str, elapsed: float, close_call: float, job_overrides: list[str]) -> dict:
    best = rec.best

    def with_command(p: Prediction) -> dict:
        return p.as_dict() | {"command": train_command(rec, p, job_overrides)}

    return {
        "hw": rec.hw.name,
        "job": vars(rec.job) | {"steps_per_epoch": rec.job.steps},
        "runs": note,
        "sequential_basis": rec.sequential.basis,
        "predictions": [p.as_dict() for p in rec.predictions],
        "recommended": with_command(best) if best else None,
        "predicted_fastest": rec.fastest.setup.label if rec.fastest else None,
        "prefer_sequential_within": rec.prefer_sequential_within,
        "close_call_band": close_call,
        "close_calls": [with_command(p) for p in rec.close_calls(close_call)],
        "allocator_advice": _allocator_advice(rec, job_overrides),
        "seconds": round(elapsed, 2),
    }


def _allocator_advice(rec: Recommendation, job_overrides: list[str]) -> dict | None:
    why = allocator_advice(rec)
    if why is None:
        return None
    overrides = [o for o in job_overrides if not o.startswith("cpu_allocator=")]  # the user's, replaced
    return {"why": why, "command": train_command(rec, rec.best, [*overrides, f"cpu_allocator={KEEP_FREED}"])}


def recommendation_table(rec: Recommendation, note: str, elapsed: float, close_call: float, job_overrides: list[str]) -> str:
    j = rec.job
    lines = [f"{j.model} on {j.data} ({j.image_size}px, global batch {j.batch_size}, {j.train_samples} training images) "
             f"on hw={rec.hw.name}: {rec.hw.nodes} node(s) x {rec.hw.devices_per_node} {rec.hw.device_kind}"
             f"{' cores' if rec.hw.device_kind == 'cpu' else 's'} ({rec.hw.device_name})",
             f"measured runs: {note}" + ("" if rec.runs_used else "; none usable: every figure below is a model estimate"),
             f"T_seq basis: {rec.sequential.basis}", ""]
    header = ["#", "setup", "epoch s", "speedup", "memory/device", "fits", "basis"]
    rows = []
    for i, p in enumerate(rec.predictions, 1):
        fits = "yes" if p.memory.fits else f"no (> {p.memory.limit_gb:.1f} GB of {p.memory.what})"
        rows.append([str(i), p.setup.label, f"{p.epoch_s:.2f}", f"{p.speedup:.2f}x", f"{p.memory.per_device_gb:.2f} GB",
                     fits, p.basis.replace(f"T_seq {rec.sequential.basis}", "T_seq").lstrip("; ") or "T_seq"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    best = rec.best
    lines.append("")
    if best is None:
        lines.append("recommendation: none of these setups fits in memory; lower data.batch_size or use more devices")
    else:
        lines.append(f"recommendation: {best.setup.label}: {best.epoch_s:.2f} s/epoch predicted, {best.speedup:.2f}x one device")
        fastest = rec.fastest
        if fastest is not best:
            lines.append(f"  over {fastest.setup.label}, predicted {100 * (1 - fastest.epoch_s / best.epoch_s):.1f}% "
                         f"faster: less than prefer_sequential_within={rec.prefer_sequential_within:g}, so not worth "
                         f"splitting the batch (the sequential run trains exactly as the baseline, in one process)")
        lines.append(f"  {train_command(rec, best, job_overrides)}")
        close = rec.close_calls(close_call)
        if close:
            lines.append(f"close calls: predicted within {100 * close_call:.0f}% of it, inside the models' error, so "
                         f"measure them too before settling:")
            for p in close:
                lines.append(f"  {p.setup.label} ({100 * (p.epoch_s / best.epoch_s - 1):+.1f}%): "
                             f"{train_command(rec, p, job_overrides)}")
        advice = _allocator_advice(rec, job_overrides)
        if advice:
            lines.append(f"allocator: {advice['why']}:")
            lines.append(f"  {advice['command']}")
    lines.append(f"({elapsed:.1f} s)")
    return "\n".join(lines)


def log_recommendation(cfg: DictConfig, rec: Recommendation, note: str, out_dir: Path, job_overrides: list[str]) -> None:
    """One run in the ``recommendations`` experiment: the inputs as params, the answer as tags,
    metrics and a JSON artifact."""
    from mlflow.tracking import MlflowClient

    uri = cfg.logger.tracking_uri
    check_tracking_uri(uri)
    client = MlflowClient(uri)
    exp_id = experiment_id(client, cfg.logger.experiment_name, uri, cfg.logger.artifact_location)
    best = rec.best
    run = client.create_run(exp_id, run_name=cfg.logger.run_name, tags={
        "hw": rec.hw.name, "model": rec.job.model, "data": rec.job.data,
        "recommended": best.setup.label if best else "none fits", "t_seq_basis": rec.sequential.basis[:5000],
        "close_calls": ", ".join(p.setup.label for p in rec.close_calls(cfg.close_call))[:5000]})
    rid = run.info.run_id
    for key, value in {"batch_size": rec.job.batch_size, "image_size": rec.job.image_size,
                       "train_samples": rec.job.train_samples, "nodes": rec.hw.nodes,
                       "prefer_sequential_within": rec.prefer_sequential_within}.items():
        client.log_param(rid, key, value)
    if best:
        client.log_metric(rid, "predicted_epoch_s", best.epoch_s)
        client.log_metric(rid, "predicted_speedup", best.speedup)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "recommendation.json"
    path.write_text(json.dumps(recommendation_dict(rec, note, 0.0, cfg.close_call, job_overrides), indent=2))
    client.log_artifact(rid, str(path))
    client.set_terminated(rid, "FINISHED")


def report_validation(cfg: DictConfig, predictor: Predictor, note: str, out_dir: Path, started: float) -> None:
    rows, picks = leave_one_out(predictor, cfg.cpu_allocator)
    if not rows:
        raise ConfigError(f"mode=validate: no measured runs on hw={predictor.hw.name} ({note}); run a sweep first "
                          f"(python train.py -m strategy=sequential,threads,cpu_mp,ddp_gloo,pipe model=alexnet,resnet18 "
                          f"trainer.max_epochs=3 measure.warmup_epochs=1)")
    groups = defaultdict(list)
    for r in rows:
        groups[r.group].append(abs(r.error))
    summary = {g: {"runs": len(e), "median_ape": statistics.median(e), "mape": statistics.fmean(e)} for g, e in groups.items()}
    result = {
        "hw": predictor.hw.name, "runs": note,
        "rows": [r.as_dict() for r in rows],
        "per_strategy": summary,
        "recommendations": {w: vars(p) | {"correct": p.correct} for w, p in picks.items()},
        "prefer_sequential_within": predictor.prefer_sequential_within,
        **pick_figures(list(picks.values())),
        "seconds": round(time.perf_counter() - started, 1),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = _validation_plot(rows, out_dir / "predicted_vs_measured.png")
    (out_dir / "validation.json").write_text(json.dumps(result, indent=2))
    if cfg.output == "json":
        print(json.dumps(result, indent=2))
        return
    print(f"leave-one-configuration-out on hw={predictor.hw.name}: {note}\n")
    print("| workload | setup | measured s | predicted s | error |\n|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r.workload, r.measured_s)):
        print(f"| {r.workload} | {r.setup} | {r.measured_s:.2f} | {r.predicted_s:.2f} | {100 * r.error:+.1f}% |")
    print("\n| strategy | runs | median abs. error | mean abs. error |\n|---|---|---|---|")
    for g, s in sorted(summary.items()):
        print(f"| {g} | {s['runs']} | {100 * s['median_ape']:.1f}% | {100 * s['mape']:.1f}% |")
    print("\n| workload | recommended | measured fastest | recommended measured slower by | correct "
          "| resamples: fastest again / recommended fastest |\n|---|---|---|---|---|---|")
    for w, p in sorted(picks.items()):
        verdict = "T" if p.correct else "F, runs overlap" if p.overlapping else "F"
        print(f"| {w} | {p.recommended} | {p.fastest} | {100 * p.slowdown:.1f}% | {verdict} "
              f"| {100 * p.fastest_reproduced:.0f}% / {100 * p.recommended_fastest:.0f}% |")
    if picks:
        n = len(picks)
        correct, near, plain = (round(n * result[k]) for k in
                                ("correct_fraction", "correct_or_overlapping_fraction", "predicted_fastest_correct_fraction"))
        print(f"\ncorrect recommendations: {correct}/{n} = {100 * correct / n:.0f}%; "
              f"correct or with runs overlapping the fastest's (repeats do not tell them apart): "
              f"{near}/{n} = {100 * near / n:.0f}%; the recommended setups measured "
              f"{100 * result['mean_slowdown']:.1f}% slower than the fastest on average, at most "
              f"{100 * result['max_slowdown']:.1f}%")
        print(f"with prefer_sequential_within={predictor.prefer_sequential_within:g}; always the predicted fastest "
              f"(prefer_sequential_within=0): {plain}/{n} = {100 * plain / n:.0f}% correct")
        print(f"resampling each setup's runs: the measured fastest is the fastest again in "
              f"{100 * result['fastest_reproduced_fraction']:.0f}% of resamples (mean over workloads: what naming the "
              f"measured fastest could expect against a re-measurement in the same sittings), the recommended setup in "
              f"{100 * result['recommended_fastest_fraction']:.0f}%")
    print(f"wrote {out_dir / 'validation.json'} and {plot} ({result['seconds']} s)")


def _validation_plot(rows, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for group in sorted({r.group for r in rows}):
        pts = [r for r in rows if r.group == group]
        ax.scatter([r.measured_s for r in pts], [r.predicted_s for r in pts], label=group)
    top = max(max(r.measured_s, r.predicted_s) for r in rows) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.plot([0, top], [0, 1.1 * top], color="grey", linewidth=0.5, linestyle=":")
    ax.plot([0, top], [0, 0.9 * top], color="grey", linewidth=0.5, linestyle=":")
    ax.set_xlabel("measured s/epoch")
    ax.set_ylabel("predicted s/epoch (leave-one-out)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
