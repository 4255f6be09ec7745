"""MLflow helpers: config flattening, tracking-store checks, a store this user can only read."""
from __future__ import annotations

import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing

import psutil
import pytest
from conftest import PROJECT_DIR, runs, subprocess_env

from ddlx.errors import ConfigError
from ddlx.tracking import check_experiment, check_tracking_uri, flatten_config, use_case


def test_flatten_config_uses_override_names():
    flat = flatten_config({"data": {"batch_size": 32, "mean": [0.5, 0.5]}, "seed": 1})
    assert flat == {"data.batch_size": "32", "data.mean": "[0.5, 0.5]", "seed": "1"}


def test_use_cases_of_source_000():
    assert use_case("vgg16", "firesmall") == "complexsmall"
    assert use_case("alexnet", "firebig") == "simplebig"
    assert use_case("alexnet", "firesmall") is None


def test_sqlite_store_in_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"folder \S+/no/such/dir does not exist"):
        check_tracking_uri(f"sqlite:///{tmp_path}/no/such/dir/mlflow.db")


def test_sqlite_store_that_is_not_a_database(tmp_path):
    bogus = tmp_path / "mlflow.db"
    bogus.write_text("hello, this is not sqlite" * 100)
    with pytest.raises(ConfigError, match="is not an SQLite database"):
        check_tracking_uri(f"sqlite:///{bogus}")


def test_another_programs_sqlite_database_is_refused_as_a_store_and_an_empty_one_taken(tmp_path):
    other = tmp_path / "inventory.db"
    with closing(sqlite3.connect(other)) as db:
        db.execute("create table parts (name text)")
        db.commit()
    for write in (True, False):
        with pytest.raises(ConfigError, match=r"logger.tracking_uri=sqlite:///\S+/inventory.db: .*(another database|no MLflow store)"):
            check_tracking_uri(f"sqlite:///{other}", write=write)
    assert [t for (t,) in sqlite3.connect(other).execute("select name from sqlite_master")] == ["parts"], "left as it was"
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    check_tracking_uri(f"sqlite:///{empty}")  # an empty file: MLflow makes its store in it


@pytest.mark.parametrize("folder,mark", [("runs?1", r"'\?' starts the URL's options"), ("runs%41", r"'%' starts an escape")])
def test_an_sqlite_path_that_the_database_url_would_misread_is_refused(tmp_path, folder, mark):
    (tmp_path / folder).mkdir()
    with pytest.raises(ConfigError, match=rf"logger.tracking_uri=sqlite:///\S+/mlflow.db: .*{mark}"):
        check_tracking_uri(f"sqlite:///{tmp_path / folder / 'mlflow.db'}")


def test_sqlalchemy_options_after_an_sqlite_path_are_not_part_of_it(tmp_path):
    from ddlx.tracking import sqlite_path

    assert sqlite_path(f"sqlite:///{tmp_path}/m.db?timeout=30&uri=true") == tmp_path / "m.db"
    check_tracking_uri(f"sqlite:///{tmp_path}/m.db?timeout=30")
    with pytest.raises(ConfigError, match=r"'\?' starts the URL's options"):
        check_tracking_uri(f"sqlite:///{tmp_path}/m.db?")  # nothing SQLAlchemy would take as options


def test_an_existing_store_in_a_folder_with_a_hash_is_taken(tmp_path):
    store = tmp_path / "runs#1" / "mlflow.db"  # '#' would end a file: URI's path: the file read is runs
    store.parent.mkdir()
    with closing(sqlite3.connect(store)) as db:
        db.execute("create table alembic_version (version_num text)")
        db.commit()
    check_tracking_uri(f"sqlite:///{store}")
    check_tracking_uri(f"sqlite:///{store}", write=False)


def test_an_existing_store_named_with_extra_slashes_is_taken(tmp_path):
    store = tmp_path / "mlflow.db"  # sqlite://///tmp/... : SQLAlchemy opens //tmp/..., the same file on POSIX
    with closing(sqlite3.connect(store)) as db:
        db.execute("create table alembic_version (version_num text)")
        db.commit()
    check_tracking_uri(f"sqlite:////{store}")
    check_tracking_uri(f"sqlite:////{store}", write=False)


