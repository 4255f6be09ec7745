"""MLflow: check the tracking store before training, create the run's logger, record the config."""
from __future__ import annotations

import dataclasses
import difflib
import fcntl
import http.client
import logging
import os
import re
import shlex
import socket
import sqlite3
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, Stopped, StoreError
from .records import MeasuredRun, to_measured_run

if TYPE_CHECKING:  # Lightning is imported where a logger is made, not by every tracking check
    from pytorch_lightning.loggers import MLFlowLogger

    from .command_line import HowToResume

# The paper's two use cases (Lerat et al. 2022, section 3.1).
USE_CASES = {("vgg16", "firesmall"): "complexsmall", ("alexnet", "firebig"): "simplebig"}
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a parameter value

log = logging.getLogger(__name__)
# "Creating initial MLflow database tables..." and "Updating database tables" on a store's first
# contact: the only third-party lines of a first run or answer, which names its store itself. A
# filter, not a level: MLflow 2's logging set-up at its import resets its loggers' levels.
logging.getLogger("mlflow.store.db.utils").addFilter(lambda record: record.levelno >= logging.WARNING)


def use_case(model: str, data: str) -> str | None:
    return USE_CASES.get((model, data))


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of an SQLite store (``sqlite:///PATH``, SQLAlchemy's options after it, as in
    ``?timeout=30``, left out), None for other stores."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path, mark, options = tracking_uri[len("sqlite:///"):].partition("?")
    return Path(path if mark and SQLALCHEMY_OPTIONS.fullmatch(options) else path + mark + options)


SQLALCHEMY_OPTIONS = re.compile(r"[\w.]+=[^&/=]*(&[\w.]+=[^&/=]*)*")  # key=value&key=value


def store_exists(tracking_uri: str) -> bool:
    """False for an SQLite store whose file is not there (opening it would create an empty one)."""
    path = sqlite_path(tracking_uri)
    return path is None or path.is_file()


def store_writable(tracking_uri: str) -> bool:
    """False for an SQLite store this process can only read (its file or folder not writable, as
    a colleague's or a shared read-only results folder): reading it needs no lock, and nothing
    it holds can be changed. Other stores: True (a server says for itself)."""
    path = sqlite_path(tracking_uri)
    if path is None:
        return True
    return os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))


SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


# The schemes MLflow's tracking stores take (mlflow.tracking._tracking_service.utils registers them;
# a database's driver follows a +, as in postgresql+psycopg2), besides those of installed plugins.
STORE_SCHEMES = ("", "file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")


def _unknown_scheme(scheme: str, given: str, example: str) -> str | None:
    """Why a store URI's scheme is none MLflow has a store for (a typo such as sqllite:// failed
    in MLflow with a KeyError's traceback), or None."""
    from importlib.metadata import entry_points

    base = scheme.lower().partition("+")[0]
    if base in STORE_SCHEMES:
        return None
    known = (*STORE_SCHEMES, *(point.name for point in entry_points(group="mlflow.tracking_store")))
    if base in known:
        return None
    close = difflib.get_close_matches(base, [s for s in known if s], n=1)
    hint = f"did you mean {close[0]}://? " if close else ""
    return (f"{given}: MLflow has no store for the scheme {scheme}://; {hint}expected sqlite:///PATH (a file), "
            f"http(s)://HOST:PORT (a server), a database's URL (postgresql://, mysql://, mssql://) or a folder; e.g. {example}")


def store_uri_problem(uri: str, setting: str = "logger.tracking_uri") -> str | None:
    """What is wrong with the store ``uri`` that can be told from its words alone (not MLflow, the
    network or the store's folder), or None: the checks that need no torch (:mod:`ddlx.preflight`)
    say it; :func:`check_tracking_uri` says it and the rest."""
    example = f"{setting}=sqlite:///mlflow.db"
    if not uri.strip():
        return f"{setting} is empty; give an MLflow store, e.g. {example} (a file) or http://HOST:5000 (a server)"
    if re.fullmatch(r"[\w.-]+:\d+", uri):  # localhost:5000: a server without its scheme
        return f"{setting}={uri} names no scheme; for a tracking server give {setting}=http://{uri}"
    parsed = urllib.parse.urlparse(uri)
    if problem := _unknown_scheme(parsed.scheme, f"{setting}={uri}", example):
        return problem
    if parsed.scheme in ("", "file") and not uri.startswith("databricks"):
        path = Path(parsed.path if parsed.scheme == "file" else uri).expanduser()
        if path.is_file() or (not path.exists() and path.suffix in SQLITE_SUFFIXES):  # MLflow takes a path for a folder
            return (f"{setting}={uri} names a database file without its scheme, which MLflow would take for a "
                    f"folder of runs; give it as {setting}=sqlite:///{path}")
    if (path := sqlite_path(uri)) is not None:
        if marks := [meaning for mark, meaning in URL_MARKS.items() if mark in str(path)]:
            return (f"{setting}={uri}: in the database URL MLflow opens, {' and '.join(marks)}, so it "
                    f"would open another file; choose a path without ? or % (the default store is "
                    f"paths.root/mlflow.db)")
    return None


