"""The MLflow UI on a store, at its model-training view: ``python -m ddlx.ui [--tracking-uri
sqlite:///mlflow.db] [--port 5000] [--browser]`` serves the store with ``mlflow ui`` and prints
each experiment's runs table; Ctrl-C ends it. Also the links to the UI's pages that ddlx prints.

MLflow 3's UI shows its GenAI pages unless told otherwise: it keeps the view in the browser
(local storage ``mlflow.workflowType``, GenAI when unset) and takes a ``?workflowType=`` in the
page's address over it; 3.17 reads the experiment's ``mlflow.experimentKind`` tag only with
that switch turned off, and it is on. A link without the parameter opens, from a fresh
browser, an empty GenAI overview; every link ddlx prints carries it (:func:`page`).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import quote

from .errors import StoreError

ML_VIEW = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # where ``mlflow ui`` serves by default
START_TIMEOUT_S = 120.0  # mlflow ui starts in 10-20 s on a busy 2-core machine


# ---- links -------------------------------------------------------------------------------


def page(route: str, **query: str) -> str:
    """The UI's address of ``route`` (``experiments/1/runs``), on the model-training view. The UI
    routes by the part after ``#``, so its parameters go there. Values are percent-encoded: the
    compare page's JSON lists would otherwise end the link early in a terminal."""
    params = "".join(f"{key}={quote(value, safe='')}&" for key, value in query.items())
    return f"#/{route}?{params}{ML_VIEW}"


def run_page(experiment_id: str | None, run_id: str) -> str:
    return page(f"experiments/{experiment_id}/runs/{run_id}")


def experiment_page(experiment_id: str) -> str:
    """The experiment's runs table (``experiments/ID`` alone lands on the view's first tab)."""
    return page(f"experiments/{experiment_id}/runs")


def compare_page(experiment_ids: list[str], run_ids: list[str]) -> str:
    # The compare page reads ``runs`` as the first parameter, both as JSON lists.
    compact = {"separators": (",", ":")}
    return page("compare-runs", runs=json.dumps(run_ids, **compact), experiments=json.dumps(experiment_ids, **compact))


def is_server(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


def open_command(tracking_uri: str, link: str) -> str:
    """How a person opens ``link`` (a :func:`page`): the page on the server, or the command that
    serves a local store and the page there."""
    if is_server(tracking_uri):
        return f"{tracking_uri.rstrip('/')}/{link}"
    # Quoted: SQLAlchemy's options (``?timeout=30``) or a space would be read by the shell.
    return f"mlflow ui --backend-store-uri {shlex.quote(tracking_uri)}, then {LOCAL_UI}/{link}"


def logged_as(tracking_uri: str, experiment: str, experiment_id: str, run_id: str) -> str:
    """The line that says where a result was recorded (a report, a recommendation) and how to open it."""
    return f"logged as MLflow run {run_id} in experiment '{experiment}': {open_command(tracking_uri, run_page(experiment_id, run_id))}"


# ---- serving a store ----------------------------------------------------------------------


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; expected a number in 1-65535, e.g. --port 5000")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ddlx.ui", description="Serve an MLflow store with mlflow ui, "
                                     "opened at its model-training view, and print each experiment's runs; Ctrl-C ends it.")
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db",
                        help="the MLflow store (default: sqlite:///mlflow.db, train.py's store when run from the project folder)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to serve on (default: 127.0.0.1; from another machine: ssh -L 5000:127.0.0.1:5000 HOST)")
    parser.add_argument("--port", type=_port, default=5000, help="port to serve on (default: 5000)")
    parser.add_argument("--browser", action="store_true", help="also open the first link in this machine's web browser")
    return parser.parse_args(argv)


def check_store(tracking_uri: str) -> None:
    """A StoreError naming the store when it is an SQLite path with no file (serving it would
    create an empty store there), a file that is not an SQLite database or holds no MLflow store
    (MLflow would add its tables to it), or a server that does not answer."""
    from .tracking import check_tracking_uri, sqlite_path, store_exists

    if not store_exists(tracking_uri):
        raise StoreError(f"no MLflow store at --tracking-uri {tracking_uri} ({sqlite_path(tracking_uri)} does not exist): "
                         f"pass the store train.py wrote (its paths.root/mlflow.db), or train first")
    check_tracking_uri(tracking_uri, setting="--tracking-uri", write=False)  # (to look at runs is to read them)