@pytest.mark.parametrize("uri,why", [("", r"logger.tracking_uri is empty"),
                                     ("./mlruns", r"logger.tracking_uri=./mlruns is a folder \(MLflow's file store\)"),
                                     ("file:///tmp/mlruns", r"file:///tmp/mlruns is a folder")])
def test_an_empty_uri_or_a_file_store_is_refused_with_an_sqlite_store_to_use(uri, why, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match=rf"{why}.*logger.tracking_uri=sqlite:///mlflow.db"):
        check_tracking_uri(uri)
    if uri:  # MLflow's own opt-out keeps a file store
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        check_tracking_uri(uri)


@pytest.mark.parametrize("allow_file_store", ["false", "true"])
def test_a_database_file_without_its_scheme_is_named_with_it(tmp_path, monkeypatch, allow_file_store):
    """MLflow takes a bare path for a file store's folder: an existing SQLite file was called a
    folder, and with file stores allowed, training failed in MLflow on 'mlflow.db/.trash'."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allow_file_store)
    store = tmp_path / "mlflow.db"
    check_tracking_uri(f"sqlite:///{store}")  # made
    for given in (str(store), f"file://{store}", str(tmp_path / "new.sqlite")):
        with pytest.raises(ConfigError, match=rf"logger.tracking_uri={re.escape(given)} names a database file without "
                                              rf"its scheme.*logger.tracking_uri=sqlite:///{re.escape(str(tmp_path))}/"):
            check_tracking_uri(given)


def test_a_server_without_its_scheme_is_named_with_it():
    with pytest.raises(ConfigError, match=r"logger.tracking_uri=localhost:5000 names no scheme.*=http://localhost:5000"):
        check_tracking_uri("localhost:5000")


def test_a_scheme_mlflow_has_no_store_for_is_named_with_the_closest_it_has():
    """A typo in the scheme failed in MLflow, as the run opened, with a KeyError's traceback."""
    with pytest.raises(ConfigError, match=r"logger.tracking_uri=sqllite:///mlflow.db: MLflow has no store for the scheme "
                                          r"sqllite://; did you mean sqlite://\?"):
        check_tracking_uri("sqllite:///mlflow.db")
    with pytest.raises(ConfigError, match=r"--tracking-uri=nope://x: .*; expected sqlite:///PATH"):
        check_tracking_uri("nope://x", setting="--tracking-uri")
    for known in ("postgresql+psycopg2://user@db/mlflow", "databricks", "databricks://profile", "mysql://db/mlflow"):
        check_tracking_uri(known)  # (their servers are MLflow's to reach)


def test_the_schemes_taken_are_mlflows_own():
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    from ddlx.tracking import STORE_SCHEMES

    assert set(STORE_SCHEMES) == set(_tracking_store_registry._registry)


def test_an_empty_or_too_long_experiment_name_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"logger.experiment_name='' is empty.*logger.experiment_name=ddlx"):
        check_experiment(f"sqlite:///{tmp_path}/mlflow.db", "")
    with pytest.raises(ConfigError, match=r"logger.experiment_name=e{20}\.\.\. has 600 characters; MLflow takes at most 500"):
        check_experiment(f"sqlite:///{tmp_path}/mlflow.db", "e" * 600)  # MLflow refused it as the run opened


def test_unreachable_server():
    with pytest.raises(ConfigError, match=r"http://127.0.0.1:9 is unreachable.*sqlite:///mlflow.db"):
        check_tracking_uri("http://127.0.0.1:9", timeout_s=2)


