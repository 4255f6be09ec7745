"""What ``recommend.py`` does in each mode, from a composed config (no Hydra below this line)."""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..allocator import apply_allocator, check_allocator, resolve_allocator
from ..config import DataConfig, RecommendConfig
from ..config_check import check_recommend_job, typed_recommend_config
from ..data.folder import complete_data_config
from ..errors import ConfigError
from ..process import wait_for
from ..job import (Batches, Job, cache_outcome, images_of_training_split, split_too_small, synthetic_count_problem,
                   validation_images)
from ..models import check_request
from ..records import left_out, on_hardware
from ..strategies import BASELINE
from ..tracking import check_tracking_uri, import_store_client, load_runs, log_result_run, store_exists
from ..ui import is_server, logged_as
from ..costmodel.hardware import GB, HardwareSpec, detect_local, machine_identity, time_local_rates, validate
from .count_ahead import count_ahead
from .kept_probes import forget, kept
from .machines import compare
from .prediction import Predictor, Recommendation, data_config_of_job
from .choices import check_strategies, check_tries
from .setups import candidates, only_strategies
from .render import (
    comparison_dict,
    comparison_lines,
    recommendation_dict,
    recommendation_table,
    validation_plot,
    validation_text,
)
from ..costmodel.numerics import numerics_of, numerics_on
from .sequential_time import ProbedBatch, probe_batches, probe_loading
from .validation import group_errors, pick_figures
from .hw_files import load_hw_file
from .validation import validate as leave_one_out

MODES = ("recommend", "validate", "probe")
OUTPUTS = ("table", "json")


def hardware(cfg_hw: DictConfig, detected_dir: Path | None = None, refresh: bool = False, timed: bool = True) -> HardwareSpec:
    """The typed, checked description: unknown keys and missing values are named. ``detected_dir``
    keeps hw=local's timed rates per machine (:func:`~ddlx.costmodel.hardware.detect_local`;
    ``timed=False``: hw=local's host, cores and devices only)."""
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
        detect_local(spec, detected_dir, refresh, timed)
    return validate(spec)


def local_hardware(target: HardwareSpec, hw_dir: Path, detected_dir: Path | None = None, refresh: bool = False,
                   timed: bool = True) -> HardwareSpec:
    """This machine: the target itself when it is this machine, else detected from local.yaml
    (``timed=False``: its host, cores and devices only, local.yaml's placeholder rates left as they are)."""
    if target.detect or target.host:
        import socket

        if target.host == socket.gethostname():
            return target
    return hardware(load_hw_file(hw_dir / "local.yaml"), detected_dir, refresh, timed)


def job_from_config(cfg: RecommendConfig) -> Job:
    data = cfg.data
    folder = complete_data_config(data)
    count = data.num_images
    if folder is None and (problem := synthetic_count_problem(count, data.num_classes)):  # the probes write it
        raise ConfigError(problem)
    if count is None:
        count = len(folder.samples)
    elif folder is not None:
        count = min(count, len(folder.samples))  # train.py trains on all of them where fewer are there
    folder_holds = None if folder is None else len(folder.samples)
    if problem := split_too_small(count, data.val_fraction, data.batch_size, folder_holds):  # as train.py refuses it on one device
        raise ConfigError(problem)
    train = count - validation_images(count, data.val_fraction)  # as train.py splits them
    check_request(cfg.model.name, data.num_classes, data.channels, data.image_size)
    return Job(cfg.model.name, data.name, data.num_classes, data.channels, data.image_size, data.batch_size, train,
               data.num_workers, cfg.cpu_allocator, numerics_of(cfg.trainer.precision).precision)


def with_data_cache(job: Job, cfg: RecommendConfig, target) -> Job:
    """``job`` keeping its decoded images in memory where train.py would on ``target`` (its RAM
    per node, all of it available); the probes then load as the job would."""
    outcome = cache_of(job, cfg, target)
    cfg.data.cache = "auto" if outcome == "memory" else "none"
    return dataclasses.replace(job, data_cache=outcome)


def cache_of(job: Job, cfg: RecommendConfig, target) -> str:
    """Where train.py would keep ``job``'s decoded images on ``target``: in memory or not."""
    images = images_of_training_split(job.train_samples, cfg.data.val_fraction)
    return cache_outcome(cfg.data.cache, images, job.channels, job.image_size, target.ram_per_node_gb * GB)


