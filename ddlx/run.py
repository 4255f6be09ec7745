"""One training run from a composed config: check everything, build, fit, log to MLflow.

Called by ``train.py`` and by each rank a launcher starts; takes the composed OmegaConf config but
not Hydra, so tests can call it directly. :func:`train` turns it into the typed dataclasses of
:mod:`ddlx.config` once; everything below reads those.
"""
from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import psutil
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from .allocator import apply_allocator, check_allocator, resolve_allocator
from .allocator import explain as explain_allocator
from .command_line import HowToResume, task_override_keys, task_overrides
from .checkpoints import (
    LAST,
    LAYOUT_TAGS,
    RunInCheckpoint,
    check_resumable,
    checkpoint_callbacks,
    checkpoint_writer,
    read_saved_run,
)
from .config import TrainConfig, TrainerConfig
from .config_check import option_params, typed_config
from .console import EpochLines, RunSummary, is_terminal, silence_known_noise
from .data.datamodule import build_datamodule
from .data.folder import complete_data_config
from .epoch_batches import process_batches, trainer_batch_problems
from .errors import ConfigError, RankDied, Stopped, rank_lost
from .job import precision_of
from .job_log import say
from .machine import busy_cores, machine_tags
from .measure.resources import ResourceMonitor
from .measure.timing import EpochTimer
from .compiling import compile_model, to_memory_format
from .models import build_model
from .module import ClassifierModule
from .parallel.launch import (
    RelaunchingDDPStrategy,
    WorkerLauncher,
    cluster_environment_plugins,
    end_distributed_job,
    settle_cluster_environment,
)
from .parallel.network import stages_run
from .parallel.same_job import SameJobOnEveryRank
from .costmodel.memory import GIB, estimate_training_memory
from .preflight import check_before_torch, precision_problem
from .process import launch_rank, outside_launcher, rank_logging
from .records import not_counted, run_name
from .single_sample import check_single_sample_batches
from .slurm import run_tags as slurm_run_tags
from .stopping import RecordStop, StopAtSignal, StopSignals, disable_lightning_signal_handlers
from .strategies import STRATEGIES, build_strategy
from .tracking import (
    check_experiment,
    check_resumable_run,
    check_tracking_uri,
    close_vanished_runs,
    flatten_config,
    make_logger,
    mark_failed,
    prepare_store,
    record_rejected_run,
    record_unmeasured,
    recorded,
    reopen_run,
    run_not_held,
    start_run,
    store_exists,
    tag_run,
    use_case,
)

log = logging.getLogger(__name__)

# Headroom left for the interpreter, loader workers and allocator slack.
MEMORY_HEADROOM = 0.85


def on_gpu(accelerator: str) -> bool:
    return accelerator in ("gpu", "cuda") and torch.cuda.is_available()


def available_memory_bytes(accelerator: str) -> tuple[int, str]:
    if on_gpu(accelerator):
        free, _ = torch.cuda.mem_get_info()
        return free, "free memory on cuda:0"
    return psutil.virtual_memory().available, "available RAM"


