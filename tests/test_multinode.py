"""ddlx across several hosts, as a user runs it across machines: ``mpirun`` with a host file over
network namespaces on one machine (tests/netns_cluster.py), each namespace a node with its own
host name and address. The ranks can only meet over the nodes' addresses: a node's loopback
reaches no other node."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PROJECT_DIR, runs, subprocess_env
from netns_cluster import Cluster, mpirun, unavailable
from test_strategies import SAME_MATHS, _assert_same_weights, _mpi_available, final_weights, sequential_weights, shared_data  # noqa: F401


def _missing() -> str | None:
    return _mpi_available() or unavailable()


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
    # Default suite: mpirun starts ranks across hosts in test_a_rank_or_node_lost_mid_epoch (rank_crashed), and MPI
    # ranks on two nodes train the sequential maths in test_slurm.py's two_nodes_mpi requeue.
    "sequential": pytest.param((1, []), marks=pytest.mark.slow),
    "threads": pytest.param((1, ["strategy.local=threads", "strategy.threads=2"]), marks=pytest.mark.slow),
    "split": pytest.param((1, ["strategy.local=split"]), marks=pytest.mark.slow),
    "pipe": pytest.param((1, ["strategy.local=pipe", "strategy.chunks=2"]), marks=pytest.mark.slow),
    # A two-stage PyTorch pipeline on each node, the two pipelines averaging across the nodes.
    "pipe_torch": pytest.param((2, ["strategy.local=pipe", "strategy.engine=torch", "strategy.schedule=1f1b",
                                    "strategy.chunks=2"]), marks=pytest.mark.slow),
}


@pytest.mark.integration
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


@pytest.mark.slow  # DDP-family ranks across nodes, as test_slurm.py's HSDP under srun (slow too); the default suite: MPI's
def test_torchrun_across_hosts_trains_ddp_with_a_rank_on_each(cluster, tmp_path, shared_data, sequential_weights):  # noqa: F811
    """``torchrun --nnodes=2`` on each node, as a user starts it on two machines: Lightning takes
    torchrun's ranks, one per node, and the job is ``ddp_gloo`` with 2 processes over 2 nodes."""
    first = cluster.hosts[0]
    agents = [subprocess.Popen(cluster.command(host, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={i}",
        f"--master-addr={first}", "--master-port=29400",
        *_train_argv(tmp_path, "strategy=ddp_gloo", "strategy.processes=2", f"paths.data_dir={shared_data}", *SAME_MATHS)[1:]]),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=tmp_path)
        for i, host in enumerate(cluster.hosts)]
    try:
        errors = [agent.communicate(timeout=300)[1] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    _assert_same_weights(final_weights(tmp_path), sequential_weights, exact=False)
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FINISHED" and run.data.tags["host"] == first, "rank 0 logs, on the first node"
    assert (run.data.tags["nodes"], run.data.tags["processes"]) == ("2", "2")
    assert not any(cluster.pids(host) for host in cluster.hosts), "every rank and agent exited"


@pytest.mark.integration
@pytest.mark.parametrize("how", ["rank_crashed", pytest.param("node_lost", marks=pytest.mark.slow)])
def test_a_rank_or_node_lost_mid_epoch_ends_every_rank_and_fails_the_run(how, cluster, tmp_path, shared_data):  # noqa: F811
    """rank_crashed: the second node's rank dies (its kernel closes its connections, its daemon
    tells mpirun); node_lost: the machine dies, its cable first, so nothing at all reaches the
    others and only ``strategy.timeout_s`` ends their wait."""
    timeout_s, (first, second) = 20, cluster.hosts
    rank = f"{sys.executable} {PROJECT_DIR / 'train.py'}"  # a rank's command line (not mpirun's, which names it too)
    argv = [*mpirun(cluster, 2, 1, cluster.hostfile(tmp_path / "hosts", 1)),
            *_train_argv(tmp_path, "strategy=mpi", f"strategy.timeout_s={timeout_s}", f"paths.data_dir={shared_data}", *SAME_MATHS,
                         "trainer.max_epochs=1000", "trainer.limit_train_batches=1.0")]
    job = subprocess.Popen(cluster.command(first, argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env=subprocess_env(), cwd=tmp_path)
    try:
        _wait_for_training(tmp_path, timeout=180)
        if how == "node_lost":
            cluster.unplug(second)
        assert cluster.kill(second, None if how == "node_lost" else rank), "the second node ran the other rank"
        start = time.monotonic()
        while cluster.pids(first, rank) and time.monotonic() - start < timeout_s + 60:
            time.sleep(0.5)
        took = time.monotonic() - start
        assert not cluster.pids(first, rank), f"rank 0 still running {took:.0f} s after the loss"
        assert took < timeout_s + 30, f"the surviving rank took {took:.0f} s to stop"
        if how == "rank_crashed":  # mpirun heard of it from the node's daemon, and ends by itself
            job.wait(timeout=60)
            assert job.returncode != 0
            time.sleep(1)
            assert not cluster.pids(first) and not cluster.pids(second), "no rank or daemon left on either node"
            said = job.stderr.read()
            assert "Traceback" not in said, said[-3000:]  # gloo's lost connection, said in one line
            assert re.search(r"ddlx: error: rank 0 lost another rank of the job \(.*Connection (closed|reset) by peer", said), said
            resume = re.search(r"ddlx: resume under mpirun with 2 processes on 2 nodes, as this job was started, with: "
                               r"python train.py .* (ckpt_path=\S+)", said)
            assert resume, said
            # The same command without mpirun would go on as one rank, timing the run's epochs on two layouts.
            alone = subprocess.run([*_train_argv(tmp_path, *argv[argv.index("strategy=mpi"):]), resume[1]], env=subprocess_env(),
                                   capture_output=True, text=True, timeout=120, cwd=tmp_path)
            assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr[-2000:]
            assert re.search(r"ddlx: error: ckpt_path=\S+ was written by a run of ranks=2, nodes=2 \(now ranks=1, nodes=1\): "
                             r"a resumed run keeps the ranks and nodes it was started with", alone.stderr), alone.stderr
        # node_lost: mpirun waits for its session to the lost node, as it would over ssh (docs/multi-node.md).
    finally:
        if job.poll() is None:
            cluster.kill(first)
            job.wait(timeout=30)
        cluster.plug(second)
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FAILED", run.info.status
    error = run.data.tags["error"]
    if how == "rank_crashed":
        assert cluster.addresses[1] in error, "the reason names the lost peer, reached over its own address"
    else:
        # Where it waited depends on the step the cable was pulled in (backward for DDP's gradients,
        # a gather of the epoch's metrics or the checkpoint's); gloo's own words say it timed out.
        waited = re.search(r"rank 0 waited strategy\.timeout_s in \w+ \(from [\w.]+:\d+\) and no other rank answered "
                           r"\((.*?)\): ", error)
        assert waited and "timed out" in waited.group(1).lower(), error


def _wait_for_training(workdir: Path, timeout: float) -> None:
    """Until the run has logged a training epoch (both ranks are past their first collectives);
    the store is read only once rank 0 has opened its run (its first contact migrates the schema)."""
    log, deadline = workdir / "run" / "train.log", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and "MLflow run" in log.read_text(errors="replace"):
            found = runs(f"sqlite:///{workdir / 'mlflow.db'}")
            if found and any(key.startswith("train_loss") for key in found[0].data.metrics):
                return
        time.sleep(1)
    raise AssertionError("the job never logged a training epoch")


@pytest.mark.slow
def test_rank_0_logs_to_an_mlflow_server_on_another_node(cluster, tmp_path, shared_data, sequential_weights):  # noqa: F811
    """The store as a server every node reaches over the network (the nodes need not share the
    project folder for it): ``mlflow server`` on the second node, the job started on the first."""
    port, server_host = 5077, cluster.hosts[1]
    uri = f"http://{cluster.addresses[1]}:{port}"
    store = tmp_path / "server.db"
    server = subprocess.Popen(cluster.command(server_host, [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store}", "--host", cluster.addresses[1],
        "--port", str(port), "--artifacts-destination", str(tmp_path / "server-artifacts"), "--workers", "1"]),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=tmp_path)
    try:
        probe = [sys.executable, "-c", f"import urllib.request as u; u.urlopen('{uri}/health', timeout=2)"]
        deadline = time.monotonic() + 120
        while subprocess.run(cluster.command(cluster.hosts[0], probe), capture_output=True).returncode:
            assert server.poll() is None and time.monotonic() < deadline, "the MLflow server never answered"
            time.sleep(1)
        proc = _on_first_node(cluster, tmp_path, 2, 1, "strategy=mpi", f"logger.tracking_uri={uri}",
                              f"paths.data_dir={shared_data}", *SAME_MATHS)
        assert proc.returncode == 0, proc.stderr[-4000:]
    finally:
        cluster.kill(server_host, sys.executable)
        server.wait(timeout=30)
    _assert_same_weights(final_weights(tmp_path), sequential_weights, exact=False)
    assert not (tmp_path / "mlflow.db").exists(), "nothing logged to the shared folder's default store"
    (run,) = runs(f"sqlite:///{store}")
    assert run.info.status == "FINISHED" and run.data.tags["nodes"] == "2"


@pytest.mark.slow
def test_a_node_that_composes_another_job_is_refused_by_every_rank(cluster, tmp_path, shared_data):  # noqa: F811
    """The second node runs the command with another value (as from another copy of the project):
    every rank refuses before training, naming the value and the node, and the run is FAILED."""
    first = _train_argv(tmp_path, "strategy=mpi", f"paths.data_dir={shared_data}", *SAME_MATHS)
    argv = [*mpirun(cluster, 1, 1, cluster.hostfile(tmp_path / "hosts", 1)), *first, ":", "-np", "1", *first, "optim.lr=0.02"]
    proc = subprocess.run(cluster.command(cluster.hosts[0], argv), capture_output=True, text=True, timeout=300,
                          env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode != 0
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith("RanksDisagree")
    assert f"rank 1 ({cluster.hosts[1]}): optim.lr=0.02" in run.data.tags["error"]
    assert "Traceback" not in proc.stderr
    assert not any(cluster.pids(host) for host in cluster.hosts), "every rank and daemon exited"
