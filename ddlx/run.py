"""One training run from a composed config: check everything, build, fit, log to MLflow.

Called by ``train.py``; takes an OmegaConf config but not Hydra, so tests can call it directly.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
import psutil
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint

from .allocator import apply_allocator, check_allocator, resolve_allocator
from .data import ImageFolderDataModule
from .errors import ConfigError
from .measure.resources import ResourceMonitor
from .measure.timing import EpochTimer
from .models import build_model
from .module import ClassifierModule
from .predict.memory import GIB, estimate_training_memory
from .strategies import build_strategy
from .strategies.launch import RelaunchingDDPStrategy, end_distributed_job, launch_rank
from .tracking import (
    check_experiment,
    check_tracking_uri,
    flatten_config,
    machine_tags,
    make_logger,
    record_failure,
    record_rejected_run,
    start_run,
    use_case,
)

log = logging.getLogger(__name__)

# Headroom left for the interpreter, loader workers and allocator slack.
MEMORY_HEADROOM = 0.85


def build_datamodule(data_cfg: DictConfig, data_parallel: int = 1) -> ImageFolderDataModule:
    """The datamodule for one process: ``data.batch_size`` is the global batch, split evenly."""
    kwargs = OmegaConf.to_container(data_cfg, resolve=True)
    if kwargs["batch_size"] % data_parallel:
        raise ConfigError(
            f"data.batch_size={kwargs['batch_size']} is the global batch and must split evenly over the "
            f"{data_parallel} processes of this strategy; use a multiple of {data_parallel}"
        )
    kwargs["batch_size"] //= data_parallel
    return ImageFolderDataModule(**kwargs)


def available_memory_bytes(accelerator: str) -> tuple[int, str]:
    if accelerator in ("gpu", "cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return free, "free memory on cuda:0"
    return psutil.virtual_memory().available, "available RAM"


def check_memory(cfg: DictConfig, data_parallel: int = 1, replicas: int = 1) -> None:
    """Refuse a model/data/batch that cannot fit, before any training starts.

    Each of ``replicas`` model copies on this machine trains ``batch_size / data_parallel`` samples.
    """
    data = cfg.data
    estimate, per_sample = estimate_training_memory(
        cfg.model.name, data.num_classes, data.channels, data.image_size, max(1, data.batch_size // data_parallel)
    )
    need = estimate.total_bytes * replicas
    have, what = available_memory_bytes(cfg.trainer.accelerator)
    if need > MEMORY_HEADROOM * have:
        fixed = (estimate.total_bytes - estimate.activations_bytes) * replicas
        max_batch = int((MEMORY_HEADROOM * have - fixed) / (per_sample * replicas)) * data_parallel
        fix = f"lower data.batch_size to {max_batch} or less" if max_batch >= 1 else "use a smaller model or data.image_size"
        raise ConfigError(
            f"model={cfg.model.name} on data={data.name} (image_size={data.image_size}, batch_size={data.batch_size}"
            f"{f', {replicas} replicas' if replicas > 1 else ''}) needs about {need / GIB:.1f} GiB to train, "
            f"but only {have / GIB:.1f} GiB of {what} is there: {fix} "
            f"(or set memory_check=false to try anyway)"
        )


def check_measure(cfg: DictConfig) -> None:
    m, epochs = cfg.measure, cfg.trainer.max_epochs
    if m.warmup_epochs < 0 or (epochs not in (None, -1) and m.warmup_epochs >= epochs):
        raise ConfigError(
            f"measure.warmup_epochs={m.warmup_epochs} with trainer.max_epochs={epochs} leaves no epoch to measure; "
            f"use 0 <= warmup_epochs < max_epochs (e.g. trainer.max_epochs={max(1, m.warmup_epochs) + 3} "
            f"measure.warmup_epochs={max(0, m.warmup_epochs)} for the thesis' mean of 3)"
        )
    if m.monitor and m.monitor_interval_s <= 0:
        raise ConfigError(f"measure.monitor_interval_s={m.monitor_interval_s}: must be > 0 seconds (default 1.0)")


def run_tags(cfg: DictConfig, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Tags every run carries, known before anything is built."""
    return {
        "model": cfg.model.name,
        "data": cfg.data.name,
        "strategy": cfg.strategy.name,
        "use_case": use_case(cfg.model.name, cfg.data.name),
        **machine_tags(),
        **(extra or {}),
        **(cfg.logger.tags or {}),
    }


def measurement_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    callbacks: list[pl.Callback] = [EpochTimer(cfg.measure.warmup_epochs)]
    if cfg.measure.monitor:
        callbacks.append(ResourceMonitor(cfg.measure.monitor_interval_s))
    return callbacks