def check_memory(cfg: TrainConfig, data_parallel: int = 1, replicas: int = 1, recompute: bool = False) -> None:
    """Refuse a model/data/batch that cannot fit, before any training starts.

    Each of ``replicas`` model copies on this machine trains ``batch_size / data_parallel`` samples.
    """
    data = cfg.data
    precision = precision_of(cfg.trainer.precision)
    batch = max(1, data.batch_size // data_parallel)
    estimate, per_sample = estimate_training_memory(
        cfg.model.name, data.num_classes, data.channels, data.image_size, batch,
        precision=precision,
        recompute=recompute,
    )
    working = 0
    if on_gpu(cfg.trainer.accelerator):  # its libraries' workspaces beside what is counted
        from .costmodel.gpu_measured import gpu_working_memory

        working = gpu_working_memory()[0]
    need = (estimate.total_bytes + working) * replicas
    have, what = available_memory_bytes(cfg.trainer.accelerator)
    if need > MEMORY_HEADROOM * have:
        per_sample += estimate.input_bytes / batch  # the fp32 batch autocast holds beside its cast
        fixed = (estimate.total_bytes - estimate.activations_bytes - estimate.input_bytes + working) * replicas
        max_batch = int((MEMORY_HEADROOM * have - fixed) / (per_sample * replicas)) * data_parallel
        fix = f"lower data.batch_size to {max_batch} or less" if max_batch >= 1 else "use a smaller model or data.image_size"
        raise ConfigError(
            f"model={cfg.model.name} on data={data.name} (image_size={data.image_size}, batch_size={data.batch_size}"
            f"{f', {replicas} replicas' if replicas > 1 else ''}) needs about {need / GIB:.1f} GiB to train, "
            f"but only {have / GIB:.1f} GiB of {what} is there: {fix} "
            f"(or set memory_check=false to try anyway)"
        )


def run_tags(cfg: TrainConfig, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Tags every run carries, known before anything is built."""
    return {
        "model": cfg.model.name,
        "data": cfg.data.name,
        "strategy": cfg.strategy.name,
        "precision": precision_of(cfg.trainer.precision),
        "use_case": use_case(cfg.model.name, cfg.data.name),
        **machine_tags(),
        **slurm_run_tags(),
        **(extra or {}),
        **(cfg.logger.tags or {}),
    }


def measurement_callbacks(cfg: TrainConfig) -> list[pl.Callback]:
    callbacks: list[pl.Callback] = [EpochTimer(cfg.measure.warmup_epochs)]
    if cfg.measure.monitor:
        callbacks.append(ResourceMonitor(cfg.measure.monitor_interval_s))
    return callbacks


def trainer_arguments(trainer_cfg: TrainerConfig) -> dict:
    """The ``trainer`` values that differ from Lightning's defaults (the schema's), each checked
    against the installed Lightning's ``Trainer`` signature."""
    defaults = asdict(TrainerConfig())
    chosen = {k: v for k, v in asdict(trainer_cfg).items() if defaults.get(k, k) != v}
    accepted = inspect.signature(pl.Trainer.__init__).parameters
    unknown = sorted(set(chosen) - set(accepted))
    if unknown:
        raise ConfigError(f"{', '.join(f'trainer.{k}' for k in unknown)}: not an argument of this Lightning's Trainer "
                          f"(pytorch_lightning {pl.__version__}); remove it or upgrade pytorch-lightning")
    return chosen


def check_accelerator(cfg: TrainConfig) -> None:
    if cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={cfg.trainer.accelerator}, but this machine has no CUDA GPU that torch "
                          f"can use (torch.cuda.is_available() is False); train on the CPU with trainer=default")


def build_trainer(cfg: TrainConfig, plan, logger, output_dir: Path, callbacks: list[pl.Callback],
                  checkpoint_dir: Path | None = None) -> pl.Trainer:
    """The Trainer: the user's ``trainer`` values, the strategy's, and ddlx's own: its callbacks,
    the checkpoint policy (into ``checkpoint_dir``, default the run's ``checkpoints/``) and
    writer; stop signals are ddlx's (:mod:`ddlx.stopping`)."""
    checkpoint_dir = checkpoint_dir or output_dir / "checkpoints"
    saving = checkpoint_callbacks(cfg.checkpoint.save, cfg.checkpoint.keep_best, checkpoint_dir, cfg.checkpoint.every_minutes)
    arguments = {**trainer_arguments(cfg.trainer), **plan.trainer_kwargs}
    if not is_terminal():  # a progress bar cannot redraw in a file or a pipe: a line per epoch instead
        arguments["enable_progress_bar"] = False
        callbacks = [*callbacks, EpochLines()]
    try:
        trainer = pl.Trainer(
            **arguments,
            logger=logger if logger is not None else False,
            callbacks=[*callbacks, *saving],
            enable_checkpointing=bool(saving),
            plugins=[checkpoint_writer(cfg.checkpoint.background), *cluster_environment_plugins(arguments.get("strategy"))],
            default_root_dir=str(output_dir),
            use_distributed_sampler=False,  # the datamodule shards (see ddlx/data/image_data.py, ImageFolderData._loader)
        )
    except (MisconfigurationException, ValueError, TypeError) as err:
        raise ConfigError(f"Lightning refused the trainer settings: {err}; check the trainer.* values") from err
    disable_lightning_signal_handlers(trainer)
    return trainer