def experiment_links(tracking_uri: str) -> list[tuple[str, str]]:
    """(name, runs-table link) of each experiment with runs, oldest first (ddlx's training runs
    before the reports made from them); the experiments list if none has any."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from .tracking import store_lock

    try:
        with store_lock(tracking_uri):  # a first contact may create or migrate the schema
            client = MlflowClient(tracking_uri)
            experiments = client.search_experiments(order_by=["creation_time ASC"])
        links = [(e.name, experiment_page(e.experiment_id)) for e in experiments
                 if client.search_runs([e.experiment_id], max_results=1)]
    except MlflowException as err:
        raise StoreError(f"--tracking-uri {tracking_uri} is not an MLflow store MLflow can read: "
                         f"{str(err).splitlines()[0]}") from err
    return links or [("no runs yet; the experiments", page("experiments"))]


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port just freed counts as free
        try:
            s.bind((host, port))
        except OSError as err:
            raise StoreError(f"--port {port} on {host} is taken ({err.strerror}): another mlflow ui? pass another "
                             f"--port, e.g. --port {port + 1}") from err


def start_server(tracking_uri: str, host: str, port: int) -> subprocess.Popen:
    """``mlflow ui`` in a process group of its own: it starts uvicorn and a job runner with its
    own workers, which outlive a signal to ``mlflow ui`` alone; :func:`stop_server` ends the
    group. One worker: it serves one person."""
    return subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri,
                             "--host", host, "--port", str(port), "--workers", "1"], start_new_session=True)


def wait_until_up(server: subprocess.Popen, base: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mlflow ui ended with status {server.returncode} before answering at {base} "
                               f"(its output is above)")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"mlflow ui did not answer at {base} within {timeout_s:.0f} s")


def stop_server(server: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End the server's process group: SIGTERM, which uvicorn and MLflow's job runner take as a
    request to shut down, SIGKILL if it lingers. A second Ctrl-C meanwhile is ignored: it would
    leave the group running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_alive(server):
            break
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace_s
        while _group_alive(server) and time.monotonic() < deadline:
            time.sleep(0.2)
    server.wait()


def _group_alive(server: subprocess.Popen) -> bool:
    server.poll()  # reaps mlflow ui itself, so only living members answer below
    try:
        os.killpg(server.pid, 0)
    except ProcessLookupError:
        return False
    return True


def open_browser(url: str) -> None:
    """Open ``url`` in a graphical browser; a terminal browser (lynx, w3m: what Python finds on a
    machine without a display) would take over this terminal, so none is opened then."""
    import webbrowser

    try:
        browser = webbrowser.get()
    except webbrowser.Error:
        browser = None
    if browser is None or type(browser) is webbrowser.GenericBrowser:
        print(f"ddlx.ui: no graphical web browser on this machine; open {url} in yours", file=sys.stderr)
        return
    browser.open(url)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # a SIGTERM to this command ends the server as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = f"http://{'127.0.0.1' if args.host == '0.0.0.0' else args.host}:{args.port}"
    try:
        check_store(args.tracking_uri)
        if is_server(args.tracking_uri):  # it serves its UI already
            base = args.tracking_uri.rstrip("/")
        else:
            check_port_free(args.host, args.port)
        links = experiment_links(args.tracking_uri)
    except StoreError as err:
        print(f"ddlx.ui: error: {err}", file=sys.stderr)
        return 2
    if is_server(args.tracking_uri):
        _print_links(links, base)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    server = start_server(args.tracking_uri, args.host, args.port)
    try:
        wait_until_up(server, base)
        _print_links(links, base)
        print("ddlx.ui: Ctrl-C ends mlflow ui", flush=True)
        if args.browser:
            open_browser(f"{base}/{links[0][1]}")
        server.wait()
        print(f"ddlx.ui: error: mlflow ui ended with status {server.returncode}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        print(f"ddlx.ui: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nddlx.ui: ending mlflow ui", flush=True)
        return 0
    finally:
        stop_server(server)


def _print_links(links: list[tuple[str, str]], base: str) -> None:
    print("ddlx.ui: the MLflow UI's model-training view of", flush=True)
    for name, link in links:
        print(f"  {name}: {base}/{link}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
