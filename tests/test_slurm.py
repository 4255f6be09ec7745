"""ddlx under SLURM, as a cluster user runs it: ``srun`` and ``sbatch`` on a local cluster
(tests/slurm_cluster.py: one controller, one node daemon on this machine), a job warned of its
end that checkpoints, is requeued and resumes into the same MLflow run, and a Hydra sweep
through the submitit launcher, one SLURM job and one MLflow run per sweep job."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROJECT_DIR, runs, subprocess_env
from netns_cluster import Cluster
from netns_cluster import unavailable as netns_unavailable
from slurm_cluster import LocalSlurm, unavailable, wait_until
from test_strategies import (  # noqa: F401
    SAME_MATHS,
    _assert_same_weights,
    _mpi_available,
    final_weights,
    sequential_weights,
    shared_data,
    train_here,
)

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

TRAIN = [sys.executable, str(PROJECT_DIR / "train.py")]
# Long enough to be signalled mid-training (in its second epoch): 6 epochs of 4 steps.
EPOCHS = 6
LONG = [o for o in SAME_MATHS if not o.startswith(("trainer.max_epochs", "trainer.limit_train_batches"))] + \
       [f"trainer.max_epochs={EPOCHS}"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with LocalSlurm(tmp_path_factory.mktemp("slurm"), cpus=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """The cluster over two namespace hosts (tests/netns_cluster.py): the controller and the
    clients on the first, a node daemon on each; the ranks meet over the hosts' addresses."""
    if netns_unavailable() or _mpi_available():
        pytest.skip(netns_unavailable() or _mpi_available())
    with Cluster(2, net=79) as hosts, LocalSlurm(tmp_path_factory.mktemp("slurm2"), cpus=2, hosts=hosts) as cluster:
        yield cluster


# Open MPI's TCP traffic on the hosts' own interface (each host also has a loopback).
OVER_ETH0 = {"OMPI_MCA_btl": "self,tcp", "OMPI_MCA_btl_tcp_if_include": "eth0", "OMPI_MCA_oob_tcp_if_include": "eth0"}


def _sbatch(slurm: LocalSlurm, workdir: Path, options: list[str], lines: list[str], env: dict | None = None) -> str:
    """Submit a batch script, as a user writes one (the job gets ``env``); returns the job id."""
    script = workdir / "job.sh"
    script.write_text("#!/bin/bash\n" + "".join(f"#SBATCH {o}\n" for o in options) + "\n".join(lines) + "\n")
    return slurm.run("sbatch", "--parsable", f"--output={workdir}/slurm-%j.out", "--open-mode=append",
                     f"--chdir={workdir}", str(script), env=slurm.env(env or subprocess_env())).stdout.strip()


def _command(*argv: str) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("model.")}


def _only_run(workdir: Path):
    (run,) = runs(f"sqlite:///{workdir / 'mlflow.db'}")
    return run


def _job_log(workdir: Path, job: str) -> str:
    return (workdir / f"slurm-{job}.out").read_text(errors="replace")


@pytest.mark.slow  # the default suite runs MPI ranks from srun across two nodes (the warned job)
def test_srun_starts_the_mpi_ranks(slurm, tmp_path, shared_data, sequential_weights):  # noqa: F811
    """Two tasks of one job step are the two ranks of ``strategy=mpi`` (PMIx gives them MPI)."""
    if _mpi_available():
        pytest.skip(_mpi_available())
    proc = slurm.run("srun", "--ntasks=2", "--mpi=pmix", *TRAIN, f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path}/run",
                     f"paths.data_dir={shared_data}", "strategy=mpi", *SAME_MATHS, check=False, timeout=240,
                     env=slurm.env(subprocess_env()), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = _only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.tags["strategy"] == "mpi"
    assert run.data.tags["slurm_job_id"].isdigit()
    _assert_same_weights(final_weights(tmp_path), sequential_weights, exact=False)