class RankDeath:
    """A rank process died (kill -9, the out-of-memory killer, a crash): the console says so and
    how to resume, then the run is marked FAILED with the reason; once, by whichever finds it
    first: Lightning's watchdog (which kills this process next, so its end summary may not
    follow) or this process failing on the dead rank's connection (:func:`fit`). The second
    waits for the first to finish."""

    def __init__(self, output_dir: Path, resume: HowToResume) -> None:
        self.output_dir, self.resume = output_dir, resume
        self._lock, self._said = threading.Lock(), False

    def __call__(self, logger, reason: str) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
            say(f"ddlx: run FAILED: {reason}; its folder: {self.output_dir}", err=True)
            self.resume.say()
            mark_failed(logger, reason)

    @property
    def said(self) -> bool:
        return self._said


def job_overrides() -> list[str]:
    """This Hydra job's overrides; none where train() is called outside a Hydra job."""
    try:
        return task_overrides()
    except ValueError:
        return []


def train(cfg, output_dir: str | os.PathLike, extra_tags: Mapping[str, str] | None = None) -> dict[str, float]:
    """Train once as ``cfg`` says and return the final logged metrics (on every rank).

    ``extra_tags`` go on the MLflow run; with a ``sweep_id`` among them (a job of a sweep), a job
    refused before training is still recorded as a FAILED run with the reason. With
    ``cfg.ckpt_path``, training continues from that checkpoint, into the MLflow run it belongs to.
    """
    silence_known_noise()
    cfg: TrainConfig = typed_config(cfg)  # train.py checked its command line; a caller's config may not have been
    check_before_torch(cfg)
    output_dir = Path(output_dir)
    rank0 = launch_rank() == 0  # only global rank 0 talks to MLflow: its client may create the store
    if not rank0:  # rank 0 speaks for the job: under mpirun or srun each rank is a train.py with Hydra's log
        rank_logging()
    pl.seed_everything(cfg.seed, workers=True)
    signals = StopSignals()

    # 1. Everything that can be wrong is checked, and the Trainer built, before a run is opened.
    check_tracking_uri(cfg.logger.tracking_uri)
    if rank0:
        check_experiment(cfg.logger.tracking_uri, cfg.logger.experiment_name)
    tags = None
    try:
        complete_data_config(cfg.data)  # data=imagefolder: classes, counts, channels and name from the folder
        tags = run_tags(cfg, extra_tags)
        saved, plan, datamodule = prepare_job(cfg, tags, rank0)
        resolved = asdict(cfg)  # as the checks left it (cpu_allocator resolved, a worker's batch made global)
        apply_allocator(cfg.cpu_allocator)  # before the model and the ranks (they inherit it)
        # The resolved config: an MLflow artifact, and the job description the other ranks start from.
        config_file = output_dir / "config_resolved.yaml"
        if rank0:
            output_dir.mkdir(parents=True, exist_ok=True)
            config_file.write_text(yaml.safe_dump(resolved, sort_keys=False))
        strategy = plan.trainer_kwargs.get("strategy")
        if isinstance(strategy, RelaunchingDDPStrategy):
            strategy.worker_args = [str(config_file), str(output_dir)]  # before the Trainer picks a launcher
        accelerator = str(plan.trainer_kwargs.get("accelerator", cfg.trainer.accelerator))
        tags.update({
            "synthetic_data": str(datamodule.is_synthetic),
            "accelerator": "gpu" if accelerator in ("gpu", "cuda") else accelerator,  # the report's device kind
            "output_dir": str(output_dir),
            **plan.tags,
        })
        resume_run = saved.run_id if saved is not None else None
        params = flatten_config(resolved)
        logger = make_logger(cfg.logger.tracking_uri, cfg.logger.experiment_name, cfg.logger.run_name or run_name(params, tags), tags,
                             cfg.logger.artifact_location, run_id=resume_run) if rank0 else None  # no run yet
        identity = RunInCheckpoint(resolved, {key: plan.tags[key] for key in LAYOUT_TAGS if key in plan.tags})
        # A resumed run goes on writing where its checkpoint is (last.ckpt replaced, the best kept track of).
        checkpoint_dir = saved.path.parent if saved is not None else output_dir / "checkpoints"
        checkpoint_file = None if cfg.checkpoint.save == "none" else checkpoint_dir / LAST
        weights_only = cfg.checkpoint.save == "weights"
        not_before = None if saved is not None else time.time()  # a new run: an older last.ckpt in its folder is another's
        resume = HowToResume.of(job_overrides(), checkpoint_file, weights_only, not_before, plan.tags.get("nodes"))  # said if it FAILS
        if isinstance(strategy, RelaunchingDDPStrategy):  # a dead rank: the run FAILED with the reason
            strategy.rank_died = RankDeath(output_dir, resume)
        timer, *others = measurement_callbacks(cfg)
        callbacks = [RecordStop(), SameJobOnEveryRank(params), timer, *others, identity,
                     StopAtSignal(signals, checkpoint_file, weights_only)]
        trainer = build_trainer(cfg, plan, logger, output_dir, callbacks, checkpoint_dir)
    except ConfigError as err:
        if "sweep_id" in (extra_tags or {}) and rank0:
            tags = tags or run_tags(cfg, extra_tags)  # refused for its data: the folder's name may be unknown
            params = flatten_config(asdict(cfg))
            record_rejected_run(cfg.logger, cfg.logger.run_name or run_name(params, tags), tags, params, err)
        raise
    model = build_model(cfg.model.name, cfg.data.num_classes, cfg.data.channels, cfg.data.image_size, cfg.model.dropout)
    model = to_memory_format(model, cfg.model.memory_format)
    if cfg.compile.enable:  # compiled at its first call, timed apart (compile_s)
        compile_model(model, STRATEGIES[cfg.strategy.name].compile_unit(cfg.strategy), cfg.compile.mode)
    module = ClassifierModule(model, cfg.data.num_classes, **asdict(cfg.optim), channels_last=cfg.model.memory_format == "channels_last")
    if rank0:
        log.info("model=%s: %.1f M parameters, at %d px %.2f GFLOP per sample forward", cfg.model.name,
                 sum(p.numel() for p in model.parameters()) / 1e6, cfg.data.image_size, forward_gflops(cfg))

    # 2. Train: from the run's opening, every way out ends it (FINISHED, FAILED, KILLED).
    with signals:
        open_run = (lambda: reopen_run(logger, tags, cfg.logger.run_name)) if resume_run else \
            (lambda: start_run(logger, params, config_file, tags))
        status, run_id, said = "FAILED", None, False
        try:
            with recorded(logger, open_run, resume) as run_id:
                fit(cfg, trainer, module, datamodule, run_id, identity, timer, logger)
            status = "FINISHED"
        except Stopped as stop:
            status = "KILLED"
            stop.launcher = resume.launcher  # for its resume line (ddlx.entry)
            raise
        except ConfigError:
            said = True  # a refusal (the entry says it), which a resume would meet again
            raise
        finally:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            if run_id is not None:  # rank 0, once its run is open: how it went, where it is
                measured = timer.summary()
                # as the report will read the run; a run that did not finish says its status already
                why = not_counted(status, unmeasured_because(trainer, timer), measured, cfg.measure.warmup_epochs,
                                  cfg.data.batch_size, module.diverged is not None) if status == "FINISHED" else None
                diverged = diverged_line(cfg, module.diverged, trainer.current_epoch)
                summary = RunSummary(status, run_id, logger.experiment_id, cfg.logger.tracking_uri, len(timer.epoch_times),
                                     measured, metrics, checkpoint_file, output_dir, why[1] if why else None, diverged)
                say("\n".join(summary.lines()))
                said = said or getattr(getattr(trainer.strategy, "rank_died", None), "said", False)  # a dead rank's, with it
                if status == "FAILED" and not said:  # an error (out of memory, a lost connection): its last checkpoint resumes
                    resume.say()
    if signals.stopped_by is not None:  # after training's end: the process says it was stopped all the same
        raise Stopped(signals.stopped_by, checkpoint_file, trainer.global_step, after_training=True)
    return metrics


