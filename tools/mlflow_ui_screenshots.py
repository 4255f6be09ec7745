"""Screenshots of the MLflow UI as a person opens ddlx's links, each from a fresh browser profile
(MLflow 3 keeps its GenAI/model-training choice in the browser; a fresh one is on GenAI): the
experiment's runs table as ``python -m ddlx.ui`` prints it, the newest run's page as train.py
prints it, and the compare view of the newest runs as ``python -m ddlx.report --sweep-id``
prints it. Each page must show a run's name (the model-training pages), or the tool fails.
Headless Chromium through Playwright, against ``python -m ddlx.ui`` on localhost.

    apt-get install -y chromium && pip install playwright     # no 'playwright install': Debian's chromium
    python tools/mlflow_ui_screenshots.py --tracking-uri sqlite:///mlflow.db --out docs/images
"""
from __future__ import annotations

import argparse
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ddlx, when run from a checkout

from ddlx.ui import compare_page, run_page  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
COMPARED = 4  # runs in the compare view
SHOWN_TIMEOUT_S = 90.0  # the UI fetches its runs after loading; slow on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ui(tracking_uri: str, port: int) -> tuple[subprocess.Popen, dict[str, str]]:
    """``python -m ddlx.ui`` and the links it prints, by experiment name."""
    ui = subprocess.Popen([sys.executable, "-m", "ddlx.ui", "--tracking-uri", tracking_uri, "--port", str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    links = {}
    for line in ui.stdout:
        if match := re.match(r"  (.+): (http://\S+)$", line):
            links[match[1]] = match[2]
        if "Ctrl-C" in line:
            return ui, links
    raise SystemExit(f"python -m ddlx.ui ended with status {ui.wait()} before serving {tracking_uri}")


def stop_ui(ui: subprocess.Popen) -> None:
    ui.send_signal(signal.SIGINT)  # as Ctrl-C: it ends its mlflow ui
    ui.wait(timeout=60)


def pages(tracking_uri: str, experiment: str, base: str, links: dict[str, str]) -> dict[str, tuple[str, str]]:
    """name -> (address, a run name it must show)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None or experiment not in links:
        raise SystemExit(f"no experiment {experiment!r} with runs in {tracking_uri} (python -m ddlx.ui listed {sorted(links)})")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=COMPARED)
    newest = runs[0].info
    return {
        "experiment_page": (links[experiment], newest.run_name),
        "run_page": (f"{base}/{run_page(exp.experiment_id, newest.run_id)}", newest.run_name),
        "compare": (f"{base}/{compare_page([exp.experiment_id], [r.info.run_id for r in runs])}", newest.run_name),
    }


def screenshot(playwright, url: str, shows: str, path: Path, chromium: str) -> None:
    """``url`` in a browser with a new, empty profile; fails unless the page shows ``shows``."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        browser = playwright.chromium.launch_persistent_context(profile, executable_path=chromium, args=CHROMIUM_ARGS,
                                                                headless=True, viewport={"width": 1600, "height": 1000})
        try:
            page = browser.new_page()
            page.goto(url)
            try:
                page.get_by_text(shows).first.wait_for(state="visible", timeout=SHOWN_TIMEOUT_S * 1000)
            except Exception as err:  # Playwright's TimeoutError: keep the page that failed to show the run
                page.screenshot(path=str(path.with_suffix(".failed.png")))
                raise SystemExit(f"{url} did not show run {shows!r} within {SHOWN_TIMEOUT_S:.0f} s (the GenAI pages?); "
                                 f"see {path.with_suffix('.failed.png')}") from err
            if page.get_by_text("MLflow Assistant").first.is_visible():  # its side panel takes a third of the page
                page.get_by_role("button", name="Close", exact=True).first.click()
            time.sleep(2)  # the table's other cells fill in after its first row
            page.screenshot(path=str(path), full_page=False)
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    parser.add_argument("--experiment", default="ddlx")
    parser.add_argument("--out", type=Path, default=Path("screenshots"))
    parser.add_argument("--chromium", default=CHROMIUM)
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    port = free_port()
    ui, links = start_ui(args.tracking_uri, port)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as playwright:
            for name, (url, shows) in pages(args.tracking_uri, args.experiment, f"http://127.0.0.1:{port}", links).items():
                path = args.out / f"mlflow_{name}.png"
                screenshot(playwright, url, shows, path, args.chromium)
                print(f"{name}: {url} shows run {shows!r} -> {path}")
    finally:
        stop_ui(ui)


if __name__ == "__main__":
    main()
