"""The links ddlx prints land on MLflow 3's model-training view, and ``python -m ddlx.ui`` serves a
store there, refusing one it cannot serve in one line. The browser check (headless Chromium from
a fresh profile) and the served UI's start and Ctrl-C are slow-marked."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from ddlx import ui

ROOT = Path(__file__).resolve().parents[1]
ML_VIEW = ("workflowType", "machine_learning")


def query(link: str) -> list[tuple[str, str]]:
    """The parameters the UI's router reads: those after the ``?`` of the part after ``#``."""
    fragment = urlsplit(link).fragment
    assert fragment.startswith("/"), link
    return parse_qsl(fragment.partition("?")[2])


def test_run_experiment_and_compare_links_ask_for_the_model_training_view():
    for link in (ui.run_page("1", "abc"), ui.experiment_page("1"), ui.compare_page(["1"], ["abc", "def"])):
        assert ML_VIEW in query(link), link
    assert urlsplit(ui.experiment_page("7")).fragment.startswith("/experiments/7/runs?"), "the runs table, not the first tab"
    assert urlsplit(ui.run_page("7", "abc")).fragment.startswith("/experiments/7/runs/abc?")


def test_the_compare_link_lists_its_runs_first_as_the_compare_page_reads_them():
    link = ui.compare_page(["1", "2"], ["abc", "def"])
    assert urlsplit(link).fragment.startswith("/compare-runs?runs=")
    params = dict(query(link))
    assert json.loads(params["runs"]) == ["abc", "def"] and json.loads(params["experiments"]) == ["1", "2"]
    assert '"' not in link and " " not in link, "quotes or spaces would end the link in a terminal"


def test_open_command_names_the_server_page_or_the_command_that_serves_a_local_store():
    page = ui.run_page("1", "abc")
    assert ui.open_command("http://tracking:5000/", page) == f"http://tracking:5000/{page}"
    local = ui.open_command("sqlite:///mlflow.db", page)
    assert local.startswith("mlflow ui --backend-store-uri sqlite:///mlflow.db") and local.endswith(f"{ui.LOCAL_UI}/{page}")
    # SQLAlchemy's options after the path would be a glob and a word break to the shell.
    options = ui.open_command("sqlite:///my runs/mlflow.db?timeout=30", page)
    assert shlex.split(options.split(",")[0])[-1] == "sqlite:///my runs/mlflow.db?timeout=30"


def run_ui(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddlx.ui", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr


@pytest.mark.integration
def test_a_missing_store_is_refused_in_one_line(tmp_path):
    uri = f"sqlite:///{tmp_path / 'nothere.db'}"
    err = one_line_error(run_ui("--tracking-uri", uri))
    assert uri in err and "does not exist" in err
    assert not (tmp_path / "nothere.db").exists(), "serving it would have created an empty store"


@pytest.mark.integration
def test_a_file_that_is_not_an_sqlite_database_is_refused_in_one_line(tmp_path):
    (tmp_path / "notes.db").write_text("not a database\n")
    err = one_line_error(run_ui("--tracking-uri", f"sqlite:///{tmp_path / 'notes.db'}"))
    assert str(tmp_path / "notes.db") in err and "not an SQLite database" in err


def test_an_sqlite_database_that_is_no_mlflow_store_is_refused_and_left_alone(tmp_path, capsys):
    import sqlite3

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("create table notes (text)")
    assert ui.main(["--tracking-uri", f"sqlite:///{path}"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "no MLflow store" in err
    with sqlite3.connect(path) as db:
        assert [name for (name,) in db.execute("select name from sqlite_master")] == ["notes"], "MLflow added its tables"


def test_a_port_in_use_is_refused_in_one_line_before_mlflow_starts(tracking_uri, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert ui.main(["--tracking-uri", tracking_uri, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "taken" in err and len(err.strip().splitlines()) == 1


def test_a_port_out_of_range_is_refused_by_argparse_in_one_line(tracking_uri, capsys):
    for bad in ("99999", "0", "abc"):
        with pytest.raises(SystemExit) as stop:
            ui.main(["--tracking-uri", tracking_uri, "--port", bad])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --port: {bad!r} is not a port" in err and "Traceback" not in err


def test_the_links_are_the_runs_tables_of_experiments_with_runs(tracking_uri):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    used = client.create_experiment("ddlx")
    client.create_experiment("empty")
    client.create_run(used, run_name="sequential threads=1")
    links = dict(ui.experiment_links(tracking_uri))
    assert links == {"ddlx": ui.experiment_page(used)}, "not the empty experiment, nor Default"


# ---- slow: the served UI ---------------------------------------------------------------------


def made_store(tracking_uri: str) -> list[str]:
    """An experiment ddlx with two named runs, as train.py leaves them; their names."""
    from mlflow.tracking import MlflowClient

    from ddlx.tracking import EXPERIMENT_KIND, MODEL_TRAINING

    client = MlflowClient(tracking_uri)
    exp = client.create_experiment("ddlx", tags={EXPERIMENT_KIND: MODEL_TRAINING})
    names = ["sequential threads=1 alexnet/firesmall 32px b8", "cpu_mp processes=2 alexnet/firesmall 32px b8"]
    for name in names:
        run = client.create_run(exp, run_name=name)
        client.log_metric(run.info.run_id, "mean_epoch_time_s", 1.0)
        client.set_terminated(run.info.run_id, "FINISHED")
    return names


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_the_ui_serves_the_store_and_ctrl_c_ends_its_server(tracking_uri):
    import urllib.request

    made_store(tracking_uri)
    port = free_port()
    served = subprocess.Popen([sys.executable, "-m", "ddlx.ui", "--tracking-uri", tracking_uri, "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    lines = []
    for line in served.stdout:
        lines.append(line)
        if "Ctrl-C" in line:
            break
    (link,) = [line.split(": ", 1)[1].strip() for line in lines if line.startswith("  ddlx: ")]
    assert link == f"http://127.0.0.1:{port}/{ui.experiment_page('1')}"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as answer:
        assert answer.status == 200
    server_group = int(subprocess.run(["pgrep", "-P", str(served.pid)], capture_output=True, text=True).stdout.split()[0])
    served.send_signal(signal.SIGINT)
    assert served.wait(timeout=60) == 0
    assert not group_alive(server_group), "mlflow ui or one of its workers outlived ddlx.ui"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_fresh_browser_lands_on_the_runs_from_every_link(tracking_uri, tmp_path):
    """tools/mlflow_ui_screenshots.py opens ddlx.ui's experiment link, a run's link and the compare
    link, each in Chromium with a new profile, and fails unless each shows a run's name."""
    if not Path("/usr/bin/chromium").exists() or shutil.which("chromium") is None:
        pytest.skip("no /usr/bin/chromium (apt-get install -y chromium)")
    pytest.importorskip("playwright", reason="no playwright (pip install playwright; Debian's chromium, no 'playwright install')")
    made_store(tracking_uri)
    done = subprocess.run([sys.executable, "tools/mlflow_ui_screenshots.py", "--tracking-uri", tracking_uri,
                           "--out", str(tmp_path / "shots")], capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in (tmp_path / "shots").iterdir()} == {
        "mlflow_experiment_page.png", "mlflow_run_page.png", "mlflow_compare.png"}
