"""ddlx across several hosts, as a user runs it across machines: ``mpirun`` with a host file over
network namespaces on one machine (tests/netns_cluster.py), each namespace a node with its own
host name and address. The ranks can only meet over the nodes' addresses: a node's loopback
reaches no other node."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import PROJECT_DIR, runs, subprocess_env
from netns_cluster import Cluster, mpirun, unavailable
from test_strategies import SAME_MATHS, _assert_same_weights, final_weights, sequential_weights, shared_data  # noqa: F401


def _missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "OpenMPI's mpirun is not installed (apt-get install -y openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    return unavailable()


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2) as made:
        yield made


def _train_argv(workdir: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(PROJECT_DIR / "train.py"), f"paths.root={workdir}", f"hydra.run.dir={workdir}/run", *overrides]


def _on_first_node(cluster: Cluster, workdir: Path, ranks: int, per_node: int, *overrides: str, timeout: float = 300):
    """``mpirun`` started on the first node, as a user would on the cluster's login or first node."""
    argv = [*mpirun(cluster, ranks, per_node, cluster.hostfile(workdir / "hosts", per_node)), *_train_argv(workdir, *overrides)]
    return subprocess.run(cluster.command(cluster.hosts[0], argv), capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(), cwd=workdir)


CASES = {
    # name: (ranks per node, overrides)
    "sequential": (1, []),
    "threads": pytest.param((1, ["strategy.local=threads", "strategy.threads=2"]), marks=pytest.mark.slow),
    "split": pytest.param((1, ["strategy.local=split"]), marks=pytest.mark.slow),
    "pipe": pytest.param((1, ["strategy.local=pipe", "strategy.chunks=2"]), marks=pytest.mark.slow),
    # A two-stage PyTorch pipeline on each node, the two pipelines averaging across the nodes.
    "pipe_torch": pytest.param((2, ["strategy.local=pipe", "strategy.engine=torch", "strategy.schedule=1f1b",
                                    "strategy.chunks=2"]), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_mpi_across_hosts_matches_sequential(case, cluster, tmp_path, shared_data, sequential_weights):  # noqa: F811
    per_node, overrides = case
    proc = _on_first_node(cluster, tmp_path, 2 * per_node, per_node, "strategy=mpi", f"paths.data_dir={shared_data}",
                          *SAME_MATHS, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_same_weights(final_weights(tmp_path), sequential_weights, exact=False)
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FINISHED"
    assert (run.data.tags["nodes"], run.data.tags["ranks"]) == ("2", str(2 * per_node))
    assert run.data.tags["host"] == cluster.hosts[0], "rank 0 logs, on the first node"
    assert not any(cluster.pids(host) for host in cluster.hosts), "every rank and daemon exited"


def test_a_node_killed_mid_epoch_ends_every_rank_and_fails_the_run(cluster, tmp_path, shared_data):  # noqa: F811
    timeout_s = 20
    argv = [*mpirun(cluster, 2, 1, cluster.hostfile(tmp_path / "hosts", 1)),
            *_train_argv(tmp_path, "strategy=mpi", f"strategy.timeout_s={timeout_s}", f"paths.data_dir={shared_data}", *SAME_MATHS,
                         "trainer.max_epochs=1000", "trainer.limit_train_batches=1.0")]
    job = subprocess.Popen(cluster.command(cluster.hosts[0], argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env=subprocess_env(), cwd=tmp_path)
    try:
        _wait_for_training(tmp_path, timeout=180)
        assert cluster.kill(cluster.hosts[1]), "the second node ran the other rank"
        start = time.monotonic()
        job.wait(timeout=timeout_s + 90)
        took = time.monotonic() - start
    finally:
        if job.poll() is None:
            job.kill()
            cluster.kill(cluster.hosts[0])
    assert job.returncode != 0
    assert took < timeout_s + 60, f"the surviving rank took {took:.0f} s to stop"
    time.sleep(1)
    assert not cluster.pids(cluster.hosts[0]), "no rank or daemon left on the surviving node"
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FAILED", run.info.status
    assert run.data.tags.get("error"), "the run says why it failed"


def _wait_for_training(workdir: Path, timeout: float) -> None:
    """Until the run has logged a training step (both ranks are past their first collective)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = runs(f"sqlite:///{workdir / 'mlflow.db'}") if (workdir / "mlflow.db").exists() else []
        if found and any(key.startswith("train_loss") for key in found[0].data.metrics):
            return
        time.sleep(1)
    raise AssertionError("the job never logged a training step")