def check_tracking_uri(uri: str, timeout_s: float = 5.0, setting: str = "logger.tracking_uri", *,
                       write: bool = True, read_only_option: str | None = None, made_later: Path | None = None) -> None:
    """Fail at start, not after training, when runs could not be recorded; ``setting``: the option
    that chose ``uri``, as the error names it. ``write=False``: the command only reads the store,
    which then need not be writable; ``read_only_option``: the option that makes it read only,
    which the refusal of a store it cannot write names. ``made_later``: the folder the job will
    make (Hydra's job folder, when its command line is checked): a store in it or one of its
    parents is not missing its folder."""
    if problem := store_uri_problem(uri, setting):
        raise StoreError(problem)
    example = f"{setting}=sqlite:///mlflow.db"
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("", "file") and not uri.startswith("databricks") and _file_store_refused():
        shown = f"e.g. {example}"
        raise StoreError(f"{setting}={uri} is a folder (MLflow's file store), which this MLflow refuses as in maintenance; "
                         f"use an SQLite store, {shown} (mlflow migrate-filestore moves a file store's runs into one), "
                         f"or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store")
    if uri.startswith(("http://", "https://")):
        health = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=timeout_s) as response:
                if response.status != 200:
                    raise OSError(f"HTTP {response.status}")
        except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError) as err:  # (InvalidURL: a bad port)
            raise StoreError(
                f"MLflow tracking server {setting}={uri} is unreachable ({err}); start it "
                f"(mlflow server --host ... --port ...) or log locally with {example}"
            ) from err
    elif (path := sqlite_path(uri)) is not None:
        folder = path.parent  # Path("mlflow.db").parent is Path(".")
        if not folder.is_dir():
            if made_later is not None and _absolute(folder) in (_absolute(made_later), *_absolute(made_later).parents):
                return  # made with the job's folder: nothing is there to read yet, and that folder's check said it can be made
            raise StoreError(f"{setting}={uri}: folder {folder} does not exist; create it or choose another path")
        if path.exists() and not os.access(path, os.R_OK):
            raise StoreError(f"{setting}={uri}: {path} is not readable by this user; ask its owner or choose another store")
        if write and not store_writable(uri):
            unwritable = folder if not os.access(folder, os.W_OK) else path
            reading = f", or pass {read_only_option} to only read it" if read_only_option and path.exists() else ""
            raise StoreError(f"{setting}={uri}: {unwritable} is not writable, so nothing can be recorded there; "
                             f"choose a writable store{reading}")
        if path.exists():
            try:
                tables = _sqlite_tables(path)  # reads the header: fails on a non-database
            except sqlite3.DatabaseError as err:
                raise StoreError(f"{setting}={uri}: {path} is not an SQLite database ({err})") from err
            if not write and "alembic_version" not in tables:  # a reader's first contact would add MLflow's tables
                raise StoreError(f"{setting}={uri}: {path} is an SQLite database but no MLflow store (it has no "
                                 f"alembic_version table); pass the store train.py wrote (its paths.root/mlflow.db)")
            if tables and not tables & MLFLOW_FIRST_TABLES:  # another program's database: MLflow would add its tables
                raise StoreError(f"{setting}={uri}: {path} holds another database (tables {', '.join(sorted(tables)[:5])}), "
                                 f"not an MLflow store; choose a new file, e.g. {setting}=sqlite:///{path.parent / 'ddlx-mlflow.db'}")