def build_trainer(cfg: DictConfig, plan, logger, output_dir: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    if cfg.trainer.get("enable_checkpointing", True):
        callbacks = [*callbacks, ModelCheckpoint(dirpath=output_dir / "checkpoints")]
    return pl.Trainer(
        **{**OmegaConf.to_container(cfg.trainer, resolve=True), **plan.trainer_kwargs},
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        default_root_dir=str(output_dir),
        use_distributed_sampler=False,  # the datamodule shards (see ImageFolderDataModule._loader)
    )


def train(cfg: DictConfig, output_dir: str | os.PathLike, extra_tags: Mapping[str, str] | None = None) -> dict[str, float]:
    """Train once as ``cfg`` says and return the final logged metrics (on every rank).

    ``extra_tags`` go on the MLflow run; with a ``sweep_id`` among them (a job of a sweep), a job
    refused before training is still recorded as a FAILED run with the reason.
    """
    output_dir = Path(output_dir)
    pl.seed_everything(cfg.seed, workers=True)
    tags = run_tags(cfg, extra_tags)
    resolved = OmegaConf.to_container(cfg, resolve=True)

    # 1. Everything that can be wrong is checked before the first batch.
    check_tracking_uri(cfg.logger.tracking_uri)
    if launch_rank() == 0:  # only rank 0 talks to MLflow (see 3.)
        check_experiment(cfg.logger.tracking_uri, cfg.logger.experiment_name)
    try:
        # "auto" becomes what this process runs, in the recorded config and the ranks' job description.
        cfg.cpu_allocator = resolved["cpu_allocator"] = resolve_allocator(cfg.cpu_allocator)
        check_measure(cfg)
        check_allocator(cfg.cpu_allocator)
        plan = build_strategy(cfg.strategy, cfg.trainer.accelerator, layered_model_meta(cfg), cfg.data)
        datamodule = build_datamodule(cfg.data, plan.data_parallel)
        if cfg.memory_check:
            check_memory(cfg, plan.data_parallel, plan.replicas_per_machine)
        datamodule.prepare_data()
        datamodule.setup("fit")
    except ConfigError as err:
        if "sweep_id" in tags and launch_rank() == 0:
            logger = make_logger(
                cfg.logger.tracking_uri, cfg.logger.experiment_name, cfg.logger.run_name, tags, cfg.logger.artifact_location
            )
            record_rejected_run(logger, flatten_config(resolved), err)
        raise

    apply_allocator(cfg.cpu_allocator)  # before the model and the ranks (they inherit it)

    # 2. The resolved config: an MLflow artifact, and the job description the other ranks start from.
    config_file = output_dir / "config_resolved.yaml"
    if launch_rank() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        config_file.write_text(OmegaConf.to_yaml(resolved))
    strategy = plan.trainer_kwargs.get("strategy")
    if isinstance(strategy, RelaunchingDDPStrategy):
        strategy.worker_args = [str(config_file), str(output_dir)]

    # 3. Build.
    model = build_model(cfg.model.name, cfg.data.num_classes, cfg.data.channels, cfg.data.image_size, cfg.model.dropout)
    module = ClassifierModule(model, cfg.data.num_classes, **cfg.optim)
    accelerator = str(plan.trainer_kwargs.get("accelerator", cfg.trainer.accelerator))
    tags.update({
        "synthetic_data": str(datamodule.is_synthetic),
        "accelerator": "gpu" if accelerator in ("gpu", "cuda") else accelerator,  # the report's device kind
        **plan.tags,
    })
    # Only global rank 0 talks to MLflow: its client creates the store's tables on first
    # contact, and ranks doing that at once corrupt an SQLite store.
    logger = None
    if launch_rank() == 0:
        logger = make_logger(
            cfg.logger.tracking_uri, cfg.logger.experiment_name, cfg.logger.run_name, tags, cfg.logger.artifact_location
        )
        run_id = start_run(logger, flatten_config(resolved), config_file, {"output_dir": str(output_dir)})
        log.info("MLflow run %s in experiment %r at %s", run_id, cfg.logger.experiment_name, cfg.logger.tracking_uri)
    trainer = build_trainer(cfg, plan, logger, output_dir, measurement_callbacks(cfg))

    # 4. Train.
    try:
        trainer.fit(module, datamodule=datamodule)
    except BaseException as err:
        if logger is not None:
            record_failure(logger, err)
        raise
    finally:
        end_distributed_job(trainer.strategy)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def layered_model_meta(cfg: DictConfig):
    """The model on PyTorch's meta device: its layer count and cut points, at no cost."""
    with torch.device("meta"):
        return build_model(cfg.model.name, cfg.data.num_classes, cfg.data.channels, cfg.data.image_size, cfg.model.dropout)