@pytest.mark.slow  # as the warned job's two starts in the default suite, with a check of the nodes
def test_srun_across_two_nodes_starts_one_mpi_rank_on_each(two_nodes, tmp_path, shared_data, sequential_weights):  # noqa: F811
    proc = two_nodes.run("srun", "--nodes=2", "--ntasks-per-node=1", "--mpi=pmix", *TRAIN, f"paths.root={tmp_path}",
                         f"hydra.run.dir={tmp_path}/run", f"paths.data_dir={shared_data}", "strategy=mpi", *SAME_MATHS,
                         check=False, timeout=240, env=two_nodes.env({**subprocess_env(), **OVER_ETH0}), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = _only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.tags["nodes"] == "2"
    assert run.data.tags["host"] == two_nodes.nodes[0], "rank 0 logs, on the first node"
    _assert_same_weights(final_weights(tmp_path), sequential_weights, exact=False)


@pytest.mark.slow  # 35 s; the default suite runs HSDP's mesh on one machine (test_strategies.py, fsdp_hybrid)
def test_srun_across_two_nodes_runs_hsdp_with_a_shard_group_per_node(  # noqa: F811
        two_nodes, tmp_path, shared_data, sequential_weights):  # noqa: F811
    """``fsdp sharding=hybrid`` as it is meant to run: 2 nodes x 2 tasks, the weights sharded
    inside each node's group, the gradients averaged across the nodes; Lightning's SLURM
    environment gives each task its rank, and the mesh is (2 nodes, 2 per node)."""
    proc = two_nodes.run("srun", "--nodes=2", "--ntasks-per-node=2", *TRAIN, f"paths.root={tmp_path}",
                         f"hydra.run.dir={tmp_path}/run", f"paths.data_dir={shared_data}", "strategy=fsdp",
                         "strategy.processes=4", "strategy.sharding=hybrid", *SAME_MATHS, check=False, timeout=300,
                         env=two_nodes.env(subprocess_env()), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = _only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.tags["host"] == two_nodes.nodes[0]
    assert (run.data.tags["nodes"], run.data.tags["shard_size"], run.data.params["strategy.processes"]) == ("2", "2", "4")
    output = proc.stderr + proc.stdout
    assert "GLOBAL_RANK: 0, MEMBER: 1/4" in output and "sharding=hybrid over a device mesh of (2, 2)" in output
    assert "MEMBER: 4/4" not in output, "rank 0 speaks for the job"
    _assert_same_weights(final_weights(tmp_path), sequential_weights, exact=False)


@pytest.mark.integration
def test_a_rank_that_refuses_its_job_alone_ends_every_rank(slurm, tmp_path, shared_data):  # noqa: F811
    """One task cannot see the data (``data.root`` missing on its node): it refuses before joining
    MPI, and srun, unlike mpirun, leaves the other task waiting in MPI for it. The refusing rank
    joins MPI to abort the job, so srun ends at once instead of hanging."""
    if _mpi_available():
        pytest.skip(_mpi_available())
    command = _command(*TRAIN, f"paths.root={tmp_path}", f"paths.data_dir={shared_data}", "strategy=mpi", *SAME_MATHS)
    script = f'if [ "$SLURM_PROCID" = 1 ]; then exec {command} data.root={tmp_path}/not-here; fi; exec {command}'
    proc = slurm.run("srun", "--ntasks=2", "--mpi=pmix", "sh", "-c", script, check=False, timeout=180,
                     env=slurm.env(subprocess_env()), cwd=tmp_path)
    assert proc.returncode != 0
    assert f"data.root={tmp_path}/not-here does not exist" in proc.stderr
    assert all(r.info.status != "RUNNING" for r in runs(f"sqlite:///{tmp_path / 'mlflow.db'}"))


DDP_LAUNCHES = {
    # how the batch script starts train.py: (sbatch options, the command's prefix)
    "batch_script": (["--ntasks=2"], []),  # the script's own process: ddlx starts the second rank
    "one_task": pytest.param((["--ntasks=1", "--cpus-per-task=2"], ["srun"]), marks=pytest.mark.slow),
    "tasks_are_ranks": pytest.param((["--ntasks-per-node=2"], ["srun"]), marks=pytest.mark.slow),  # Lightning's way
}


@pytest.mark.integration
@pytest.mark.parametrize("launch", list(DDP_LAUNCHES.values()), ids=list(DDP_LAUNCHES))
def test_ddp_under_sbatch_trains_with_all_its_processes(launch, slurm, tmp_path, shared_data, sequential_weights):  # noqa: F811
    """Lightning takes SLURM's tasks for the ranks: a one-task step with processes=2 used to train
    alone (recorded as two), and a batch script's own process waited for ranks nobody started."""
    options, prefix = launch
    job = _sbatch(slurm, tmp_path, options, [_command(*prefix, *TRAIN, f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path}/run",
                                                      f"paths.data_dir={shared_data}", "strategy=ddp_gloo",
                                                      "strategy.processes=2", *SAME_MATHS)])
    fields = slurm.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=240)
    assert fields["JobState"] == "COMPLETED", _job_log(tmp_path, job)[-4000:]
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in _job_log(tmp_path, job), "a world of two processes"
    run = _only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.tags["slurm_job_id"] == job
    _assert_same_weights(final_weights(tmp_path), sequential_weights, exact=False)