def measured_runs(cfg: RecommendConfig, machines: list[HardwareSpec]) -> tuple[list, str]:
    """The store's runs, and what they are: how many, how many of them on the question's
    ``machines`` (the only ones its figures can come from), and which of those are left out, why."""
    uri = cfg.logger.tracking_uri
    if not store_exists(uri):
        return [], f"no MLflow store at {uri}"
    check_tracking_uri(uri, write=False)  # (where the answer is recorded, checked at the start)
    runs, missing = [], []
    for name in cfg.experiments:
        try:
            runs += load_runs(uri, [name])
        except ValueError:
            missing.append(name)
    note = f"{len(runs)} runs from {uri}" + (f" (no experiment {', '.join(missing)})" if missing else "")
    on_them = [r for r in runs if any(on_hardware(r, machine) for machine in machines)]
    note += f", {len(on_them)} of them on " + " or ".join(dict.fromkeys(f"hw={machine.name}" for machine in machines))
    dropped = left_out(on_them)
    if dropped:
        note += "; left out: " + "; ".join(f"{len(group)} {why} ({_ids(group)})" for why, group in dropped.items())
    return runs, note


def store_overrides_for(target, tracking_uri: str, store_overrides: list[str]) -> list[str]:
    """The store overrides a printed command for ``target`` carries: all of them on this machine
    (hw=local), where the runs are made beside the store; elsewhere, only a tracking server's
    address (a path on this machine names nothing there)."""
    if target.detect:
        return store_overrides
    return [o for o in store_overrides if o.startswith("logger.") and is_server(tracking_uri)]