def _absolute(path: Path) -> Path:
    return Path(os.path.abspath(path.expanduser()))  # ('..' taken out, as the folder Hydra makes is named)


# What SQLAlchemy's URL parser makes of these in an SQLite path ('#' it keeps).
URL_MARKS = {"?": "'?' starts the URL's options", "%": "'%' starts an escape"}


def _file_store_refused() -> bool:
    """Whether the installed MLflow refuses a file store (MLflow 3 does, unless told to allow it)."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # an MLflow (2.x) that takes file stores
        return False
    return not MLFLOW_ALLOW_FILE_STORE.get()


# A store MLflow is creating has these first (a writer beside it must not take it for another database).
MLFLOW_FIRST_TABLES = {"alembic_version", "experiments"}


def _sqlite_tables(path: Path) -> set[str]:
    # A URI to open it read-only: quoted for a '#' in it; an absolute path after an empty authority
    # ("file://"), so that one starting '//' (sqlite://///tmp/x.db) is not read as a host.
    authority = "//" if path.is_absolute() else ""
    with closing(sqlite3.connect(f"file:{authority}{urllib.parse.quote(str(path))}?mode=ro", uri=True)) as db:
        return {name for (name,) in db.execute("select name from sqlite_master where type = 'table'")}


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
    run_id: str | None = None,
) -> MLFlowLogger:
    """Lightning's MLflow logger (:class:`ddlx.run_logger.RunLogger`); ``run_id``: log into that
    existing run (a resumed one)."""
    from .run_logger import RunLogger

    return RunLogger(
        experiment_name=experiment_name,
        run_name=run_name,
        tracking_uri=tracking_uri,
        tags={k: str(v) for k, v in tags.items() if v is not None},
        artifact_location=artifact_location if is_local_store(tracking_uri) else None,
        run_id=run_id,
    )


def is_local_store(tracking_uri: str) -> bool:
    """A server chooses its own artifact store; a local artifact path only makes sense for a local store."""
    return not tracking_uri.startswith(("http://", "https://", "databricks"))


def artifacts_beside_store(tracking_uri: str) -> str | None:
    """An SQLite store's artifact folder: ``mlruns`` beside the database file, where train.py's
    runs keep theirs (``${paths.root}/mlruns``); None for other stores, which choose their own."""
    path = sqlite_path(tracking_uri)
    if path is not None:
        return str(path.resolve().parent / "mlruns")
    return None


# MLflow 3's UI opens an experiment on its GenAI pages unless this tag says it holds model training.
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


def experiment_id(client, name: str, tracking_uri: str, artifact_location: str | None,
                  setting: str | None = "logger.experiment_name") -> str:
    """``name``'s experiment id, created if missing with its artifacts at ``artifact_location`` on a
    local store: MLflow's default is ./mlruns of whichever folder the command ran in. ``setting``
    is the option that chooses the name (None: fixed), for the error on a deleted experiment."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        _refuse_deleted(exp, tracking_uri, setting)
        if EXPERIMENT_KIND not in exp.tags:  # one made before ddlx said what it is
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        return exp.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location if is_local_store(tracking_uri) else None,
                                    tags={EXPERIMENT_KIND: MODEL_TRAINING})


def check_experiment(tracking_uri: str, name: str) -> None:
    """Fail at start when ``name`` is a deleted experiment of the store: MLflow keeps its name
    taken, and Lightning's logger would try to create it again after the checks, failing with an
    IntegrityError from deep inside the store."""
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_EXPERIMENT_NAME_LENGTH

    if not name.strip():
        raise StoreError(f"logger.experiment_name={name!r} is empty; name the experiment the run goes in, e.g. "
                         f"logger.experiment_name=ddlx")
    if len(name) > MAX_EXPERIMENT_NAME_LENGTH:  # MLflow refuses it only when the run is opened
        raise StoreError(f"logger.experiment_name={name[:20]}... has {len(name)} characters; MLflow takes at most "
                         f"{MAX_EXPERIMENT_NAME_LENGTH}: give a shorter name")
    if not store_exists(tracking_uri):
        return  # a new store has no experiments; opening it here would create it

    with store_lock(tracking_uri):  # another process may be creating its tables
        exp = MlflowClient(tracking_uri).get_experiment_by_name(name)
    if exp is not None:
        _refuse_deleted(exp, tracking_uri, "logger.experiment_name")


