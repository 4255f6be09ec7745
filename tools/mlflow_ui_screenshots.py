"""Screenshots of the MLflow UI as a person sees ddlx's runs: the experiment's runs table, one
run's page and the compare view of all its runs, taken by headless Chromium (Playwright) from
``mlflow ui`` on localhost.

    apt-get install -y chromium && pip install playwright
    python tools/mlflow_ui_screenshots.py --tracking-uri sqlite:///mlflow.db --out screenshots/
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

# MLflow 3's UI shows its GenAI pages or its model-training pages by this setting of the browser's,
# which a link can set.
ML = "workflowType=machine_learning"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"mlflow ui did not answer at {url} within {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    parser.add_argument("--experiment", default="ddlx")
    parser.add_argument("--out", type=Path, default=Path("screenshots"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()

    from mlflow.tracking import MlflowClient
    from playwright.sync_api import sync_playwright

    client = MlflowClient(args.tracking_uri)
    exp = client.get_experiment_by_name(args.experiment)
    if exp is None:
        raise SystemExit(f"no experiment {args.experiment!r} in {args.tracking_uri}")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    if not runs:
        raise SystemExit(f"experiment {args.experiment!r} has no runs")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", args.tracking_uri,
                               "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        wait_for(base)
        ids = ",".join(f'"{r.info.run_id}"' for r in runs)
        pages = {
            # The experiment's own address: where the UI lands when a person opens it.
            "experiment": f"{base}/#/experiments/{exp.experiment_id}",
            "runs_table": f"{base}/#/experiments/{exp.experiment_id}/runs?{ML}",
            "run_page": f"{base}/#/experiments/{exp.experiment_id}/runs/{runs[0].info.run_id}?{ML}",
            "compare": f"{base}/#/compare-runs?runs=[{ids}]&experiments=[\"{exp.experiment_id}\"]&{ML}",
        }
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            for name, url in pages.items():
                page.goto(url)
                page.wait_for_load_state("load")
                time.sleep(6)  # the UI renders its tables after the data arrives (it polls: never network-idle)
                path = args.out / f"{name}.png"
                page.screenshot(path=str(path), full_page=False)
                print(f"{name}: {page.url} -> {path}")
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