def _ids(runs, shown: int = 6) -> str:
    ids = [r.run_id[:8] for r in runs]
    return ", ".join(ids[:shown]) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def run(composed: DictConfig, out_dir: Path, hw_dir: Path, job_overrides: list[str] | None = None,
        hw_overrides: list[str] | None = None, store_overrides: list[str] | None = None) -> None:
    """recommend.py's job from its ``composed`` config, typed here once (:class:`RecommendConfig`,
    ``hw`` a :class:`HardwareSpec`). ``job_overrides``: the model/data overrides the job was
    given, repeated in the train.py commands printed for it; ``hw_overrides``: the fields of
    ``hw=`` it changed (``hw.nodes=2``), which make it another machine than its file in ``compare=``;
    ``store_overrides``: where the runs it reads are (``paths.*``, ``logger.tracking_uri``, a single
    experiment), repeated in the commands for this machine, or for any with a tracking server."""
    cfg: RecommendConfig = typed_recommend_config(composed)
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode}; expected one of {', '.join(MODES)}")
    if cfg.output not in OUTPUTS:
        raise ConfigError(f"output={cfg.output}; expected one of {', '.join(OUTPUTS)}")
    if not 0 <= cfg.close_call < 1:
        raise ConfigError(f"close_call={composed.close_call}; expected a fraction in [0, 1), e.g. close_call=0.05")
    started = time.perf_counter()
    cfg.cpu_allocator = resolve_allocator(cfg.cpu_allocator)  # as train.py resolves it on this machine
    check_allocator(cfg.cpu_allocator)
    job = job_from_config(cfg) if cfg.mode == "recommend" else None  # bad values named before any timing
    wanted = check_strategies(cfg.strategies)
    detected_dir = Path(cfg.detected_dir) if cfg.detected_dir else None
    target = hardware(composed.hw, detected_dir, refresh=cfg.mode == "probe")
    check_recommend_job(composed, False, hw_dir)  # folders, data values; compare= names machines; max_epoch_s is a time
    if cfg.mode == "recommend" and cfg.log:  # the answer is recorded there: refused now, not after it
        check_tracking_uri(cfg.logger.tracking_uri, read_only_option="log=false")
    if job is not None:
        numerics_on(job.precision, target.device_kind)  # 16-mixed on CPU: Lightning would train bf16-mixed
        job = with_data_cache(job, cfg, target)
    if cfg.mode == "probe":  # measures everything again, the kept rates and probes included
        from .linkprobe import write_probed_hw

        local = target if target.detect else local_hardware(target, hw_dir, detected_dir, refresh=True)
        forget(detected_dir, local.host)
        path, doc = write_probed_hw(local, hw_dir)
        print(json.dumps(doc, indent=2) if cfg.output == "json" else f"wrote {path}: {doc['intra_node']}, "
              f"memory {doc['memory_bandwidth_gb_s']} GB/s per core; use it with hw={doc['name']}")
        return
    hw_overrides = tuple(hw_overrides or ())
    # Each machine once, hw= first; hw=X changed by overrides and compare=[X]: the two of them.
    named = dict.fromkeys(name for name in cfg.compare or [] if name != target.name or hw_overrides)
    others = [hardware(load_hw_file(hw_dir / f"{name}.yaml"), detected_dir) for name in named] if job is not None else []
    identity = local_hardware(target, hw_dir, detected_dir, timed=False)  # what this machine's kept probes are kept under
    # This machine's timed rates (a second, once per machine) price only machines of its kind: a CPU's
    # count for no GPU target, whose loading probe needs no rate.
    machines = [target, *others]
    of_its_kind = any(m.device_kind == identity.device_kind for m in machines)
    local = None
    if of_its_kind or cfg.mode == "validate":  # (the target, where it is this machine, has its rates as the target)
        local = identity if identity is target else validate(time_local_rates(identity, detected_dir))
    apply_allocator(cfg.cpu_allocator)  # the probes train as the job would
    counting = count_ahead(job, target.device_kind == "gpu") if job is not None else None
    # The runs counted: on the machines asked about, and on this one where they are of its kind.
    runs, note = measured_runs(cfg, machines + [local] if of_its_kind and local is not target else machines)
    if counting is not None and cfg.log and not store_exists(cfg.logger.tracking_uri):
        import_store_client(cfg.logger.tracking_uri)  # no store was read: MLflow's import, while the child counts
    wait_for(counting)
    probe = loading = None
    if cfg.probe:
        probe, loading = kept_probes(cfg, runs, identity, detected_dir)
    if cfg.mode == "validate":
        report_validation(cfg, Predictor(target, runs, local, probe, loading), note, out_dir, started)
        return
    tries, own = check_tries(cfg.candidates)
    batches = Batches(cfg.data.batch_per, tuple(own))
    recs = []
    for machine in [target, *others]:  # the same question on each machine, the runs and probes of this one shared
        on_it = job if machine is target else dataclasses.replace(job, data_cache=cache_of(job, cfg, machine))
        setups = only_strategies(candidates(machine, on_it, batches, tries), wanted, machine, required=machine is target)
        rec = Predictor(machine, runs, local, probe, loading).recommend(on_it, setups, batches=batches)
        rec.errors = close_call_errors(Predictor(machine, runs, local), cfg.cpu_allocator, rec)
        rec.epochs = cfg.trainer.max_epochs
        rec.hw_overrides = hw_overrides if machine is target else ()
        rec.strategies = tuple(wanted)
        recs.append(rec)
    rec = recs[0]
    comparison = compare(recs, cfg.max_epoch_s) if others or cfg.max_epoch_s is not None else None
    elapsed = time.perf_counter() - started
    overrides = [*(job_overrides or []), *store_overrides_for(target, cfg.logger.tracking_uri, store_overrides or [])]
    answer = recommendation_dict(rec, note, elapsed, cfg.close_call, overrides)
    if comparison is not None:
        answer["compared"] = [recommendation_dict(r, note, 0.0, cfg.close_call, overrides) for r in recs[1:]]
        answer["comparison"] = comparison_dict(comparison, overrides)
    if cfg.output == "json":
        print(json.dumps(answer, indent=2))
    else:
        table = recommendation_table(rec, note, elapsed, cfg.close_call, overrides)
        extra = comparison_lines(recs, comparison, overrides) if comparison is not None else []
        print("\n".join([table, *extra]))
    if cfg.log:
        logged = logged_as(cfg.logger.tracking_uri, cfg.logger.experiment_name, *log_recommendation(cfg, rec, answer, out_dir))
        print(logged, file=sys.stderr if cfg.output == "json" else sys.stdout)  # stdout: the JSON alone


def close_call_errors(unprobed: Predictor, cpu_allocator: str, rec: Recommendation) -> dict[str, float]:
    """The validated errors that decide close calls: leave-one-out on the target's runs, without
    probes (a held-out one-device baseline from FLOPs); the job's own one-device baseline, when
    runs measured it, counts as exact, and as unvalidated when it was probed or estimated."""
    errors = group_errors(unprobed, cpu_allocator)
    errors.pop(BASELINE, None)
    if rec.sequential.measured:  # at the job's batch (one scaled from another batch is not exact)
        errors[BASELINE] = 0.0
    return errors