def _refuse_deleted(exp, tracking_uri: str, setting: str | None) -> None:
    if exp.lifecycle_stage == "deleted":
        rename = f", or choose another {setting}" if setting else ""
        raise StoreError(
            f"MLflow experiment {exp.name!r} was deleted from {tracking_uri}, and a deleted experiment keeps its "
            f"name; restore it (MLFLOW_TRACKING_URI={shlex.quote(tracking_uri)} mlflow experiments restore --experiment-id "
            f"{exp.experiment_id}) or purge it for good (mlflow gc --backend-store-uri {shlex.quote(tracking_uri)} --experiment-ids "
            f"{exp.experiment_id}){rename}"
        )


# ---- the store -----------------------------------------------------------------------------


@contextmanager
def store_lock(tracking_uri: str) -> Iterator[None]:
    """Hold an exclusive lock on a local SQLite store (``<db>.lock`` beside it; flock works on
    local and NFS file systems) while opening it: MLflow creates and migrates the schema on its
    first contact with a store, and processes doing that at once corrupt it or crash. Other
    stores need none (a server serializes its own writes)."""
    path = sqlite_path(tracking_uri)
    if path is None:
        yield
        return
    if path.exists() and not store_writable(tracking_uri):
        yield  # a store this process cannot write it cannot create or migrate either
        return
    lock = path.with_name(path.name + ".lock")
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def import_store_client(tracking_uri: str) -> None:
    """Import what writing to ``tracking_uri`` takes (MLflow's client and, for an SQLite store, its
    SQLAlchemy store: about 1.7 s on the build machine), ahead of the write: recommend.py does it
    while its child counts, where no store was there to read (reading one imports them: other
    database stores, a server, are read before)."""
    import mlflow.tracking  # noqa: F401

    if sqlite_path(tracking_uri) is not None:
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401


def prepare_store(tracking_uri: str, experiment_name: str, artifact_location: str | None):
    """An MlflowClient on the store, with the store's schema and the experiment created (under
    :func:`store_lock`), so runs started at once against a new store are all recorded."""
    from mlflow.tracking import MlflowClient

    with store_lock(tracking_uri):
        client = MlflowClient(tracking_uri)
        experiment_id(client, experiment_name, tracking_uri, artifact_location)
    return client


# ---- one training run's record, from its opening to its end ---------------------------------------

HEARTBEAT_S = 60.0  # how often a running run says it is alive (tag "heartbeat")
STALE_AFTER_S = 5 * HEARTBEAT_S  # a run of another host silent this long has lost its process


def process_tags() -> dict[str, str]:
    """Who runs this run: host, process id, and a key that tells this process from any other
    (:func:`process_key`), so a reused pid or another container's process is not taken for it."""
    return {"host": socket.gethostname(), "pid": str(os.getpid()), "process": process_key(os.getpid()) or "",
            "heartbeat": f"{time.time():.0f}"}