def test_a_deleted_experiment_is_refused_with_the_ways_out(tmp_path):
    from mlflow.tracking import MlflowClient

    from ddlx.tracking import check_experiment, experiment_id

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    check_experiment(uri, "anything")  # no store yet: nothing to check, and no store created
    assert not (tmp_path / "mlflow.db").exists()
    client = MlflowClient(uri)
    exp = client.create_experiment("gone")
    client.create_experiment("here")
    client.delete_experiment(exp)
    check_experiment(uri, "here")
    check_experiment(uri, "new")
    restore = rf"'gone' was deleted .*mlflow experiments restore --experiment-id {exp}\).*mlflow gc .*--experiment-ids {exp}"
    with pytest.raises(ConfigError, match=restore + r".*or choose another logger.experiment_name"):
        check_experiment(uri, "gone")
    with pytest.raises(ConfigError, match=restore + r"\)$"):  # a fixed name: no other to choose
        experiment_id(client, "gone", uri, None, setting=None)
    assert experiment_id(client, "here", uri, None) == client.get_experiment_by_name("here").experiment_id


@pytest.mark.parametrize("scheme", ["sqlite", "http"])
def test_importing_a_stores_client_ahead_imports_what_its_write_needs_and_writes_nothing(tmp_path, scheme):
    """recommend.py imports MLflow's client while its child counts (import_store_client): in a
    fresh process, the modules the store's write imports (the SQLAlchemy store for an SQLite path)
    are imported, no store is made, and a module MLflow moved fails here rather than in a user's answer."""
    uri = f"sqlite:///{tmp_path / 'new.db'}" if scheme == "sqlite" else "http://127.0.0.1:9"
    script = ("import sys; from ddlx.tracking import import_store_client; import_store_client(sys.argv[1]); "
              "print(' '.join(m for m in ('mlflow.tracking', 'mlflow.store.tracking.sqlalchemy_store') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script, uri], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = done.stdout.split()
    assert "mlflow.tracking" in imported
    assert ("mlflow.store.tracking.sqlalchemy_store" in imported) == (scheme == "sqlite")
    assert list(tmp_path.iterdir()) == [], "nothing written: the store is made only when the answer is logged"

@pytest.mark.parametrize("stop,status", [(KeyboardInterrupt, "KILLED"), (OSError, "FAILED")])
def test_a_result_run_stopped_while_it_logs_is_not_left_running(tmp_path, monkeypatch, stop, status):
    """A recommendation or report interrupted while it logs (Ctrl-C, a refused artifact): its run
    ends KILLED or FAILED, not RUNNING for ever, and the interruption goes on to its caller."""
    from mlflow.tracking import MlflowClient

    from ddlx.tracking import log_result_run

    def refuse(*args, **kwargs):
        raise stop("while the artifact was copied")

    monkeypatch.setattr(MlflowClient, "log_artifact", refuse)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    answer = tmp_path / "answer.json"
    answer.write_text("{}")
    with pytest.raises(stop):
        log_result_run(uri, "recommendations", "asked", metrics={"predicted_epoch_s": 1.0}, files=[answer])
    (run,) = runs(uri, "recommendations")
    assert run.info.status == status and run.data.metrics == {"predicted_epoch_s": 1.0}


def test_a_new_store_is_made_without_mlflows_info_lines(tmp_path):
    """A first run or answer into a new store printed MLflow's "Creating initial MLflow database
    tables..." and "Updating database tables": the store is made, its tables are there, and
    nothing is said beside ddlx's own lines (which name the store)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = "import sys; from ddlx.tracking import prepare_store; prepare_store(sys.argv[1], 'ddlx', None)"
    done = subprocess.run([sys.executable, "-c", script, uri], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    from ddlx.tracking import _sqlite_tables

    assert "alembic_version" in _sqlite_tables(tmp_path / "mlflow.db")
    assert "database tables" not in done.stderr + done.stdout, done.stderr


WRITER = """
import sys
from ddlx.tracking import prepare_store
uri, name = sys.argv[1], sys.argv[2]
client = prepare_store(uri, "ddlx", None)
run = client.create_run(client.get_experiment_by_name("ddlx").experiment_id, run_name=name)
for step in range(20):
    client.log_metric(run.info.run_id, "loss", 1.0 / (step + 1), step=step)
client.set_terminated(run.info.run_id, "FINISHED")
"""


@pytest.mark.integration
def test_writers_started_at_once_are_all_recorded_by_a_new_store_and_an_existing_one(tmp_path):
    """MLflow creates and migrates an SQLite store on first contact (without ddlx's lock, 3 of 4
    such writers crashed in each of 3 tries): four processes at once against a new store, then
    four more against it, each run recorded with its metrics."""
    import subprocess
    import sys

    from conftest import subprocess_env
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for wave in ("new", "existing"):
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, uri, f"{wave}{i}"], env=subprocess_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(4)]
        outs = [p.communicate(timeout=180)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, "\n".join(o[-1500:] for o in outs)
    client = MlflowClient(uri)
    found = client.search_runs([client.get_experiment_by_name("ddlx").experiment_id])
    assert sorted(r.info.run_name for r in found) == sorted(f"{w}{i}" for w in ("new", "existing") for i in range(4))
    assert all(r.info.status == "FINISHED" and len(client.get_metric_history(r.info.run_id, "loss")) == 20 for r in found)


def as_reader(cmd: list[str]) -> list[str]:
    """``cmd`` run as a user held to the files' modes: root without the capabilities that let it
    write where the modes say no (as root in CI; another user is held to them anyway)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("as root, a read-only folder needs setpriv (util-linux) to drop root's override")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *cmd]