def kept_probes(cfg: RecommendConfig, runs, local: HardwareSpec, detected_dir: Path | None):
    """The training and loading probes of a job, each timed once per machine and what its time
    depends on, and kept in ``detected_dir`` (:mod:`.kept_probes`): asked twice, a question gets the
    same answer."""
    machine = machine_identity(local)

    def what(job: Job) -> dict:
        data = dataclasses.asdict(_probe_data(cfg, job, runs))
        shape = {k: data.get(k) for k in PROBED_DATA_KEYS}
        return {"data": shape, "cpu_allocator": cfg.cpu_allocator, "torch": _torch_version()}

    def probe(job: Job):
        def batches(n: int) -> list[ProbedBatch]:
            key = {**what(job), "model": job.model, "batch_size": job.batch_size, "batches": n,
                   "optim": dataclasses.asdict(cfg.optim), "precision": job.precision}
            timed = kept(detected_dir, machine, "train", key, lambda: [
                dataclasses.asdict(b) for b in probe_batches(_probe_data(cfg, job, runs), job.model, 1, cfg.probe_max_s,
                                                            cfg.optim, job.precision)(n)])
            return [ProbedBatch(**b) for b in timed]
        return batches

    def loading(job: Job):
        return lambda: kept(detected_dir, machine, "loading", what(job),
                            probe_loading(_probe_data(cfg, job, runs), cfg.probe_max_s))

    return probe, loading


# What a probe's time depends on in the data config (not its image count or loader workers).
PROBED_DATA_KEYS = ("name", "root", "image_size", "channels", "num_classes", "synthetic_size", "synthetic_format",
                    "random_flip", "mean", "std")


def _torch_version() -> str:
    import torch

    return torch.__version__


def _probe_data(cfg: RecommendConfig, job: Job, runs) -> DataConfig:
    """The data config to probe ``job`` with: the composed one when it is that job, else the
    config of a measured run of exactly that job (validation probes the runs' own workloads)."""
    if (cfg.model.name, cfg.data.image_size, cfg.data.batch_size) != (job.model, job.image_size, job.batch_size):
        measured = data_config_of_job(job, runs)
        if measured is not None:
            return measured
    return cfg.data


def log_recommendation(cfg: RecommendConfig, rec: Recommendation, answer: dict, out_dir: Path) -> tuple[str, str]:
    """One run in the ``recommendations`` experiment: the inputs as params, the answer as tags,
    metrics and a JSON artifact (``answer``, the other machines' included). Its experiment's id and its own."""
    best = rec.best
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "recommendation.json"
    path.write_text(json.dumps(answer | {"seconds": 0.0}, indent=2))
    return log_result_run(
        cfg.logger.tracking_uri, cfg.logger.experiment_name, cfg.logger.run_name, artifact_location=cfg.logger.artifact_location,
        tags={"hw": rec.hw.name, "model": rec.job.model, "data": rec.job.data,
              "recommended": best.setup.label if best else "none fits", "t_seq_basis": rec.sequential.basis[:5000],
              "close_calls": ", ".join(p.setup.label for p in rec.close_calls(cfg.close_call))[:5000]},
        params={"batch_size": rec.job.batch_size, "image_size": rec.job.image_size, "train_samples": rec.job.train_samples,
                "nodes": rec.hw.nodes, "strategies": ",".join(rec.strategies) or "all"},
        metrics={"predicted_epoch_s": best.epoch_s, "predicted_speedup": best.speedup} if best else {},
        files=[path])


def report_validation(cfg: RecommendConfig, predictor: Predictor, note: str, out_dir: Path, started: float) -> None:
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
        **pick_figures(list(picks.values())),
        "seconds": round(time.perf_counter() - started, 1),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = validation_plot(rows, out_dir / "predicted_vs_measured.png")
    (out_dir / "validation.json").write_text(json.dumps(result, indent=2))
    if cfg.output == "json":
        print(json.dumps(result, indent=2))
        return
    print(validation_text(predictor.hw.name, note, rows, summary, picks, result))
    print(f"wrote {out_dir / 'validation.json'} and {plot} ({result['seconds']} s)")