def process_key(pid: int) -> str | None:
    """``boot id:pid namespace:pid:start time in ticks`` of a live process (Linux), else None."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat(f"/proc/{pid}/ns/pid").st_ino
        state, *fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        started = fields[18]
    except (OSError, IndexError):
        return None
    if state in ("Z", "X"):  # ended, not yet reaped by its parent: gone all the same
        return None
    return f"{boot}:{namespace}:{pid}:{started}"


def start_run(logger: MLFlowLogger, params: Mapping[str, str], config_file: Path, tags: Mapping[str, str]) -> str:
    """Create the run, from global rank 0, with its params, tags and config artifact."""
    run_id = logger.run_id
    logger.log_hyperparams(params)
    logger.experiment.log_artifact(run_id, str(config_file))
    _set_tags(logger.experiment, run_id, {**tags, **process_tags()})
    return run_id


def run_not_held(run_id: str, tracking_uri: str, saved_uri: str | None) -> ConfigError:
    """The refusal of a checkpoint of MLflow run ``run_id`` where ``tracking_uri`` does not hold it
    (``saved_uri``: the store it was recorded at, as the checkpoint says)."""
    elsewhere = f" (it was recorded at {saved_uri}: resume with logger.tracking_uri={saved_uri})" \
        if saved_uri and saved_uri != tracking_uri else ""
    return ConfigError(f"the checkpoint belongs to MLflow run {run_id}, which {tracking_uri} does not hold{elsewhere}")


def check_resumable_run(client, run_id: str, tracking_uri: str, experiment_name: str, saved_uri: str | None,
                        nothing_left: str | None = None) -> None:
    """Refuse to resume a run this store does not hold, a deleted one, one still running, or one
    that FINISHED where ``nothing_left`` (how the settings leave nothing to train after the
    checkpoint, with the fix) says the resume would train nothing. (A run stopped at its end,
    KILLED, is closed FINISHED by such a resume: a SLURM requeue does it.)"""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise run_not_held(run_id, tracking_uri, saved_uri) from None
    if run.info.lifecycle_stage == "deleted":
        raise ConfigError(f"the checkpoint's MLflow run {run_id} was deleted; restore it "
                          f"(MLFLOW_TRACKING_URI={shlex.quote(tracking_uri)} mlflow runs restore --run-id {run_id}) to "
                          f"resume into it")
    experiment = client.get_experiment(run.info.experiment_id).name
    if experiment != experiment_name:
        raise ConfigError(f"the checkpoint's MLflow run {run_id} is in experiment {experiment!r}; resume with "
                          f"logger.experiment_name={experiment}")
    if run.info.status == "FINISHED" and nothing_left is not None:
        raise ConfigError(f"the checkpoint's MLflow run {run_id} FINISHED, and {nothing_left}")
    if run.info.status == "RUNNING" and vanished_reason(run) is None:
        tags = run.data.tags
        raise ConfigError(f"MLflow run {run_id} is still running (pid {tags.get('pid', '?')} on "
                          f"{tags.get('host', '?')}); stop it first, or wait for it to end")


def reopen_run(logger: MLFlowLogger, tags: Mapping[str, str], name: str | None = None) -> str:
    """Continue the run ``logger`` was made for (its ``run_id``): RUNNING again, with this
    process's tags, renamed ``name`` where the resume names it (logger.run_name); the error of
    the attempt that stopped it is kept as ``previous_error``."""
    client, run_id = logger.experiment, logger.run_id
    run = client.get_run(run_id)
    previous = run.data.tags.get("error")
    resumes = int(run.data.tags.get("resumes", "0")) + 1
    client.update_run(run_id, status="RUNNING", name=name or None)
    extra = {"previous_error": previous} if previous else {}
    _set_tags(client, run_id, {**tags, **process_tags(), "resumes": str(resumes), **extra})
    if previous:
        client.delete_tag(run_id, "error")
    return run_id


def end_run(client, run_id: str, status: str, error: str | None = None) -> None:
    """The run's last word: FINISHED, FAILED (with ``error``) or KILLED (with the signal). Never
    raises: the record must not hide what ended the run, and a stop signal arriving meanwhile
    waits until it is written."""
    for _ in range(3):
        try:
            if error:
                client.set_tag(run_id, "error", error[:5000])
            elif "error" in client.get_run(run_id).data.tags:  # set by a look that took it for vanished
                client.delete_tag(run_id, "error")
            client.set_terminated(run_id, status)
            if run_id in WATCHES:  # closed (by this thread or a launcher's): its watch has nothing left to do
                WATCHES.pop(run_id).stop()
            return
        except Stopped:
            continue
        except Exception as err:  # noqa: BLE001
            log.error("could not mark MLflow run %s %s: %s", run_id, status, err)
            return


@contextmanager
def recorded(logger: MLFlowLogger | None, open_run: Callable[[], str], resume: HowToResume | None = None) -> Iterator[str | None]:
    """Open the run (``open_run()``: :func:`start_run` or :func:`reopen_run`) and yield its id.
    From then to the end of the block the run is alive (a heartbeat tag every
    :data:`HEARTBEAT_S`), and every way out ends it: FINISHED, KILLED for a stop signal, FAILED
    with the error for any other exception; if this process is killed, its watch marks it FAILED
    and says ``resume``. ``logger=None`` (ranks other than 0): nothing."""
    if logger is None:
        yield None
        return
    heartbeat = watch = None
    try:
        run_id = open_run()
        heartbeat = Heartbeat(logger._tracking_uri, run_id)
        watch = WATCHES[run_id] = ProcessWatch(logger._tracking_uri, run_id, resume)
        yield run_id
        end_run(logger.experiment, run_id, "FINISHED")
    except Stopped as stop:
        end_logged_run(logger, "KILLED", f"{stop}")
        raise
    except BaseException as err:
        end_logged_run(logger, "FAILED", f"{type(err).__name__}: {err}")
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if watch is not None:
            WATCHES.pop(run_id, None)
            watch.stop()


def end_logged_run(logger: MLFlowLogger, status: str, error: str) -> None:
    """:func:`end_run` for the run ``logger`` logs to, once it has one."""
    if isinstance(logger._run_id, str):  # it may have failed before the run was created
        end_run(logger.experiment, logger._run_id, status, error)


class Heartbeat:
    """Sets the run's ``heartbeat`` tag (unix seconds) every :data:`HEARTBEAT_S` from a daemon
    thread with its own client, so a run whose process vanished (kill -9, a lost node) can be
    told from one that is alive (:func:`close_vanished_runs`)."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(tracking_uri, run_id), name="ddlx-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, tracking_uri: str, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        while not self._stop.wait(HEARTBEAT_S):
            try:
                client.set_tag(run_id, "heartbeat", f"{time.time():.0f}")
            except Exception as err:  # noqa: BLE001 - a missed beat is not worth a training run
                log.warning("heartbeat of MLflow run %s not recorded: %s", run_id, err)

    def stop(self) -> None:
        self._stop.set()