@pytest.mark.integration
def test_srun_tasks_that_are_not_the_ranks_are_refused(slurm, tmp_path):
    proc = slurm.run("srun", "--ntasks=2", *TRAIN, f"paths.root={tmp_path}", "strategy=ddp_gloo", "strategy.processes=4",
                     *SAME_MATHS, check=False, timeout=120, env=slurm.env(subprocess_env()), cwd=tmp_path)
    assert proc.returncode != 0
    assert "srun started 2 ranks" in proc.stderr and "--ntasks=1" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists() or not runs(f"sqlite:///{tmp_path / 'mlflow.db'}")


def _training(workdir: Path) -> bool:
    """A start's second epoch is under way (its job log is under the run's own folder)."""
    return any("epoch 2/" in log.read_text(errors="replace") for log in workdir.glob("**/train.log"))


def _assert_resumed_run(workdir: Path, job: str, reference: tuple[int, dict], tolerance: dict) -> None:
    run = _only_run(workdir)
    assert run.info.status == "FINISHED"
    assert run.data.tags["slurm_job_id"] == job and run.data.tags["resumes"] == "1"
    assert run.data.metrics["epoch"] == EPOCHS - 1, "the run goes on to its last epoch"
    checkpoint = Path(run.data.tags["resumed_from"])
    assert checkpoint.exists() and not list((workdir / "outputs" / "requeued").glob("*")), "the marker is gone"
    steps, weights = reference
    assert torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"] == steps, "no step lost or repeated"
    got = _weights(checkpoint)
    assert got.keys() == weights.keys()
    for name in weights:  # the same steps on the same samples: equal up to float summation order
        torch.testing.assert_close(got[name], weights[name], msg=name, **tolerance)


@pytest.fixture(scope="module")
def uninterrupted_weights(tmp_path_factory, shared_data):  # noqa: F811
    workdir = tmp_path_factory.mktemp("uninterrupted")
    train_here(workdir, "strategy=sequential", "strategy.threads=1", f"paths.data_dir={shared_data}", "checkpoint.save=full",
               *LONG)
    checkpoint = workdir / "run" / "checkpoints" / "last.ckpt"
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"], _weights(checkpoint)


