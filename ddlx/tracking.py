"""MLflow: check the tracking store before training, create the run's logger, record the config."""
from __future__ import annotations

import os
import platform
import socket
import sqlite3
import urllib.error
import urllib.request
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, StoreError

if TYPE_CHECKING:  # Lightning is imported where a logger is made, not by every tracking check
    from pytorch_lightning.loggers import MLFlowLogger

# The paper's two use cases (source 000, section 3.1).
USE_CASES = {("vgg16", "firesmall"): "complexsmall", ("alexnet", "firebig"): "simplebig"}
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a parameter value


def use_case(model: str, data: str) -> str | None:
    return USE_CASES.get((model, data))


def machine_tags() -> dict[str, str]:
    """Where a run was measured: the report compares runs of one host only."""
    import torch

    tags = {"host": socket.gethostname(), "cpu_cores": str(len(os.sched_getaffinity(0))), "cpu_model": cpu_model()}
    if torch.cuda.is_available():
        tags["gpus"] = str(torch.cuda.device_count())
        tags["gpu_name"] = torch.cuda.get_device_name(0)
    return tags


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def check_tracking_uri(uri: str, timeout_s: float = 5.0) -> None:
    """Fail at start, not after training, when runs could not be recorded."""
    if uri.startswith(("http://", "https://")):
        health = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=timeout_s) as response:
                if response.status != 200:
                    raise OSError(f"HTTP {response.status}")
        except (OSError, urllib.error.URLError) as err:
            raise StoreError(
                f"MLflow tracking server logger.tracking_uri={uri} is unreachable ({err}); start it "
                f"(mlflow server --host ... --port ...) or log locally with logger.tracking_uri=sqlite:///mlflow.db"
            ) from err
    elif uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        folder = path.parent if path.parent != Path("") else Path(".")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise StoreError(
                f"logger.tracking_uri={uri}: folder {folder} does not exist or is not writable; "
                f"create it or choose another path"
            )
        if path.exists():
            try:
                with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                    db.execute("pragma schema_version")  # reads the header: fails on a non-database
            except sqlite3.DatabaseError as err:
                raise StoreError(f"logger.tracking_uri={uri}: {path} is not an SQLite database ({err})") from err


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"data": {"batch_size": 32}}`` -> ``{"data.batch_size": "32"}``: the names users override."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, prefix=f"{name}."))
        else:
            flat[name] = str(value)[:MAX_PARAM_LENGTH]
    return flat


def make_logger(
    tracking_uri: str,
    experiment_name: str,
    run_name: str,
    tags: Mapping[str, str],
    artifact_location: str | None,
) -> MLFlowLogger:
    from pytorch_lightning.loggers import MLFlowLogger

    return MLFlowLogger(
        experiment_name=experiment_name,
        run_name=run_name,
        tracking_uri=tracking_uri,
        tags={k: str(v) for k, v in tags.items() if v is not None},
        artifact_location=artifact_location if is_local_store(tracking_uri) else None,
    )


def is_local_store(tracking_uri: str) -> bool:
    """A server chooses its own artifact store; a local artifact path only makes sense for a local store."""
    return not tracking_uri.startswith(("http://", "https://", "databricks"))


def artifacts_beside_store(tracking_uri: str) -> str | None:
    """An SQLite store's artifact folder: ``mlruns`` beside the database file, where train.py's
    runs keep theirs (``${paths.root}/mlruns``); None for other stores, which choose their own."""
    if tracking_uri.startswith("sqlite:///"):
        return str(Path(tracking_uri[len("sqlite:///"):]).resolve().parent / "mlruns")
    return None


def experiment_id(client, name: str, tracking_uri: str, artifact_location: str | None,
                  setting: str | None = "logger.experiment_name") -> str:
    """``name``'s experiment id, created if missing with its artifacts at ``artifact_location`` on a
    local store: MLflow's default is ./mlruns of whichever folder the command ran in. ``setting``
    is the option that chooses the name (None: fixed), for the error on a deleted experiment."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        _refuse_deleted(exp, tracking_uri, setting)
        return exp.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location if is_local_store(tracking_uri) else None)


def check_experiment(tracking_uri: str, name: str) -> None:
    """Fail at start when ``name`` is a deleted experiment of the store: MLflow keeps its name
    taken, and Lightning's logger would try to create it again after the checks, failing with an
    IntegrityError from deep inside the store."""
    from mlflow.tracking import MlflowClient

    from .measure.report import store_exists

    if not store_exists(tracking_uri):
        return  # a new store has no experiments; opening it here would create it

    exp = MlflowClient(tracking_uri).get_experiment_by_name(name)
    if exp is not None:
        _refuse_deleted(exp, tracking_uri, "logger.experiment_name")


def _refuse_deleted(exp, tracking_uri: str, setting: str | None) -> None:
    if exp.lifecycle_stage == "deleted":
        rename = f", or choose another {setting}" if setting else ""
        raise StoreError(
            f"MLflow experiment {exp.name!r} was deleted from {tracking_uri}, and a deleted experiment keeps its "
            f"name; restore it (MLFLOW_TRACKING_URI={tracking_uri} mlflow experiments restore --experiment-id "
            f"{exp.experiment_id}) or purge it for good (mlflow gc --backend-store-uri {tracking_uri} --experiment-ids "
            f"{exp.experiment_id}){rename}"
        )


def start_run(logger: MLFlowLogger, params: Mapping[str, str], config_file: Path, tags: Mapping[str, str]) -> str:
    """Create the run now, from global rank 0, with its params, tags and config artifact, so a
    job that fails at any later point is still one (FAILED) run with its record."""
    run_id = logger.run_id
    logger.log_hyperparams(params)
    logger.experiment.log_artifact(run_id, str(config_file))
    for key, value in tags.items():
        logger.experiment.set_tag(run_id, key, value)
    return run_id


def record_rejected_run(
    logger: MLFlowLogger, params: Mapping[str, str], error: BaseException
) -> str:
    """A job of a sweep refused before training (bad config, does not fit): still one run, FAILED,
    with its config and the reason, so the sweep's record has every job."""
    logger.log_hyperparams(params)
    record_failure(logger, error)
    return logger.run_id


def record_failure(logger: MLFlowLogger, error: BaseException) -> None:
    """Tag the run with the error; Lightning marks it FAILED when it sees the exception."""
    if logger._run_id is not None:
        logger.experiment.set_tag(logger.run_id, "error", f"{type(error).__name__}: {error}"[:5000])
        logger.experiment.set_terminated(logger.run_id, "FAILED")