# The watch of each run this process has open, stopped when the run is closed (end_run).
WATCHES: dict[str, ProcessWatch] = {}


class ProcessWatch:
    """A small process (``python -m ddlx.run_watch``) that outlives this one: if this process ends
    without closing the run (kill -9, the out-of-memory killer, a crash in C), it marks the run
    FAILED at once, where otherwise the next command against the store would. It sits in a
    session of its own, so a signal to the run's process group does not end it, and imports
    MLflow only if it has a run to close; :meth:`stop` (the run closed) ends it."""

    def __init__(self, tracking_uri: str, run_id: str, resume: HowToResume | None = None) -> None:
        import subprocess

        from .process import ddlx_module_command

        command = ddlx_module_command("ddlx.run_watch", tracking_uri, run_id, str(os.getpid()))
        self._process = None
        try:
            self._process = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
            # What it says after marking the run FAILED, on its stdin: among its arguments, the job's
            # words would have a `pkill -f train.py` take the watch with the run, leaving it RUNNING.
            self._process.stdin.write((resume.to_json() if resume is not None else "").encode() + b"\n")
            self._process.stdin.flush()
        except OSError as err:
            log.warning("no watch on MLflow run %s (%s): if this process is killed, the next command against the "
                        "store marks it FAILED", run_id, err)
            if self._process is not None:
                self._process.kill()
                self._process.wait()
            self._process = None

    def stop(self) -> None:
        if self._process is None:
            return
        process, self._process = self._process, None
        try:
            process.communicate(b"closed\n", timeout=5)
        except Exception as err:  # noqa: BLE001 - the run is closed already; the watch only looks
            log.warning("the watch process of this run did not end: %s", err)