def fit(cfg: TrainConfig, trainer: pl.Trainer, module: ClassifierModule, datamodule, run_id: str | None,
        identity: RunInCheckpoint, timer: EpochTimer, logger) -> None:
    """Train inside the open run (``run_id``: rank 0's; None on the other ranks)."""
    if run_id is not None:
        log.info("MLflow run %s in experiment %r at %s", run_id, cfg.logger.experiment_name, cfg.logger.tracking_uri)
        identity.run_id, identity.tracking_uri = run_id, cfg.logger.tracking_uri
        identity.experiment = cfg.logger.experiment_name
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    except Exception as err:
        launcher = getattr(trainer.strategy, "launcher", None)
        died = launcher.dead_ranks() if isinstance(launcher, WorkerLauncher) else None
        if died is None:
            if outside_launcher() is not None and (lost := rank_lost(err, launch_rank())) is not None:
                raise lost from err
            raise
        trainer.strategy.rank_died(logger, died)  # the cause, not this rank's lost connection
        raise RankDied(died) from err
    finally:
        datamodule.end_workers()
        end_distributed_job(trainer.strategy)
        learnt = {"stage_layers": stages_run(module)}  # strategy.balance=auto's cut: what the run's time is of
        if (diverged := diverged_line(cfg, module.diverged, trainer.current_epoch)) is not None:
            learnt["diverged"] = diverged
        if datamodule.cached is not None:  # part of the workload: a run's loading cost depends on it
            learnt["data_cache"] = "memory" if datamodule.cached else "none"
        tag_run(logger, learnt)
    if (unmeasured := unmeasured_because(trainer, timer)) is not None:
        record_unmeasured(logger, unmeasured)


