"""Shared test helpers: compose the real config tree with tiny-data overrides."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ddlx.entry import register_recommend_config

PROJECT_DIR = Path(__file__).resolve().parents[1]
CONF_DIR = PROJECT_DIR / "conf"
register_recommend_config(PROJECT_DIR)  # train.py's schemas and recommend.py's hw schema

# Tiny images, a few dozen samples, 1-2 steps: keeps the default run fast on 2 cores.
TINY = [
    "data.image_size=32",
    "data.synthetic_size=[40,64]",
    "data.num_images=48",
    "data.batch_size=8",
    "data.num_workers=0",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "checkpoint.save=none",
]


def pytest_sessionstart(session) -> None:
    """Fork ddlx's rank server from this process now, after the training imports and before any
    test computes, as train.py forks its own: the extra ranks of a training job run in this process
    are then forked from it, sharing those imports, instead of each starting a new interpreter that
    imports torch, Lightning and MLflow again (about 10 s a rank on 2 cores). The tests that start
    ranks as new interpreters (a sweep's later job, ranks_as_new_interpreters) set it aside."""
    from ddlx import rank_worker, run  # noqa: F401 - the imports the forked ranks share
    from ddlx.parallel import rank_fork

    rank_fork.start_fork_server(needed=True, entry=rank_worker.main)


@pytest.fixture
def ranks_as_new_interpreters(monkeypatch) -> None:
    """The extra ranks of this test's in-process jobs start as ``python -m ddlx.rank_worker``, as a
    sweep's later jobs do when its first job started none (no rank server)."""
    from ddlx.parallel import rank_fork

    monkeypatch.setattr(rank_fork, "_server", None)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """One synthetic-data folder for the whole session: each dataset is written once."""
    return tmp_path_factory.mktemp("data")


_MADE_STORE: list[Path] = []  # the session's store with its schema made (made_store)


@pytest.fixture(scope="session", autouse=True)
def made_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store whose schema MLflow has made: its first contact, about a second, paid
    once per session, not per test (:func:`with_made_store`). The tests of a new store's first
    contact (tests/test_tracking.py) make theirs elsewhere."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("made-store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    _MADE_STORE[:] = [path]
    return path


def with_made_store(folder: Path) -> str:
    """The tracking URI of ``folder``'s mlflow.db, a copy of the session's made store if it had none."""
    store = folder / "mlflow.db"
    if not store.exists():
        shutil.copyfile(_MADE_STORE[0], store)
    return f"sqlite:///{store}"


@pytest.fixture
def tracking_uri(tmp_path) -> str:
    return with_made_store(tmp_path)


def compose_config(overrides: list[str]) -> DictConfig:
    """The train config, for jobs run in the pytest process: on glibc's own allocator, not the default
    auto (keep_freed), which no later job in the process could leave and whose environment every later
    subprocess test would inherit. train.py in a subprocess (run_train_py) keeps the default."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=["cpu_allocator=system", *overrides])


@pytest.fixture
def tiny_config(data_dir, tracking_uri, tmp_path):
    """``tiny_config(*overrides)``: the real config tree, tiny data, a private MLflow store."""

    def make(*overrides: str) -> DictConfig:
        base = [f"paths.root={tmp_path}", f"paths.data_dir={data_dir}", f"logger.tracking_uri={tracking_uri}"]
        return compose_config(base + TINY + list(overrides))

    return make


def runs(tracking_uri: str, experiment: str = "ddlx"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


@pytest.fixture(autouse=True)
def _quiet_mlflow(monkeypatch):
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    monkeypatch.setenv("GIT_PYTHON_REFRESH", "quiet")
    yield


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PROJECT_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def signalled(folder: Path, point: str, signal_name: str, *args: str, env: dict | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """tests/train_signalled.py: train.py (or ``--script recommend.py``) with ``signal_name`` sent
    to its process group at ``point``, run in ``folder`` (its store a made copy) in a process
    group of its own, so the signal reaches no process of the tests."""
    with_made_store(folder)
    return subprocess.run([sys.executable, str(PROJECT_DIR / "tests" / "train_signalled.py"), point, signal_name, *args],
                          capture_output=True, text=True, timeout=timeout, env=subprocess_env() | (env or {}),
                          cwd=folder, start_new_session=True)


def rank_workers(pid: int) -> list:
    """The extra ranks of the job whose rank 0 is ``pid``: forked by train.py's server
    (ddlx.parallel.rank_fork, named ``ddlx-rank-N``) or started as ``python -m ddlx.rank_worker``."""
    import psutil

    def is_rank(child) -> bool:
        try:
            return child.name().startswith("ddlx-rank") or "ddlx.rank_worker" in " ".join(child.cmdline())
        except psutil.Error:  # it ended since the listing (a loader worker): not a rank to find
            return False

    try:
        return [c for c in psutil.Process(pid).children(recursive=True) if is_rank(c)]
    except psutil.Error:  # ``pid`` itself ended
        return []


def alive(processes) -> list:
    """Those of ``processes`` (psutil's) still running: neither ended nor a zombie."""
    import psutil

    def running(process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [p for p in processes if running(p)]


def as_a_shell_reads(command: str, cwd: Path | None = None) -> list[str]:
    """The words a pasted ``command`` gives the program, as bash reads them with failglob, which
    (like zsh's default) refuses a glob that matches nothing instead of passing it on."""
    import subprocess

    proc = subprocess.run(["bash", "-O", "failglob", "-c", f'printf "%s\\0" {command}'], capture_output=True, text=True,
                          cwd=cwd, timeout=30)
    assert proc.returncode == 0, f"a shell refuses {command!r}: {proc.stderr}"
    return proc.stdout.split("\0")[:-1]