def close_if_vanished(tracking_uri: str, run_id: str) -> str | None:
    """Mark ``run_id`` FAILED if it is RUNNING and its process is gone (:func:`vanished_reason`);
    the reason, for the caller to say (the run's watch, in its own line), or None when it was not."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    return _close_vanished(client, run) if run.info.status == "RUNNING" else None


def run_title(logger: MLFlowLogger) -> str:
    """The run as its plots name it: its name and id."""
    run = logger.experiment.get_run(logger.run_id)
    return f"{run.info.run_name} (MLflow run {run.info.run_id})"


def mark_failed(logger, reason: str) -> None:
    """Mark the run of ``logger`` FAILED with ``reason`` (a rank died; its launcher ends the job)."""
    if isinstance(getattr(logger, "_run_id", None), str):
        end_logged_run(logger, "FAILED", reason)


def record_rejected_run(logger_cfg, name: str, tags: Mapping[str, str], params: Mapping[str, str],
                        error: BaseException) -> str:
    """A job of a sweep refused before training (bad config, does not fit): still one run, FAILED,
    with its config and the reason, so the sweep's record has every job. ``logger_cfg``: the
    ``logger`` config group."""
    prepare_store(logger_cfg.tracking_uri, logger_cfg.experiment_name, logger_cfg.artifact_location)
    logger = make_logger(logger_cfg.tracking_uri, logger_cfg.experiment_name, name, tags, logger_cfg.artifact_location)
    logger.log_hyperparams(params)
    end_run(logger.experiment, logger.run_id, "FAILED", f"{type(error).__name__}: {error}")
    return logger.run_id


def record_unmeasured(logger: MLFlowLogger | None, reason: str) -> None:
    """A run that trained no step the ddlx way (fast_dev_run, limit_train_batches=0): tagged so
    the report and the recommender do not count it as a measurement."""
    if logger is not None and isinstance(logger._run_id, str):
        _set_tags(logger.experiment, logger.run_id, {"measured": "false", "not_measured_because": reason})


# ---- runs whose process is gone -----------------------------------------------------------------


def vanished_reason(run, now: float | None = None) -> str | None:
    """Why a RUNNING run can no longer end by itself, or None while its process may be alive:
    when it ran in this machine's boot and pid namespace, its process (:func:`process_key`) is
    gone; otherwise (another host, container or boot), no heartbeat for :data:`STALE_AFTER_S`."""
    tags = run.data.tags
    now = time.time() if now is None else now
    last = float(tags.get("heartbeat") or run.info.start_time / 1000)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last))
    recorded_key, mine = tags.get("process", ""), process_key(os.getpid())
    if tags.get("host") == socket.gethostname() and recorded_key and mine \
            and recorded_key.split(":")[:2] == mine.split(":")[:2]:
        if process_key(int(recorded_key.split(":")[2])) == recorded_key:
            return None
        return (f"its process (pid {tags.get('pid')} on {tags['host']}) ended without closing the run: killed "
                f"(kill -9, out of memory) or crashed; last heartbeat {since}")
    if now - last > STALE_AFTER_S:
        return (f"no heartbeat from {tags.get('host', 'its host')} since {since} ({(now - last) / 60:.0f} min): "
                f"its process or node was lost")
    return None


def close_vanished_runs(client, experiment_ids: list[str]) -> list[str]:
    """Mark FAILED, with the reason, every RUNNING run of these experiments whose process is
    gone (:func:`vanished_reason`); their ids. Called before a run starts and by the report."""
    closed = []
    for run in client.search_runs(experiment_ids, filter_string="attributes.status = 'RUNNING'", max_results=1000):
        reason = _close_vanished(client, run)
        if reason is not None:
            log.warning("MLflow run %s was left RUNNING: marked FAILED (%s)", run.info.run_id, reason)
            closed.append(run.info.run_id)
    return closed


def _close_vanished(client, run) -> str | None:
    """Mark the RUNNING ``run`` FAILED, ended at its last heartbeat, when its process is gone; why."""
    reason = vanished_reason(run)
    if reason is None:
        return None
    last = float(run.data.tags.get("heartbeat") or run.info.start_time / 1000)
    try:
        client.set_tag(run.info.run_id, "error", reason)
        client.set_terminated(run.info.run_id, "FAILED", end_time=int(last * 1000))
    except Exception as err:  # noqa: BLE001
        log.warning("could not close vanished MLflow run %s: %s", run.info.run_id, err)
        return None
    return reason


def tag_run(logger: MLFlowLogger | None, tags: Mapping[str, str]) -> None:
    """Tags learnt during the run (rank 0's logger; None elsewhere: nothing)."""
    if logger is not None and logger.run_id is not None:
        _set_tags(logger.experiment, logger.run_id, tags)


def _set_tags(client, run_id: str, tags: Mapping[str, str]) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items() if v is not None])


# ---- reading runs, and the runs that record a report or a recommendation ---------------------