def diverged_line(cfg: TrainConfig, diverged: tuple[int, float] | None, trained: int) -> str | None:
    """What a run whose train_loss stopped being finite (``diverged``: the module's epoch and loss;
    None: it did not) says of it (its tag ``diverged``, its end); ``trained``: the epochs it ended after."""
    if diverged is None:
        return None
    epoch, loss = diverged
    went_on = f"trainer.min_epochs={cfg.trainer.min_epochs} kept it training to epoch {trained}" if trained > epoch \
        else "training stopped after it"
    held = " (its last.ckpt holds the diverged weights)" if cfg.checkpoint.save != "none" else ""
    return (f"train_loss {loss} in epoch {epoch}: the weights diverged, and {went_on}; start a new run{held} "
            f"with a lower optim.lr (now {cfg.optim.lr:g})")


def unmeasured_because(trainer: pl.Trainer, timer: EpochTimer) -> str | None:
    """Why a run trained no step the ddlx way (None: it did); its times are then no measurement."""
    if trainer.fast_dev_run:
        return "trainer.fast_dev_run"
    if timer.epoch_times:
        return None
    return "no whole epoch timed: trainer.max_steps or max_time stopped the first" if trainer.global_step else "no training step"


def forward_gflops(cfg: TrainConfig) -> float:
    """The model's forward FLOPs per sample, counted on the meta device (and kept on disk)."""
    from .costmodel.profile import profile_model

    profile = profile_model(cfg.model.name, cfg.data.num_classes, cfg.data.channels, cfg.data.image_size)
    return profile.forward_flops_per_sample / 1e9


