"""The config tree's schema: Hydra structured configs registered in the ConfigStore.

A wrong type or an unknown key fails when Hydra composes the config; each knob's range or
choices are declared here beside its type and checked by :func:`ddlx.config_check.check_config`
right after composing, before torch, Lightning or MLflow are imported. The options of the
``strategy`` group are the strategies' own config dataclasses (no YAML), each in its file in
:mod:`ddlx.strategies`: its knobs, defaults and ranges in one place. Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .allocator import AUTO
from .allocator import CHOICES as ALLOCATORS
from .job import BATCH_PER, CACHE_CHOICES, MIN_IMAGE_SIZE
from .compiling import COMPILE_MODES, MEMORY_FORMATS, OPTIMIZER_IMPLEMENTATIONS
from .knobs import MISSING, knob
from .strategies import STRATEGIES

# ---- the train config ------------------------------------------------------------------------


MAX_SEED = 2**32 - 1  # numpy's seeds, which Lightning's seed_everything also takes


@dataclass
class ModelConfig:
    name: str = MISSING  # built by ddlx.models.build_model
    dropout: Optional[float] = knob(None, low=0, high=1, high_open=True)  # null: the architecture's own
    # How the weights and activations lie in memory: contiguous (NCHW) or channels_last (NHWC)
    memory_format: str = knob("contiguous", choices=MEMORY_FORMATS)


@dataclass
class DataConfig:
    """The keys of :class:`ddlx.data.image_data.ImageFolderData` (train.py's datamodule is built from them)."""

    # null (data=imagefolder): read from the folder at root (ddlx.data.folder)
    name: Optional[str] = None
    root: Optional[str] = None
    num_images: Optional[int] = knob(None, low=1)  # null: every image
    classes: Optional[List[str]] = None
    num_classes: Optional[int] = knob(None, low=2)
    channels: Optional[int] = knob(None, choices=(1, 3))
    image_size: int = knob(low=MIN_IMAGE_SIZE)
    batch_size: int = knob(low=1)  # the global batch; with batch_per=worker, each data-parallel process's
    batch_per: str = knob("global", choices=BATCH_PER)
    num_workers: int = knob(0, low=0)  # loader processes, persistent; they read the next epoch ahead (ddlx.data.spanning)
    val_fraction: float = knob(0.2, low=0, high=1, high_open=True)
    mean: Optional[List[float]] = None
    std: Optional[List[float]] = None
    synthetic_dir: str = MISSING
    synthetic_size: List[int] = MISSING
    synthetic_format: str = knob("jpg", choices=("jpg", "png"))
    seed: int = knob(0, low=0, high=MAX_SEED)
    pin_memory: bool = False
    shuffle: bool = True
    random_flip: bool = True
    cache: str = knob("auto", choices=CACHE_CHOICES)  # auto: decoded images kept in memory when they fit (ddlx.data.cache)


@dataclass
class LoggerConfig:
    tracking_uri: str = MISSING
    experiment_name: str = MISSING
    run_name: Optional[str] = None  # null: what the run trains (ddlx.records.run_name)
    artifact_location: Optional[str] = None
    tags: Dict[str, str] = field(default_factory=dict)


# Trainer arguments ddlx sets itself, and how a user chooses each instead.
TRAINER_ARGS_SET_BY_DDLX = {
    "strategy": "choose the strategy with strategy=NAME",
    "devices": "it follows the strategy's knobs (strategy.processes, strategy.devices)",
    "num_nodes": "strategy=mpi reads it from the launcher (mpirun, SLURM)",
    "logger": "set logger.tracking_uri and logger.experiment_name",
    "callbacks": "ddlx adds its timing, resource, checkpoint and stop-signal callbacks",
    "plugins": "ddlx adds its checkpoint writer",
    "default_root_dir": "the run's output folder is hydra.run.dir",
    "use_distributed_sampler": "ddlx's datamodule shards the data alike for every strategy",
    "enable_checkpointing": "use checkpoint.save=full|weights|none",
    "ckpt_path": "use the top-level ckpt_path=PATH, which resumes a run",
}


# Lightning's accelerator names and precision values (its Trainer's precision Literal), but
# Transformer Engine's: ddlx has never trained under it, and neither records nor predicts its numerics.
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")  # ddlx's strategies run on CPUs and CUDA GPUs (not mps, tpu, xla)
PRECISIONS = ("64", "32", "16", "bf16", "64-true", "32-true", "16-true", "16-mixed", "bf16-true", "bf16-mixed")


@dataclass
class TrainerConfig:
    """``pytorch_lightning.Trainer``'s arguments, with Lightning's defaults, but those in
    :data:`TRAINER_ARGS_SET_BY_DDLX`. Only the values that differ from these defaults are passed
    on, so an argument another Lightning release lacks is named only when it is set.
    ``tests/test_config.py`` holds this list against ``Trainer.__init__``'s signature."""

    accelerator: str = knob("auto", choices=ACCELERATORS)
    precision: Optional[str] = knob(None, choices=PRECISIONS)
    fast_dev_run: Any = False
    max_epochs: Optional[int] = knob(None, low=-1)
    min_epochs: Optional[int] = knob(None, low=0)
    max_steps: int = knob(-1, low=-1)
    min_steps: Optional[int] = knob(None, low=0)
    max_time: Any = None
    limit_train_batches: Any = knob(None, low=0)
    limit_val_batches: Any = knob(None, low=0)
    limit_test_batches: Any = knob(None, low=0)
    limit_predict_batches: Any = knob(None, low=0)
    overfit_batches: Any = knob(0.0, low=0)
    val_check_interval: Any = knob(None, low=0, low_open=True)
    check_val_every_n_epoch: Optional[int] = knob(1, low=1)
    num_sanity_val_steps: Optional[int] = knob(None, low=-1)
    log_every_n_steps: Optional[int] = knob(None, low=1)
    enable_progress_bar: Optional[bool] = None
    enable_model_summary: Optional[bool] = None
    accumulate_grad_batches: int = knob(1, low=1)
    gradient_clip_val: Optional[float] = knob(None, low=0)
    gradient_clip_algorithm: Optional[str] = knob(None, choices=("norm", "value"))
    deterministic: Any = None
    benchmark: Optional[bool] = None
    inference_mode: bool = True
    profiler: Optional[str] = knob(None, choices=("simple", "advanced", "pytorch"))  # not xla: see ACCELERATORS
    detect_anomaly: bool = False
    barebones: bool = False
    sync_batchnorm: bool = False
    reload_dataloaders_every_n_epochs: int = knob(0, low=0)
    enable_autolog_hparams: bool = True
    model_registry: Optional[str] = None


@dataclass
class PathsConfig:
    root: str = MISSING  # the folder that holds train.py
    data_dir: str = MISSING


@dataclass
class OptimConfig:
    """SGD with momentum (conf/optim/sgd.yaml; Lerat et al. 2022, section 3.2, used lr 0.001)."""

    lr: float = knob(0.005, low=0, low_open=True)  # docs/configuration.md says why
    momentum: float = knob(0.9, low=0, high=1, high_open=True)
    weight_decay: float = knob(0.0, low=0)
    # The step's implementation (torch.optim.SGD's foreach/fused): auto is torch's own choice
    implementation: str = knob("auto", choices=OPTIMIZER_IMPLEMENTATIONS)


@dataclass
class CompileConfig:
    """torch.compile on the model (or each layer, where the strategy shards or stages it by layers)."""

    enable: bool = False
    mode: str = knob("default", choices=COMPILE_MODES)


@dataclass
class MeasureConfig:
    """How every run is measured (ddlx.measure): the same for all strategies."""

    warmup_epochs: int = knob(0, low=0)  # epochs left out of mean_epoch_time_s (the thesis: 1 warm-up, mean of 3)
    monitor: bool = True  # sample CPU %, RAM, threads of the whole process tree
    monitor_interval_s: float = knob(1.0, low=0, low_open=True)


@dataclass
class CheckpointConfig:
    """What a run keeps in its output folder's ``checkpoints/``: one file, ``last.ckpt``, rewritten
    at every epoch end (after its validation), every ``every_minutes`` within an epoch when set,
    and when a stop signal arrives (each write lands whole or not at all)."""

    save: str = knob("full", choices=("full", "weights", "none"))  # full: resumable (weights, optimizer, loops); weights: the model only
    keep_best: bool = False  # also keep the checkpoint with the best val_acc
    every_minutes: Optional[float] = knob(None, low=0, low_open=True)  # null: at epoch ends only
    background: bool = True  # written by a thread from a copy in host memory: training goes on meanwhile


@dataclass
class TrainConfig:
    seed: int = knob(42, low=0, high=MAX_SEED)
    ckpt_path: Optional[str] = None  # resume from this checkpoint, into the MLflow run it belongs to
    paths: PathsConfig = field(default_factory=PathsConfig)
    optim: OptimConfig = MISSING
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    memory_check: bool = True  # refuse a model/data/batch that cannot fit before training starts
    cpu_allocator: str = knob(AUTO, choices=(AUTO, *ALLOCATORS))
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    strategy: Any = MISSING  # one of the strategies' config dataclasses
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING


# ---- the recommend config (conf/recommend.yaml) ---------------------------------------------


@dataclass
class RecommendTrainerConfig:
    """The job's ``trainer`` values the answer depends on."""

    precision: Optional[str] = knob(None, choices=PRECISIONS)  # null: fp32
    max_epochs: Optional[int] = knob(None, low=1)  # the run's epochs: whether compiling pays for it (null: not said)


@dataclass
class RecommendConfig:
    """``recommend.py``'s config as :func:`ddlx.predict.cli.run` reads it (its keys are explained in
    conf/recommend.yaml); ``hw`` apart, typed as a :class:`~ddlx.costmodel.hardware.HardwareSpec`."""

    mode: str = "recommend"
    output: str = "table"
    log: bool = True
    probe: bool = True
    seed: int = knob(42, low=0, high=MAX_SEED)
    probe_max_s: float = knob(30.0, low=0, low_open=True)
    compare: Optional[List[str]] = None
    max_epoch_s: Optional[float] = None
    close_call: float = 0.05
    candidates: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    strategies: List[str] = field(default_factory=list)
    experiments: List[str] = field(default_factory=lambda: ["ddlx"])
    trainer: RecommendTrainerConfig = field(default_factory=RecommendTrainerConfig)
    cpu_allocator: str = knob(AUTO, choices=(AUTO, *ALLOCATORS))
    detected_dir: Optional[str] = None
    paths: PathsConfig = field(default_factory=PathsConfig)
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    logger: LoggerConfig = MISSING


# The strategies' knobs: each strategy's own dataclass, in its file (ddlx/strategies/<name>.py).
STRATEGY_CONFIGS: dict[str, type] = {name: spec.config for name, spec in STRATEGIES.items()}


def register_schemas() -> None:
    """Put the schemas in Hydra's ConfigStore: ``train_schema`` (train.yaml's first default),
    ``<group>_schema`` (each YAML option's first default) and the strategy options (their specs'
    configs). Not in groups of their own: ``--help`` lists every group as options to choose."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for group, node in (("model", ModelConfig), ("data", DataConfig), ("optim", OptimConfig), ("trainer", TrainerConfig),
                        ("logger", LoggerConfig)):
        store.store(name=f"{group}_schema", node=node)
    for name, node in STRATEGY_CONFIGS.items():
        store.store(group="strategy", name=name, node=node)