@pytest.mark.integration
def test_a_store_this_user_can_only_read_is_reported_and_recommended_from_without_a_write(tmp_path):
    """A colleague's or a shared read-only results folder: the report (--no-log), recommend.py
    (log=false) and the UI read it, with no lock file and nothing changed; a run left RUNNING by a
    vanished process reads as failed; asked to log there, each refuses at once, naming the option."""
    from mlflow.tracking import MlflowClient
    from test_report import _log

    shared = tmp_path / "shared"
    shared.mkdir()
    uri = f"sqlite:///{shared}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("ddlx")
    _log(client, exp, "sequential", 30.0, tags={"threads": "1"})
    _log(client, exp, "sequential", 16.0, tags={"threads": "2"})
    lost = client.create_run(exp, start_time=int((time.time() - 2 * 86400) * 1000),
                             tags={"strategy": "cpu_mp", "host": "elsewhere", "accelerator": "cpu", "sweep_id": "multirun/a"})
    with closing(sqlite3.connect(shared / "notes.db")) as db:
        db.execute("create table notes (text)")
    (shared / "notes.db").chmod(0o444)
    (shared / "mlflow.db").chmod(0o444)
    shared.chmod(0o555)
    before = {f.name: f.stat().st_mtime_ns for f in shared.iterdir()}
    try:
        def run(*cmd: str, cwd=tmp_path) -> subprocess.CompletedProcess:
            return subprocess.run(as_reader([sys.executable, *cmd]), capture_output=True, text=True, timeout=300,
                                  env=subprocess_env(), cwd=cwd)

        report = run("-m", "ddlx.report", "--tracking-uri", uri, "--no-log", "--out", str(tmp_path / "report"))
        assert report.returncode == 0, report.stderr[-3000:]
        assert "sequential threads=2" in report.stdout and "1.88" in report.stdout, "the speedup 30/16"
        assert any(line.startswith("failed:") and f"cpu_mp (run {lost.info.run_id})" in line and
                   "no heartbeat from elsewhere" in line for line in report.stdout.splitlines()), \
            "the lost run reads as failed, with why"
        refused = run("-m", "ddlx.report", "--tracking-uri", uri)
        assert refused.returncode == 2 and "is not writable" in refused.stderr and "--no-log" in refused.stderr
        from_there = run("-m", "ddlx.report", "--tracking-uri", "sqlite:///mlflow.db", "--no-log", cwd=shared)
        assert from_there.returncode == 2 and "--out=reports/" in from_there.stderr, "its files' default folder: refused first"
        other = run("-m", "ddlx.report", "--tracking-uri", f"sqlite:///{shared}/notes.db", "--no-log")
        assert other.returncode == 2 and "no MLflow store" in other.stderr and "Traceback" not in other.stderr

        recommend = [str(PROJECT_DIR / "recommend.py"), "hw=titanrtx_4x", "model=alexnet", "output=json", "probe=false",
                     f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path}/out", f"logger.tracking_uri={uri}"]
        answer = run(*recommend, "log=false")
        assert answer.returncode == 0, answer.stderr[-3000:]
        assert '"runs": "3 runs from ' in answer.stdout
        refused = run(*recommend)
        assert refused.returncode == 2 and "is not writable" in refused.stderr and "log=false" in refused.stderr
        with socket.socket() as taken:  # ddlx.ui stops at the port, after the store's checks
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            ui = run("-m", "ddlx.ui", "--tracking-uri", uri, "--port", str(taken.getsockname()[1]))
        assert ui.returncode == 2 and "is taken" in ui.stderr, "the UI serves it: to look at runs is to read them"
        assert {f.name: f.stat().st_mtime_ns for f in shared.iterdir()} == before, "nothing written, no lock file"
    finally:
        shared.chmod(0o755)
    assert MlflowClient(uri).get_run(lost.info.run_id).info.status == "RUNNING", "the store itself unchanged"