def prepare_job(cfg: TrainConfig, tags: dict, rank0: bool):
    """What the job needs checked and prepared before a run: the allocator, the checkpoint it
    resumes from, the strategy's plan, the data (written if synthetic) and, on rank 0, the store
    and the run to resume. Returns (the saved run or None, plan, datamodule)."""
    saved = None
    # "auto" becomes what this process runs, in the recorded config and the ranks' job description.
    requested = cfg.cpu_allocator
    cfg.cpu_allocator = resolve_allocator(cfg.cpu_allocator)
    if rank0:
        log.info(explain_allocator(requested, cfg.cpu_allocator))
    check_accelerator(cfg)
    check_allocator(cfg.cpu_allocator)
    meta = layered_model_meta(cfg)
    plan = build_strategy(cfg.strategy, cfg.trainer.accelerator, meta, cfg.data)
    settle_cluster_environment(plan.trainer_kwargs, cfg.strategy.name)
    for key, why in plan.refused_trainer_args.items():
        if getattr(cfg.trainer, key, None) is not None:
            raise ConfigError(f"trainer.{key}={getattr(cfg.trainer, key)} with strategy={cfg.strategy.name}: {why}, "
                              f"or trainer.{key}=null")
    on_cpu = plan.trainer_kwargs.get("accelerator", cfg.trainer.accelerator) == "cpu" or not torch.cuda.is_available()
    if problem := precision_problem(cfg, plan.refused_precisions, on_cpu, torch.cuda.is_available()):  # (the plan tells where)
        raise ConfigError(problem)
    per_worker = cfg.data.batch_per == "worker"
    if per_worker:
        plan = batch_of_workers(cfg, plan, meta, rank0)
    if cfg.ckpt_path:
        saved = read_saved_run(cfg.ckpt_path)
        cut = saved.epoch_left_out(cfg.trainer)
        if cut:
            raise ConfigError(cut)
        tags["resume_changes"] = " ".join(f"{k}={v}" for k, v in check_resumable(
            saved, flatten_config(asdict(cfg)), flatten_config, option_params, task_override_keys()).items()) or None
        if problem := saved.layout_changed(plan.tags):  # (after the config's: another strategy is said as such)
            raise ConfigError(problem)
        tags["resumed_from"] = str(saved.path)
    datamodule = build_datamodule(cfg.data, plan.data_parallel, per_worker)
    if cfg.memory_check:
        check_memory(cfg, plan.data_parallel, plan.replicas_per_machine, plan.recompute)
    datamodule.prepare_data()
    datamodule.build_sets()  # its errors now; the images are kept in memory (data.cache) once the ranks run
    check_single_sample_batches(cfg, meta, plan.data_parallel, len(datamodule.train_set), per_worker)
    batches = [process_batches(len(images), plan.data_parallel, datamodule.batch_size)
               for images in (datamodule.train_set, datamodule.val_set)]
    if problems := trainer_batch_problems(cfg.trainer, *batches):  # Lightning's, at the first step
        raise ConfigError("; ".join(problems))
    if rank0 and on_cpu:
        note_busy_cores(tags)
    if rank0:
        if saved is not None and saved.run_id and not store_exists(cfg.logger.tracking_uri):  # not made to refuse
            raise run_not_held(saved.run_id, cfg.logger.tracking_uri, saved.tracking_uri)
        client = prepare_store(cfg.logger.tracking_uri, cfg.logger.experiment_name, cfg.logger.artifact_location)
        close_vanished_runs(client, [client.get_experiment_by_name(cfg.logger.experiment_name).experiment_id])
        if saved is not None and saved.run_id:
            check_resumable_run(client, saved.run_id, cfg.logger.tracking_uri, cfg.logger.experiment_name,
                                saved.tracking_uri, saved.nothing_left(cfg.trainer))
    return saved, plan, datamodule


def note_busy_cores(tags: dict) -> None:
    """Say so, and tag the run ``busy_cores``, when other processes keep this run's cores busy
    as it starts: its times are then of a shared machine (a neighbour slows pinned ranks, threads
    and one core differently: docs/strategies.md), not comparable with a quiet sitting's."""
    busy = busy_cores()
    if busy:
        tags["busy_cores"] = " ".join(f"{core}:{use:.0f}%" for core, use in busy.items())
        log.warning("core(s) %s busy with other processes as this run starts: it shares them, and its times are "
                    "not this machine's alone (tagged busy_cores)", ", ".join(f"{c} ({u:.0f}%)" for c, u in busy.items()))


def batch_of_workers(cfg: TrainConfig, plan, meta, rank0: bool):
    """``data.batch_per=worker``: ``data.batch_size`` is each data-parallel process's batch (a
    pipeline's), as the papers state theirs (Jansen's thesis Table 3.3). It becomes the global batch
    here, in the config, the recorded params and the ranks' job description, so a run's
    workload reads the same however its batch was stated; the plan is made again with it."""
    per_worker = cfg.data.batch_size
    cfg.data.batch_size = per_worker * plan.data_parallel
    cfg.data.batch_per = "global"
    if rank0:
        log.info("data.batch_per=worker: %d per process x %d process(es) = global batch %d (data.batch_size=%d)",
                 per_worker, plan.data_parallel, cfg.data.batch_size, cfg.data.batch_size)
    return build_strategy(cfg.strategy, cfg.trainer.accelerator, meta, cfg.data)


def layered_model_meta(cfg: TrainConfig):
    """The model on PyTorch's meta device: its layer count and cut points, at no cost."""
    with torch.device("meta"):
        return build_model(cfg.model.name, cfg.data.num_classes, cfg.data.channels, cfg.data.image_size, cfg.model.dropout)
