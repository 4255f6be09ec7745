"""One training run from a composed config: check everything, build, fit, log to MLflow.

Called by ``train.py``; takes an OmegaConf config but not Hydra, so tests can call it directly.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import psutil
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint

from .data import ImageFolderDataModule
from .errors import ConfigError
from .measure import EpochTimer
from .models import build_model
from .module import ClassifierModule
from .predict.memory import GIB, estimate_training_memory
from .strategies import build_strategy
from .tracking import check_tracking_uri, flatten_config, make_logger, use_case

log = logging.getLogger(__name__)

# Headroom left for the interpreter, loader workers and allocator slack.
MEMORY_HEADROOM = 0.85


def build_datamodule(data_cfg: DictConfig) -> ImageFolderDataModule:
    kwargs = OmegaConf.to_container(data_cfg, resolve=True)
    return ImageFolderDataModule(**kwargs)


def available_memory_bytes(accelerator: str) -> tuple[int, str]:
    if accelerator in ("gpu", "cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return free, "free memory on cuda:0"
    return psutil.virtual_memory().available, "available RAM"


def check_memory(cfg: DictConfig, replicas: int) -> None:
    """Refuse a model/data/batch that cannot fit, before any training starts."""
    data = cfg.data
    estimate, per_sample = estimate_training_memory(
        cfg.model.name, data.num_classes, data.channels, data.image_size, data.batch_size
    )
    need = estimate.total_bytes * replicas
    have, what = available_memory_bytes(cfg.trainer.accelerator)
    if need > MEMORY_HEADROOM * have:
        fixed = (estimate.total_bytes - estimate.activations_bytes) * replicas
        max_batch = int((MEMORY_HEADROOM * have - fixed) / (per_sample * replicas))
        fix = f"lower data.batch_size to {max_batch} or less" if max_batch >= 1 else "use a smaller model or data.image_size"
        raise ConfigError(
            f"model={cfg.model.name} on data={data.name} (image_size={data.image_size}, batch_size={data.batch_size}"
            f"{f', {replicas} replicas' if replicas > 1 else ''}) needs about {need / GIB:.1f} GiB to train, "
            f"but only {have / GIB:.1f} GiB of {what} is there: {fix} "
            f"(or set memory_check=false to try anyway)"
        )


def train(cfg: DictConfig, output_dir: str | os.PathLike) -> dict[str, float]:
    """Train once as ``cfg`` says and return the final logged metrics."""
    output_dir = Path(output_dir)
    pl.seed_everything(cfg.seed, workers=True)

    # 1. Everything that can be wrong is checked before the first batch.
    check_tracking_uri(cfg.logger.tracking_uri)
    plan = build_strategy(cfg.strategy, cfg.trainer.accelerator)
    datamodule = build_datamodule(cfg.data)
    if cfg.memory_check:
        check_memory(cfg, plan.replicas_per_machine)
    datamodule.prepare_data()
    datamodule.setup("fit")

    # 2. Build.
    model = build_model(cfg.model.name, cfg.data.num_classes, cfg.data.channels, cfg.data.image_size)
    module = ClassifierModule(model, cfg.data.num_classes, **cfg.optim)
    tags = {
        "model": cfg.model.name,
        "data": cfg.data.name,
        "use_case": use_case(cfg.model.name, cfg.data.name),
        "synthetic_data": str(datamodule.is_synthetic),
        **plan.tags,
        **(cfg.logger.tags or {}),
    }
    logger = make_logger(
        cfg.logger.tracking_uri, cfg.logger.experiment_name, cfg.logger.run_name, tags, cfg.logger.artifact_location
    )
    checkpoints = ModelCheckpoint(dirpath=output_dir / "checkpoints")
    trainer = pl.Trainer(
        **OmegaConf.to_container(cfg.trainer, resolve=True),
        **plan.trainer_kwargs,
        logger=logger,
        callbacks=[EpochTimer(), checkpoints],
        default_root_dir=str(output_dir),
    )

    # 3. Record the configuration with the run, then train.
    if trainer.is_global_zero:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        logger.log_hyperparams(flatten_config(resolved))
        config_file = output_dir / "config_resolved.yaml"
        output_dir.mkdir(parents=True, exist_ok=True)
        config_file.write_text(OmegaConf.to_yaml(resolved))
        logger.experiment.log_artifact(logger.run_id, str(config_file))
        logger.experiment.set_tag(logger.run_id, "output_dir", str(output_dir))
        log.info("MLflow run %s in experiment %r at %s", logger.run_id, cfg.logger.experiment_name, cfg.logger.tracking_uri)
    trainer.fit(module, datamodule=datamodule)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}