def test_a_runs_watch_imports_the_ddlx_its_run_imported_not_the_installed_one(tmp_path):
    """train.py run from a clone other than the installed one (or with none installed) has the
    clone's ddlx, its script's folder being on its path: its run's watch, a ``ddlx.run_watch``
    child, must run that ddlx too, even from a folder that holds yet another ddlx (a child's current
    folder comes first on its path). The clone's watch here writes which ddlx it is."""
    clone, marker = tmp_path / "clone", tmp_path / "watch_ran"
    shutil.copytree(PROJECT_DIR / "ddlx", clone / "ddlx", ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "ddlx" / "run_watch.py").write_text(
        f"import pathlib, sys, ddlx\npathlib.Path({str(marker)!r}).write_text(ddlx.__file__ + ' ' + sys.argv[2])\n")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "ddlx").mkdir(parents=True)
    (elsewhere / "ddlx" / "__init__.py").write_text("")
    (elsewhere / "ddlx" / "run_watch.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('decoy')\n")
    parent = (f"import sys; sys.path[0] = {str(clone)!r}; from ddlx.tracking import ProcessWatch; "
              "ProcessWatch('sqlite:///unused.db', 'run-id').stop()")  # as train.py's folder on its path
    subprocess.run([sys.executable, "-c", parent], cwd=elsewhere, env=dict(os.environ), check=True, timeout=60)
    assert marker.read_text() == f"{clone / 'ddlx' / '__init__.py'} run-id", "the clone's watch, with its arguments"


def test_a_runs_watch_takes_how_to_resume_on_stdin_not_among_its_arguments():
    """``pkill -f train.py`` (or any of the job's words) must take the run's process and leave its
    watch to mark the run FAILED; and a resume line past Linux's 128 KiB for one argument still
    reaches the watch whole."""
    from ddlx.command_line import HowToResume
    from ddlx.tracking import ProcessWatch

    overrides = [f"+logger.tags.t{i}={'x' * 1000}" for i in range(200)]
    watch = ProcessWatch("sqlite:///unused.db", "run-id", HowToResume.of(["model=vgg16", *overrides], "last.ckpt",
                                                                           weights_only=False))
    try:
        assert watch._process is not None and watch._process.poll() is None
        arguments = " ".join(psutil.Process(watch._process.pid).cmdline())
        assert "ddlx.run_watch" in arguments and "model=vgg16" not in arguments and "train.py" not in arguments
    finally:
        watch.stop()
    assert watch._process is None


def test_a_runs_watch_reads_how_to_resume_whole_and_then_waits_for_the_run(tmp_path):
    """The watch's stdin: the resume line (any length), then "closed" when the run closes; the
    end of its stdin (the run's process gone) before either is an end too."""
    from ddlx.run_watch import read_line, wait_for_end

    read, write = os.pipe()
    line = b'{"overrides": ["' + b"x" * 300_000 + b'"]}'
    writer = threading.Thread(target=lambda: (os.write(write, line + b"\nclosed\n"), os.close(write)))
    writer.start()
    kept = bytearray()
    assert read_line(read, kept) == line
    writer.join()
    assert wait_for_end(os.getpid(), read, kept), "the closing line, read with the first, closes"
    os.close(read)
    read, write = os.pipe()
    os.close(write)
    assert read_line(read, bytearray()) is None, "ended before a line"
    os.close(read)