# Against one uninterrupted sequential run: the same process, bit for bit up to the order of float
# sums; two ranks averaging gradients drift from it by a few 1e-5 over the 48 steps (a lost or
# repeated step, checked apart, moves the weights far more).
SAME_PROCESS, TWO_RANKS = {"rtol": 1e-4, "atol": 1e-6}, {"rtol": 0.0, "atol": 2e-4}
WARNED = {
    # (cluster fixture, sbatch options, the command's prefix, strategy, tolerance)
    "two_nodes_mpi": ("two_nodes", ["--nodes=2", "--ntasks-per-node=1"], ["srun", "--mpi=pmix"], ["strategy=mpi"],
                      TWO_RANKS),
    "one_node": pytest.param(("slurm", ["--ntasks=1", "--cpus-per-task=1"], ["srun"],
                              ["strategy=sequential", "strategy.threads=1"], SAME_PROCESS), marks=pytest.mark.slow),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", list(WARNED.values()), ids=list(WARNED))
def test_a_job_warned_of_its_end_is_requeued_and_resumes_its_run(case, request, tmp_path, shared_data,  # noqa: F811
                                                                 uninterrupted_weights):
    """``sbatch --signal=USR1@90 --requeue``: the warning (sent here with scancel --signal, as
    SLURM sends it 90 s before the time limit, to every task on every node) stops training after
    a step with a checkpoint, the job requeues itself, and its second start resumes the same run to
    the end, every rank from the marker, with the weights an uninterrupted run ends with."""
    fixture, options, prefix, strategy, tolerance = case
    slurm = request.getfixturevalue(fixture)
    env = {**subprocess_env(), **(OVER_ETH0 if slurm.hosts is not None else {})}
    job = _sbatch(slurm, tmp_path, [*options, "--requeue", "--signal=USR1@90"],
                  [_command(*prefix, *TRAIN, f"paths.root={tmp_path}", f"paths.data_dir={shared_data}", *strategy,
                            "checkpoint.save=full", *LONG)], env)
    # Its second epoch: a start of two ranks over MPI took over 120 s beside a busy neighbour once.
    wait_until(lambda: _training(tmp_path), 240, "the job did not start training", log=tmp_path / f"slurm-{job}.out")
    slurm.run("scancel", "--signal=USR1", job)
    fields = slurm.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED"), timeout=240)
    log = _job_log(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", log[-4000:]
    assert f"requeueing SLURM job {job}" in log and f"SLURM job {job} was requeued: resuming from" in log
    _assert_resumed_run(tmp_path, job, uninterrupted_weights, tolerance)


def _submitit_missing() -> str | None:
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    except ImportError:
        return "hydra-submitit-launcher is not installed (pip install -e '.[slurm]')"
    return None


def _sweep(slurm: LocalSlurm, workdir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([*TRAIN, "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=main",
                             "hydra.launcher.timeout_min=10", f"paths.root={workdir}", *overrides],
                            env=slurm.env(subprocess_env()), cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.integration
@pytest.mark.skipif(_submitit_missing() is not None, reason=str(_submitit_missing()))
def test_a_sweep_through_submitit_is_one_slurm_job_and_one_run_per_job(slurm, tmp_path, shared_data):  # noqa: F811
    sweep = _sweep(slurm, tmp_path, "hydra.launcher.cpus_per_task=1", f"paths.data_dir={shared_data}",
                   "strategy=sequential,threads", *SAME_MATHS)
    out, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 0, out[-4000:]
    found = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert sorted(r.data.tags["strategy"] for r in found) == ["sequential", "threads"]
    assert all(r.info.status == "FINISHED" for r in found)
    assert len({r.data.tags["slurm_job_id"] for r in found}) == 2, "each sweep job is its own SLURM job"
    assert sorted(r.data.tags.get("swept") for r in found) == ["strategy=sequential", "strategy=threads"], \
        "each run knows what its sweep varies, though its process has submitit's command line"
    # Every job's folder in the one sweep folder the launcher made (each job resolves the config again).
    (sweep_dir,) = (tmp_path / "multirun").glob("*/*")
    assert {r.data.tags["sweep_id"] for r in found} == {str(sweep_dir.relative_to(tmp_path))}
    assert {r.data.tags["output_dir"] for r in found} == {str(sweep_dir / "0"), str(sweep_dir / "1")}


@pytest.mark.slow
@pytest.mark.skipif(_submitit_missing() is not None, reason=str(_submitit_missing()))
def test_a_submitit_job_warned_of_its_end_is_requeued_and_resumes_its_run(slurm, tmp_path, shared_data,  # noqa: F811
                                                                         uninterrupted_weights):
    """submitit's warning is USR2 (its --signal=USR2@signal_delay_s)."""
    sweep = _sweep(slurm, tmp_path, "hydra.launcher.cpus_per_task=1", "+hydra.launcher.additional_parameters.requeue=true",
                   f"paths.data_dir={shared_data}", "strategy=sequential", "strategy.threads=1", "checkpoint.save=full", *LONG)
    try:
        wait_until(lambda: _training(tmp_path), 120, "the job did not start training")
        (job,) = slurm.run("squeue", "--noheader", "--format=%i").stdout.split()
        slurm.run("scancel", "--signal=USR2", job)
        out, _ = sweep.communicate(timeout=300)
    finally:
        sweep.kill()
    assert sweep.returncode == 0, out[-4000:]
    assert slurm.job_state(job)["Restarts"] == "1"
    _assert_resumed_run(tmp_path, job, uninterrupted_weights, SAME_PROCESS)