def load_runs(tracking_uri: str, experiments: list[str], sweep_id: str | None = None) -> list[MeasuredRun]:
    """Every run of ``experiments`` (or only those of ``sweep_id``; ``latest`` = the newest sweep),
    after closing those whose process vanished. A ValueError says what is missing."""
    from mlflow.tracking import MlflowClient

    from .config_check import did_you_mean

    if not store_exists(tracking_uri):
        raise ValueError(f"no MLflow store at {tracking_uri}: train first (python train.py ...) or pass --tracking-uri")
    with store_lock(tracking_uri):
        client = MlflowClient(tracking_uri)
        ids = []
        for name in experiments:
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise ValueError(f"no MLflow experiment named {name!r} at {tracking_uri}{_experiments_there(client, name)}")
            ids.append(exp.experiment_id)
    writable = store_writable(tracking_uri)
    if writable:
        close_vanished_runs(client, ids)  # a run whose process is gone is FAILED, not still running
    found = client.search_runs(ids, max_results=50000, order_by=["attributes.start_time DESC"])
    if sweep_id == "latest":
        sweep_id = next((r.data.tags["sweep_id"] for r in found if r.data.tags.get("sweep_id")), None)
        if sweep_id is None:
            raise ValueError("sweep_id=latest: none of these runs belongs to a sweep (python train.py -m ...)")
    runs = [to_measured_run(r) for r in found]
    if not writable:  # so read, though the store keeps them RUNNING
        runs = [dataclasses.replace(run, status="FAILED", error=reason) if r.info.status == "RUNNING"
                and (reason := vanished_reason(r)) else run for r, run in zip(found, runs)]
    if sweep_id is not None:
        runs = [r for r in runs if r.sweep_id == sweep_id]
        if not runs:
            sweeps = list(dict.fromkeys(r.data.tags["sweep_id"] for r in found if r.data.tags.get("sweep_id")))
            there = (f"; their newest sweeps: {', '.join(sweeps[:3])}{did_you_mean(sweep_id, sweeps)}" if sweeps
                     else "; none of their runs belongs to a sweep (python train.py -m ...)")
            raise ValueError(f"no runs tagged sweep_id={sweep_id!r} in experiments {experiments}{there}")
    return runs


def _experiments_there(client, name: str) -> str:
    """The store's experiments, as the refusal of ``name`` lists them."""
    from .config_check import did_you_mean

    names = sorted(e.name for e in client.search_experiments())
    return f"; it holds {', '.join(names)}{did_you_mean(name, names)}" if names else "; it holds no experiment yet"


def log_result_run(tracking_uri: str, experiment: str, run_name: str, *, artifact_location: str | None = None,
                   tags: Mapping[str, str] | None = None, params: Mapping[str, object] | None = None,
                   metrics: Mapping[str, float] | None = None, files: list[Path] = ()) -> tuple[str, str]:
    """One FINISHED run recording a result (a report, a recommendation): its inputs as params,
    its answer as tags and metrics, its files as artifacts. Its experiment's id and its own."""
    from mlflow.entities import Metric, Param

    client = prepare_store(tracking_uri, experiment, artifact_location or artifacts_beside_store(tracking_uri))
    exp_id = client.get_experiment_by_name(experiment).experiment_id
    run = client.create_run(exp_id, run_name=run_name, tags={k: str(v) for k, v in (tags or {}).items() if v})
    try:
        now = int(time.time() * 1000)
        client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in (params or {}).items()],
                         metrics=[Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()])
        for path in files:
            client.log_artifact(run.info.run_id, str(path))
    except BaseException as err:  # not left RUNNING, a result that never ends, by Ctrl-C or a refused artifact
        with suppress(Exception):
            client.set_terminated(run.info.run_id, "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
        raise
    client.set_terminated(run.info.run_id, "FINISHED")
    return exp_id, run.info.run_id


def log_series(logger, metrics: list[tuple[str, float, int]], summary: Mapping[str, float], summary_ms: int,
               files: list[Path] = ()) -> None:
    """A training run's sampled series (name, value, unix ms), numbered after those already
    logged (a resumed run's continue), its summary figures and files. No run (no logger, or
    Lightning's stand-in under fast_dev_run): nothing."""
    from mlflow.entities import Metric

    run_id = getattr(logger, "run_id", None)
    if not isinstance(run_id, str):
        return
    client = logger.experiment
    names = {name for name, _, _ in metrics}
    first = {name: len(client.get_metric_history(run_id, name)) for name in names}
    count: dict[str, int] = {}
    batch = []
    for name, value, ms in metrics:
        batch.append(Metric(name, float(value), ms, first[name] + count.get(name, 0)))
        count[name] = count.get(name, 0) + 1
    batch += [Metric(name, float(value), summary_ms, 0) for name, value in summary.items()]
    for i in range(0, len(batch), 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=batch[i : i + 1000])
    for path in files:
        client.log_artifact(run_id, str(path))
