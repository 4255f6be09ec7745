"""Every strategy through the real train.py: same maths as sequential, one MLflow run, clean exit,
clear errors before training."""
from __future__ import annotations

import ast
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import PROJECT_DIR, alive, compose_config, rank_workers, runs, subprocess_env, with_made_store

from ddlx.errors import ConfigError
from ddlx.run import layered_model_meta, train
from ddlx.strategies import build_strategy

# Deterministic steps: fixed order, no flip, no dropout, a BatchNorm-free model (sub-batch
# statistics would legitimately differ), 2 optimizer steps on a global batch of 8.
SAME_MATHS = [
    "model=alexnet", "model.dropout=0", "data.shuffle=false", "data.random_flip=false",
    "data.image_size=32", "data.synthetic_size=[40,64]", "data.num_images=40", "data.batch_size=8",
    "data.num_workers=0", "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "optim.lr=0.01",
]


def train_py(workdir: Path, *overrides: str, timeout: float = 240, runner: list[str] | None = None) -> subprocess.CompletedProcess:
    """``python train.py`` as a user runs it: for what only the entry point shows (sweeps, mpirun, kills).
    Its store is a copy of the session's, its schema made (conftest.with_made_store)."""
    with_made_store(workdir)
    cmd = [*(runner or []), sys.executable, str(PROJECT_DIR / "train.py"), f"paths.root={workdir}", f"hydra.run.dir={workdir}/run", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env(), cwd=workdir)


def train_here(workdir: Path, *overrides: str) -> None:
    """Rank 0 in this process; extra ranks forked by the session's rank server, as train.py forks its own (conftest)."""
    with_made_store(workdir)
    train(compose_config([f"paths.root={workdir}", *overrides]), output_dir=workdir / "run")


def final_weights(workdir: Path) -> dict[str, torch.Tensor]:
    (ckpt,) = (workdir / "run" / "checkpoints").glob("*.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("model.")}


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Strategies set threads, affinity and launcher variables of the process that runs rank 0."""
    threads, cores, env = torch.get_num_threads(), os.sched_getaffinity(0), dict(os.environ)
    yield
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, cores)
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("strategy-data")


@pytest.fixture(scope="module")
def sequential_weights(tmp_path_factory, shared_data) -> dict[str, torch.Tensor]:
    workdir = tmp_path_factory.mktemp("sequential")
    threads = torch.get_num_threads()
    train_here(workdir, "strategy=sequential", "strategy.threads=1", f"paths.data_dir={shared_data}", *SAME_MATHS)
    torch.set_num_threads(threads)
    return final_weights(workdir)


def _mpi_available() -> str | None:
    if shutil.which("mpirun") is None:
        return "OpenMPI's mpirun is not installed (apt-get install -y openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    return None


CASES = {
    # name: (overrides, exact)
    "threads": (["strategy=threads", "strategy.threads=2"], False),
    "cpu_mp": (["strategy=cpu_mp", "strategy.processes=2"], False),  # its two wide classifier layers split by rows
    "cpu_mp_split_never": pytest.param((["strategy=cpu_mp", "strategy.processes=2", "strategy.split_linear=never"], False),
                                       marks=pytest.mark.slow),
    # Plain DDP runs in the default suite as ddp_gloo_batch_per_worker and ddp_gloo_checkpoint (the same step).
    "ddp_gloo": pytest.param((["strategy=ddp_gloo", "strategy.processes=2"], False), marks=pytest.mark.slow),
    # The papers' way of stating it (Jansen's thesis Table 3.3): 4 per process x 2 = the reference's global 8.
    "ddp_gloo_batch_per_worker": (["strategy=ddp_gloo", "strategy.processes=2", "data.batch_per=worker", "data.batch_size=4"], False),
    "split": (["strategy=split"], True),
    "pipe": (["strategy=pipe", "strategy.chunks=4"], False),
    # AlexNet's layer 1 is an in-place ReLU: the 2nd partition starts with it and is recomputed.
    "pipe_checkpoint_inplace_head": (["strategy=pipe", "strategy.chunks=2", "strategy.balance=[1,21]", "strategy.checkpoint=always"], False),
    "pipe_auto_balance": (["strategy=pipe", "strategy.chunks=2", "strategy.balance=auto", "strategy.checkpoint=except_last"], False),
    # PyTorch's pipelining: one process per stage, every schedule (interleaved: 4 stages cut by profiled time).
    # GPipe, plain 1F1B and interleaving are slow-marked to keep the default suite short: 1F1B (below, recomputing) and
    # ZB-V share their code paths.
    "pipe_torch_gpipe": pytest.param((["strategy=pipe", "strategy.engine=torch", "strategy.chunks=4"], False), marks=pytest.mark.slow),
    "pipe_torch_1f1b": pytest.param((["strategy=pipe", "strategy.engine=torch", "strategy.schedule=1f1b", "strategy.chunks=4"], False),
                                    marks=pytest.mark.slow),
    "pipe_torch_interleaved_1f1b": pytest.param((["strategy=pipe", "strategy.engine=torch", "strategy.schedule=interleaved_1f1b",
                                                  "strategy.chunks=2"], False), marks=pytest.mark.slow),
    "pipe_torch_zero_bubble": pytest.param((["strategy=pipe", "strategy.engine=torch", "strategy.schedule=zero_bubble",
                                             "strategy.chunks=4", "strategy.balance=[4,6,5,7]"], False), marks=pytest.mark.slow),
    # FSDP2 on CPU over gloo, each level (default suite: full, through the resume test below).
    **{f"fsdp_{level}": pytest.param((["strategy=fsdp", "strategy.processes=2", f"strategy.sharding={level}"], False),
                                     marks=pytest.mark.slow) for level in ("full", "grad_op", "none")},
    # HSDP: two groups of two ranks, each sharding the model, the groups replicas (4 processes; across two nodes
    # under srun: test_slurm.py, slow).
    "fsdp_hybrid": (["strategy=fsdp", "strategy.processes=4", "strategy.sharding=hybrid", "strategy.shard_size=2"], False),
    # Activation checkpointing at the cut points: each block recomputed in backward, the same step.
    # Default suite: DDP and 1F1B (the plain 1F1B case is slow-marked: this one runs its schedule too).
    "ddp_gloo_checkpoint": (["strategy=ddp_gloo", "strategy.processes=2", "strategy.checkpoint=always"], False),
    # fsdp recomputing in the default suite: the resume test below.
    "fsdp_full_checkpoint": pytest.param((["strategy=fsdp", "strategy.processes=2", "strategy.checkpoint=always"], False),
                                         marks=pytest.mark.slow),
    "pipe_torch_1f1b_checkpoint": (["strategy=pipe", "strategy.engine=torch", "strategy.schedule=1f1b", "strategy.chunks=4",
                                    "strategy.checkpoint=always"], False),
    "pipe_torch_zero_bubble_checkpoint": pytest.param((["strategy=pipe", "strategy.engine=torch", "strategy.schedule=zero_bubble",
                                                        "strategy.chunks=4", "strategy.balance=[4,6,5,7]", "strategy.checkpoint=always"],
                                                       False), marks=pytest.mark.slow),
    "hybrid_split": pytest.param((["strategy=hybrid", "strategy.processes=2", "strategy.local=split"], False),
                                 marks=pytest.mark.slow),  # DataParallelNetworkStrategy: ran by the multi-host mpi test
    # Two pipelines of PyTorch's schedules (two processes each) averaging their gradients: 4 processes. The default
    # suite's ZB-V case (V placement, deferred weight gradients) is this one; the lone pipeline's is slow-marked.
    "hybrid_pipe_torch_1f1b": pytest.param((["strategy=hybrid", "strategy.processes=2", "strategy.local=pipe", "strategy.engine=torch",
                                             "strategy.schedule=1f1b", "strategy.chunks=2"], False), marks=pytest.mark.slow),
    "hybrid_pipe_torch_zero_bubble": (["strategy=hybrid", "strategy.processes=2", "strategy.local=pipe", "strategy.engine=torch",
                                       "strategy.schedule=zero_bubble", "strategy.chunks=2", "strategy.balance=[4,6,5,7]"], False),
    "hybrid_pipe": pytest.param((["strategy=hybrid", "strategy.processes=2", "strategy.local=pipe", "strategy.chunks=2"], False), marks=pytest.mark.slow),
}


@pytest.fixture
def recomputations(monkeypatch) -> list[int]:
    """Counts the blocks this process (rank 0) recomputes in backward: the weights alone would
    match the sequential run's whether or not strategy.checkpoint=always took effect."""
    from ddlx.parallel import recompute

    entered = []
    enter = recompute._Recomputing.__enter__
    monkeypatch.setattr(recompute._Recomputing, "__enter__", lambda self: (entered.append(1), enter(self))[1])
    return entered


@pytest.fixture
def meshes(monkeypatch) -> list[tuple[int, ...]]:
    """The device mesh shapes FSDP shards over on rank 0: the weights alone would match the
    sequential run's under any sharding level."""
    from torch.distributed import fsdp

    shapes, shard = [], fsdp.fully_shard
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, mesh, **kw: (shapes.append(tuple(mesh.shape)), shard(module, mesh=mesh, **kw))[1])
    return shapes


@pytest.fixture
def split_layers(monkeypatch) -> list[tuple[int, int]]:
    """(in, out) of the layers cpu_mp split by rows on rank 0: the weights alone would match the
    sequential run's were every layer left data parallel."""
    from ddlx.parallel import shared_weight_ranks as cpu_mp

    shapes, split = [], cpu_mp.split_linears
    monkeypatch.setattr(cpu_mp, "split_linears", lambda *a, **kw: (layers := split(*a, **kw),
                                                                   shapes.extend((m.in_features, m.out_features) for m in layers))[0])
    return shapes


def test_every_strategy_this_machine_can_run_has_an_equal_weights_case():
    """A new strategy's file is not done until it trains to the sequential run's weights here: every
    registered strategy that runs on a CPU and that ddlx starts itself (mpi: mpirun starts its ranks,
    test_multinode.py and test_slurm.py) has a case above."""
    from ddlx.strategies import STRATEGIES

    cased = {(c.values[0] if hasattr(c, "values") else c)[0][0].split("=")[1] for c in CASES.values()}
    runnable = {name for name, spec in STRATEGIES.items()
                if not spec.needs_gpu(spec.config(), "cpu") and spec.data_parallel(spec.config()) is not None}
    assert runnable - {"sequential"} <= cased, sorted(runnable - {"sequential"} - cased)


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_strategy_matches_sequential(case, tmp_path, shared_data, sequential_weights, recwarn, recomputations, meshes,
                                     split_layers):
    overrides, exact = case
    if exact:
        torch.set_num_threads(1)  # bit for bit needs the reference's single intra-op thread too
    train_here(tmp_path, *[o for o in SAME_MATHS if o.split("=")[0] not in {k.split("=")[0] for k in overrides}],
               *overrides, f"paths.data_dir={shared_data}")
    _assert_same_weights(final_weights(tmp_path), sequential_weights, exact)
    ours = "strategy.checkpoint=always" in overrides and (overrides[0] != "strategy=pipe" or "strategy.engine=torch" in overrides)
    assert bool(recomputations) == ours, "strategy.checkpoint=always recomputes blocks in backward (fairscale: its own way)"
    if overrides[0] == "strategy=fsdp":
        groups = {"strategy.sharding=hybrid": (2, 2), "strategy.sharding=none": (2, 1)}
        assert set(meshes) == {next((m for o, m in groups.items() if o in overrides), (2,))}, "the level's device mesh"
    if overrides[0] == "strategy=cpu_mp":  # the small AlexNet's 1024x4096 and 4096x4096, not its 4096x3
        assert split_layers == ([] if "strategy.split_linear=never" in overrides else [(1024, 4096), (4096, 4096)])
    _assert_one_run(tmp_path, overrides[0].split("=")[1])
    _assert_stages_recorded(tmp_path, overrides)
    _assert_layout_kept(tmp_path, overrides)
    _assert_no_process_left(tmp_path)
    # The timing figures are reduced across ranks by the timer: no advice to sync them again.
    assert not [str(w.message) for w in recwarn if "sync_dist=True" in str(w.message)]


# Clipping by norm scales the whole network's gradient by its norm, as sequential does: DDP and FSDP
# clip after their reduce (FSDP's sharded norm is the whole one); PyTorch's pipelines keep each
# stage's gradients on its own rank. The clip is small enough to scale every step.
CLIPPED = ["trainer.gradient_clip_val=0.01"]
CLIP_CASES = {
    "pipe_torch_1f1b": ["strategy=pipe", "strategy.engine=torch", "strategy.schedule=1f1b", "strategy.chunks=4"],
    # two pipelines of two stages each: the norm summed over a pipeline's stages, not over the replicas
    "hybrid_pipe_torch_zero_bubble": pytest.param(["strategy=hybrid", "strategy.processes=2", "strategy.local=pipe",
                                                   "strategy.engine=torch", "strategy.schedule=zero_bubble", "strategy.chunks=2",
                                                   "strategy.balance=[4,6,5,7]"], marks=pytest.mark.slow),
    "fsdp_full": pytest.param(["strategy=fsdp", "strategy.processes=2"], marks=pytest.mark.slow),
    "ddp_gloo": pytest.param(["strategy=ddp_gloo", "strategy.processes=2"], marks=pytest.mark.slow),
}


@pytest.fixture(scope="module")
def clipped_sequential_weights(tmp_path_factory, shared_data, sequential_weights) -> dict[str, torch.Tensor]:
    workdir = tmp_path_factory.mktemp("sequential-clipped")
    threads = torch.get_num_threads()
    train_here(workdir, "strategy=sequential", "strategy.threads=1", f"paths.data_dir={shared_data}", *SAME_MATHS, *CLIPPED)
    torch.set_num_threads(threads)
    weights = final_weights(workdir)
    assert any(not torch.allclose(weights[k], sequential_weights[k], rtol=1e-3) for k in weights), "the clip scaled the steps"
    return weights


@pytest.mark.integration
@pytest.mark.parametrize("overrides", list(CLIP_CASES.values()), ids=list(CLIP_CASES))
def test_clipping_by_norm_matches_sequential(overrides, tmp_path, shared_data, clipped_sequential_weights):
    train_here(tmp_path, *SAME_MATHS, *CLIPPED, *overrides, f"paths.data_dir={shared_data}")
    _assert_same_weights(final_weights(tmp_path), clipped_sequential_weights, exact=False)


@pytest.mark.integration
def test_cpu_mp_resumes_with_its_optimizer_state(tmp_path, shared_data):
    """cpu_mp's ranks keep the optimizer state by slice; the checkpoint gathers it whole, and a
    run resumed from it ends with the weights of one that never stopped (momentum included)."""
    job = ["strategy=cpu_mp", "strategy.processes=2", f"paths.data_dir={shared_data}", *SAME_MATHS]
    (tmp_path / "whole").mkdir()
    (tmp_path / "cut").mkdir()
    train(compose_config([f"paths.root={tmp_path / 'whole'}", *job, "trainer.max_epochs=2"]), output_dir=tmp_path / "whole" / "run")
    train(compose_config([f"paths.root={tmp_path / 'cut'}", *job]), output_dir=tmp_path / "cut" / "run")
    checkpoint = tmp_path / "cut" / "run" / "checkpoints" / "last.ckpt"
    momentum = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"]
    assert len(momentum) == len(sequential_shapes := [v.shape for v in final_weights(tmp_path / "cut").values()])
    assert [v["momentum_buffer"].shape for v in momentum.values()] == sequential_shapes, "every slice, gathered"
    train(compose_config([f"paths.root={tmp_path / 'cut'}", *job, "trainer.max_epochs=2", f"ckpt_path={checkpoint}"]),
          output_dir=tmp_path / "cut" / "run")
    _assert_same_weights(final_weights(tmp_path / "cut"), final_weights(tmp_path / "whole"), exact=True)


@pytest.mark.integration
def test_cpu_mp_accumulates_gradients_as_sequential_does(tmp_path, shared_data, ranks_as_new_interpreters):
    """trainer.accumulate_grad_batches=2: the ranks reduce once per optimizer step, the gradients
    of both backward passes (reduced after each, the first pass's were counted wrongly). Its rank 1
    is a new interpreter (a sweep's later job), the other in-process jobs' are forked."""
    job = [f"paths.data_dir={shared_data}", *SAME_MATHS, "trainer.limit_train_batches=4", "trainer.accumulate_grad_batches=2"]
    for folder in ("sequential", "cpu_mp"):
        (tmp_path / folder).mkdir()
        with_made_store(tmp_path / folder)
        train(compose_config([f"paths.root={tmp_path / folder}", f"strategy={folder}", *job]), output_dir=tmp_path / folder / "run")
    _assert_same_weights(final_weights(tmp_path / "cpu_mp"), final_weights(tmp_path / "sequential"), exact=False)


@pytest.mark.integration
def test_torch_pipe_resumes_and_trains_a_smaller_last_batch(tmp_path, shared_data):
    """Each stage's weights and momentum are gathered into one checkpoint under the sequential
    model's names; a resumed run ends with the weights of a sequential run that never stopped, and
    an epoch's last, smaller batch (8 of 12, in 2 micro-batches instead of 3) keeps the sequential
    maths (a momentum lost at the resume, or a step repeated, moves the weights far more than the
    tolerance)."""
    epoch = [f"paths.data_dir={shared_data}", *SAME_MATHS, "data.batch_size=12", "trainer.limit_train_batches=1.0"]
    job = ["strategy=pipe", "strategy.engine=torch", "strategy.schedule=1f1b", "strategy.chunks=3", *epoch]
    for folder in ("sequential", "cut"):
        (tmp_path / folder).mkdir()
        with_made_store(tmp_path / folder)
    def run(folder, *overrides):
        train(compose_config([f"paths.root={tmp_path / folder}", *overrides]), output_dir=tmp_path / folder / "run")
    run("sequential", "strategy=sequential", "strategy.threads=1", *epoch, "trainer.max_epochs=2")
    run("cut", *job)
    checkpoint = tmp_path / "cut" / "run" / "checkpoints" / "last.ckpt"
    momentum = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]["state"]
    assert [v["momentum_buffer"].shape for v in momentum.values()] == [v.shape for v in final_weights(tmp_path / "cut").values()]
    run("cut", *job, "trainer.max_epochs=2", f"ckpt_path={checkpoint}")
    _assert_same_weights(final_weights(tmp_path / "cut"), final_weights(tmp_path / "sequential"), exact=False)
    _assert_no_process_left(tmp_path)


@pytest.mark.integration
def test_fsdp_checkpoint_resumes_under_sharding_with_the_sequential_maths(tmp_path, shared_data, recomputations):
    """FSDP's full state dict is saved under the sequential names and the optimizer's index keys;
    a run resumed from it (momentum resharded) ends with the weights of a sequential run that
    never stopped. Recomputing its blocks in backward (strategy.checkpoint=always) changes none of it."""
    epoch = [f"paths.data_dir={shared_data}", *SAME_MATHS, "trainer.limit_train_batches=1"]
    job = ["strategy=fsdp", "strategy.processes=2", "strategy.sharding=full", "strategy.checkpoint=always", *epoch]
    for folder in ("sequential", "cut"):
        (tmp_path / folder).mkdir()
        with_made_store(tmp_path / folder)
    def run(folder, *overrides):
        train(compose_config([f"paths.root={tmp_path / folder}", *overrides]), output_dir=tmp_path / folder / "run")
    run("sequential", "strategy=sequential", "strategy.threads=1", *epoch, "trainer.max_epochs=2")
    run("cut", *job)
    assert recomputations, "rank 0 recomputed its blocks in backward"
    checkpoint = tmp_path / "cut" / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=False)
    assert list(saved["optimizer_states"][0]["state"]) == list(range(len(final_weights(tmp_path / "cut"))))
    run("cut", *job, "trainer.max_epochs=2", f"ckpt_path={checkpoint}")
    _assert_same_weights(final_weights(tmp_path / "cut"), final_weights(tmp_path / "sequential"), exact=False)
    _assert_one_run(tmp_path / "cut", "fsdp")
    _assert_no_process_left(tmp_path)


@pytest.mark.integration
def test_cpu_mp_refuses_gradient_clipping_it_would_not_apply(tmp_path, shared_data):
    with pytest.raises(ConfigError, match=r"trainer.gradient_clip_val=1.0 with strategy=cpu_mp"):
        train_here(tmp_path, "strategy=cpu_mp", "strategy.processes=2", "trainer.gradient_clip_val=1.0",
                   f"paths.data_dir={shared_data}", *SAME_MATHS)
    _assert_no_process_left(tmp_path)


@pytest.mark.parametrize("hook", [pytest.param("fp16", marks=pytest.mark.slow), pytest.param("powersgd", marks=pytest.mark.slow)])
def test_ddp_gradient_compression_hooks(hook, tmp_path, shared_data, sequential_weights):
    """Compressed allreduce (the training-systems survey, section 4) trains, approximately the sequential step."""
    train_here(tmp_path, "strategy=ddp_gloo", f"strategy.comm_hook={hook}", f"paths.data_dir={shared_data}", *SAME_MATHS)
    got = final_weights(tmp_path)
    # fp16 rounds each gradient to ~3 significant digits; PowerSGD starts compressing at step 2.
    for name, want in sequential_weights.items():
        torch.testing.assert_close(got[name], want, rtol=0.05, atol=2e-3, msg=name)
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.data.tags["comm_hook"] == hook


def test_data_parallel_ranks_stop_together_when_the_loss_diverges(tmp_path, shared_data):
    """Each rank decides on the epoch's loss gathered from all of them: none goes on alone (a hang)."""
    maths = [o for o in SAME_MATHS if not o.startswith(("optim.lr=", "trainer.max_epochs="))]
    train_here(tmp_path, "strategy=ddp_gloo", "strategy.processes=2", f"paths.data_dir={shared_data}", *maths,
               "optim.lr=1000", "trainer.max_epochs=5")
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    epoch = re.match(r"train_loss (nan|inf) in epoch (\d)", run.data.tags["diverged"])
    assert epoch and int(epoch[2]) < 5, run.data.tags["diverged"]
    assert run.data.metrics["measured_epochs"] == int(epoch[2])
    _assert_no_process_left(tmp_path)


def _assert_no_process_left(workdir: Path) -> None:
    import psutil

    time.sleep(1)
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(workdir) in " ".join(p.info["cmdline"] or [])]
    # Ranks forked for this process's own jobs keep its command line: known by their names
    left += [p.pid for p in alive(rank_workers(os.getpid()))]
    assert not left, f"processes left behind: {left}"


MPI_CASES = {
    # In the slow suite: tests/test_multinode.py runs it across two hosts in the default suite.
    "sequential": pytest.param((2, []), marks=pytest.mark.slow),
    # Two pipelines of two ranks each (PyTorch's GPipe), averaging gradients across them.
    "pipe_torch": pytest.param((4, ["strategy.local=pipe", "strategy.engine=torch", "strategy.chunks=2"]), marks=pytest.mark.slow),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", list(MPI_CASES.values()), ids=list(MPI_CASES))
def test_mpi_matches_sequential(case, tmp_path, shared_data, sequential_weights):
    reason = _mpi_available()
    if reason:
        pytest.skip(reason)
    ranks, overrides = case
    runner = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks)]
    proc = train_py(tmp_path, "strategy=mpi", f"paths.data_dir={shared_data}", *SAME_MATHS, *overrides, runner=runner)
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = proc.stdout + proc.stderr
    assert said.count("Seed set to 42") == 1 and "GLOBAL_RANK: 1" not in said, "rank 0 speaks for the job"
    assert re.search(r"epoch \d+/\d+ done", said), \
        "a line per epoch: mpirun gives its ranks a pseudo-terminal, where the progress bar's redraws went to the log"
    _assert_same_weights(final_weights(tmp_path), sequential_weights, exact=False)
    _assert_one_run(tmp_path, "mpi")
    _assert_no_process_left(tmp_path)


def _assert_same_weights(got: dict, want: dict, exact: bool) -> None:
    assert got.keys() == want.keys(), "strategies keep the sequential model's parameter names"
    moved = any(not torch.equal(w, g) for w, g in zip(want.values(), got.values()))
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), name
        else:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert moved or exact, "weights identical to the bit: suspicious for a different summation order"


def _assert_one_run(workdir: Path, strategy: str) -> None:
    (run,) = runs(f"sqlite:///{workdir / 'mlflow.db'}")
    assert run.info.status == "FINISHED"
    assert run.data.tags["strategy"] == strategy
    assert {"epoch_time_s", "samples_per_s", "train_loss", "val_acc"} <= set(run.data.metrics)
    assert (run.data.params["data.batch_size"], run.data.params["data.batch_per"]) == ("8", "global"), \
        "a run records its global batch however it was stated"
    steps = int(float(run.data.params["trainer.limit_train_batches"]))
    trained = run.data.metrics["samples_per_s"] * run.data.metrics["epoch_time_s"]
    assert trained == pytest.approx(8 * steps), "each step's 8 images counted once (a pipeline's stages share them)"


def _assert_layout_kept(workdir: Path, overrides: list[str]) -> None:
    """The checkpoint keeps the nodes (mpirun's ranks) the run was started with, as tagged: a
    resume started otherwise is refused (ddlx.checkpoints.SavedRun.layout_changed)."""
    from ddlx.checkpoints import LAYOUT_TAGS

    (ckpt,) = (workdir / "run" / "checkpoints").glob("*.ckpt")
    layout = torch.load(ckpt, map_location="cpu", weights_only=False)["ddlx"]["layout"]
    (run,) = runs(f"sqlite:///{workdir / 'mlflow.db'}")
    assert layout == {key: run.data.tags[key] for key in LAYOUT_TAGS if key in run.data.tags}
    if overrides[0] in ("strategy=ddp_gloo", "strategy=fsdp"):
        assert layout == {"nodes": "1"}


def _assert_stages_recorded(workdir: Path, overrides: list[str]) -> None:
    """A pipeline's run records the layers of each stage it ran, balance=auto's profiled cut too."""
    (run,) = runs(f"sqlite:///{workdir / 'mlflow.db'}")
    if "strategy=pipe" not in overrides and "strategy.local=pipe" not in overrides:
        assert "stage_layers" not in run.data.tags
        return
    stages = ast.literal_eval(run.data.tags["stage_layers"])
    assert sum(stages) == 22 and all(isinstance(n, int) and n > 0 for n in stages), "AlexNet's 22 layers, each stage some"
    given = next((o.split("=", 1)[1] for o in overrides if o.startswith("strategy.balance=")), "auto")
    assert given == "auto" or stages == ast.literal_eval(given)


@pytest.mark.integration
def test_sweep_with_ddp_gives_one_run_per_job_and_records_a_refused_job(tmp_path, shared_data):
    """Lightning re-launches ranks with sys.argv; ddlx starts them from the job's own config. A job
    refused before training (here: a batch that cannot fit in memory) is a FAILED run and the
    sweep goes on to the next DDP job. (A folder of one's own: a synthetic set's count is the
    config's, and a split that cannot hold the batch is refused before the sweep starts.)"""
    from PIL import Image

    folder = tmp_path / "images"
    for label in ("a", "b"):
        (folder / label).mkdir(parents=True)
        for i in range(20):
            Image.new("RGB", (40, 40), (12 * i, 0, 0) if label == "a" else (0, 12 * i, 0)).save(folder / label / f"{i}.png")
    maths = [o for o in SAME_MATHS if not o.startswith("data.batch_size=")]
    cmd = [sys.executable, str(PROJECT_DIR / "train.py"), "-m", f"paths.root={tmp_path}", f"paths.data_dir={shared_data}",
           f"hydra.sweep.dir={tmp_path}/multirun", "strategy=ddp_gloo", "strategy.processes=2",
           "data=imagefolder", f"data.root={folder}", "data.batch_size=8,1000000,16", *maths]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 1, "the sweep reports that a job failed"
    assert "ddlx: error: " in proc.stderr and "GiB" in proc.stderr, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "1 job(s) of the sweep refused before training" in proc.stderr, \
        "the refusal is said in a line, not a traceback"
    assert "ddlx: sweep multirun ended: 3 run(s); the report counts " in proc.stdout and "1 status FAILED" in proc.stdout, \
        proc.stdout[-2000:]
    got = {r.data.params["data.batch_size"]: r for r in runs(f"sqlite:///{tmp_path / 'mlflow.db'}")}
    assert set(got) == {"8", "1000000", "16"}, "one run per job"
    assert got["8"].info.status == got["16"].info.status == "FINISHED"
    assert got["1000000"].info.status == "FAILED" and "GiB" in got["1000000"].data.tags["error"]
    assert {r.data.tags["sweep_id"] for r in got.values()} == {"multirun"}
    assert sorted(r.data.tags["sweep_job"] for r in got.values()) == ["0", "1", "2"]
    for job in ("0", "2"):
        assert list((tmp_path / "multirun" / job / "checkpoints").glob("*.ckpt")), f"job {job} wrote its checkpoint in its own folder"
        assert "mean_epoch_time_s" in got["8" if job == "0" else "16"].data.metrics


KILLED_RANK = {  # a strategy's second process, killed mid-training (default suite: ddp_gloo; the others end the same way)
    "ddp_gloo": ["strategy=ddp_gloo", "strategy.processes=2"],
    "pipe_torch": pytest.param(["strategy=pipe", "strategy.engine=torch", "strategy.schedule=1f1b", "strategy.chunks=2"],
                               marks=pytest.mark.slow),  # a stage
    "fsdp": pytest.param(["strategy=fsdp", "strategy.processes=2"], marks=pytest.mark.slow),  # a shard
    "cpu_mp": pytest.param(["strategy=cpu_mp", "strategy.processes=2"], marks=pytest.mark.slow),  # a slice's owner
}


@pytest.mark.integration
@pytest.mark.parametrize("strategy", list(KILLED_RANK.values()), ids=list(KILLED_RANK))
def test_killed_rank_does_not_hang_the_others(strategy, tmp_path, shared_data):
    cmd = [sys.executable, str(PROJECT_DIR / "train.py"), f"paths.root={tmp_path}", f"paths.data_dir={shared_data}",
           f"hydra.run.dir={tmp_path}/run", *strategy, "strategy.timeout_s=30",
           *SAME_MATHS, "trainer.max_epochs=1000", "trainer.limit_train_batches=1.0"]
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=tmp_path)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    try:
        worker = _wait_for_worker(parent.pid, timeout=120)
        deadline = time.monotonic() + 120
        while not last.is_file() and time.monotonic() < deadline:  # an epoch written: the run can resume
            time.sleep(0.2)
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        _, stderr = parent.communicate(timeout=90)
        assert parent.returncode != 0
        assert time.monotonic() - start < 90
    finally:
        if parent.poll() is None:
            parent.kill()
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status in ("FAILED", "KILLED"), run.info.status
    _assert_no_process_left(tmp_path)
    # The console says so (Lightning's watchdog kills rank 0 next: no end summary), and how to resume.
    assert "ddlx: run FAILED: rank 1 was killed by SIGKILL" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, "rank 0's lost connection is not the story: " + stderr[-3000:]
    assert "was killed by SIGKILL" in run.data.tags["error"]
    (resume,) = [line for line in stderr.splitlines() if line.startswith("ddlx: resume with: python train.py ")]
    assert resume.endswith(f"ckpt_path={last}") and "trainer.max_epochs=1000" in resume, resume


def _wait_for_worker(parent_pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = rank_workers(parent_pid)
        if workers:
            return workers[0].pid
        time.sleep(0.5)
    raise AssertionError("rank 1 never started")


# ---- clear errors before training -------------------------------------------------------------


def _plan(*overrides: str):
    cfg = compose_config(list(overrides) + ["data.image_size=32"])
    return build_strategy(cfg.strategy, cfg.trainer.accelerator, layered_model_meta(cfg), cfg.data)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_absent_gpus_are_named_with_a_working_override():
    with pytest.raises(ConfigError, match=r"asks for devices \[cuda:0, cuda:1\].*this machine has: cpu.*strategy.devices=\[cpu,cpu\]"):
        _plan("strategy=split", "strategy.devices=[cuda:0,cuda:1]")
    with pytest.raises(ConfigError, match=r"ddp_nccl needs CUDA GPUs.*strategy=ddp_gloo"):
        _plan("strategy=ddp_nccl")


def test_an_empty_or_unknown_device_list_is_named_with_a_working_one():
    with pytest.raises(ConfigError, match=r"strategy.devices=\[\] for strategy=pipe; .*one per stage, e.g. strategy.devices=\[cpu,cpu\]"):
        _plan("strategy=pipe", "strategy.devices=[]")
    with pytest.raises(ConfigError, match=r"strategy=pipe: 'foo' is not a device; expected cpu or cuda:N"):
        _plan("strategy=pipe", "strategy.devices=[cpu,foo]")
    with pytest.raises(ConfigError, match=r"strategy=split: 'meta' is not a device; expected cpu or cuda:N"):
        _plan("strategy=split", "strategy.devices=[cpu,meta]")
    with pytest.raises(ConfigError, match=r"strategy=hybrid; expected auto or a list of 4 devices, e.g. strategy.devices=\[cpu,cpu,cpu,cpu\]"):
        _plan("strategy=hybrid", "strategy.devices=[cpu,cpu]")


def test_a_pipelines_refusal_counts_the_pipelines_and_offers_chunks_its_schedule_takes():
    """mpi's ranks: 32 over 7 pipelines was said as 'over 8 pipelines (4 each)'. Under 1f1b (a
    micro-batch per stage at least), batch 7 was offered strategy.chunks=1, which 1f1b refuses."""
    from types import SimpleNamespace

    from ddlx.strategies.parts.pipelines import pipeline_batch_problem

    knobs = SimpleNamespace(chunks=8, engine="fairscale", schedule="gpipe")
    assert "(data.batch_size=32 over 7 pipelines (4 each))" in pipeline_batch_problem(knobs, 4, 32, 7, 2)
    with pytest.raises(ConfigError, match=r"use a divisor of 7 of at least 2, e.g. strategy.chunks=7$"):
        _plan("strategy=pipe", "strategy.engine=torch", "strategy.schedule=1f1b", "data.batch_size=7")
    _plan("strategy=pipe", "strategy.engine=torch", "strategy.schedule=1f1b", "data.batch_size=7", "strategy.chunks=7")
    with pytest.raises(ConfigError, match=r"strategy.chunks=1 < 2 stages; .*e.g. strategy.chunks=2$"):
        _plan("strategy=pipe", "strategy.engine=torch", "strategy.schedule=1f1b", "strategy.chunks=1")


@pytest.mark.parametrize("engine", ["fairscale", "torch"])
def test_a_batch_stated_per_pipeline_is_each_pipelines_in_the_first_plan(engine):
    """data.batch_per=worker: the plan made to count the processes (before ddlx.run.batch_of_workers
    makes the batch global) split the stated batch over the pipelines, and refused chunks=32 for
    a batch of 32 per pipeline as 'larger than the batch of 16'."""
    plan = _plan("strategy=hybrid", "strategy.local=pipe", f"strategy.engine={engine}", "strategy.chunks=32", "data.batch_per=worker")
    assert plan.data_parallel == 2
    with pytest.raises(ConfigError, match=r"strategy.chunks=64 is larger than the batch of 32 each pipeline gets \(data.batch_size=32 "
                                          r"per pipeline \(data.batch_per=worker\)\)"):
        _plan("strategy=hybrid", "strategy.local=pipe", f"strategy.engine={engine}", "strategy.chunks=64", "data.batch_per=worker")


def test_pipe_knobs_are_checked():
    with pytest.raises(ConfigError, match=r"strategy.balance=\[3,3\] .*summing to alexnet's 22 layers.*strategy.balance=\[10,12\]"):
        _plan("strategy=pipe", "strategy.balance=[3,3]")
    for given in ("5", "abc", "[a,b]", "[true,21]"):  # each named as given, none a traceback
        with pytest.raises(ConfigError, match=rf"strategy.balance={re.escape(given.replace('true', 'True'))} must give 2 positive"):
            _plan("strategy=pipe", f"strategy.balance={given}")
    with pytest.raises(ConfigError, match=r"strategy.chunks=64 is larger than the batch of 32"):
        _plan("strategy=pipe", "strategy.chunks=64")
    with pytest.raises(ConfigError, match=r"strategy.schedule=1f1b needs strategy.engine=torch"):
        _plan("strategy=pipe", "strategy.schedule=1f1b")
    with pytest.raises(ConfigError, match=r"strategy.chunks=5 does not divide data.batch_size=32.*strategy.chunks=4"):
        _plan("strategy=pipe", "strategy.engine=torch", "strategy.chunks=5")
    with pytest.raises(ConfigError, match=r"strategy.schedule=1f1b needs at least one micro-batch per stage.*chunks>=2"):
        _plan("strategy=pipe", "strategy.engine=torch", "strategy.schedule=1f1b", "strategy.chunks=1")
    with pytest.raises(ConfigError, match=r"strategy.checkpoint=except_last .*strategy.engine=torch.*always or never"):
        _plan("strategy=pipe", "strategy.engine=torch", "strategy.checkpoint=except_last")
    with pytest.raises(ConfigError, match=r"strategy.balance=\[10,12\] must give 4 positive layer counts.*"
                                          r"e.g. strategy.balance=\[(\d+),(\d+),(\d+),(\d+)\], or") as refused:
        _plan("strategy=pipe", "strategy.engine=torch", "strategy.schedule=zero_bubble", "strategy.balance=[10,12]")
    example = [int(n) for n in re.search(r"e.g. strategy.balance=\[([\d,]+)\]", str(refused.value)).group(1).split(",")]
    assert len(example) == 4 and sum(example) == 22 and min(example) >= 1, "the example itself is taken (alexnet: 22 layers)"
    # PyTorch's schedules as the pipelines of a data-parallel job: each pipeline's share is divided.
    with pytest.raises(ConfigError, match=r"strategy.chunks=32 is larger than the batch of 16 each pipeline gets \(data.batch_size=32 "
                                          r"over 2 pipelines \(16 each\)\).*strategy.chunks<=16"):
        _plan("strategy=hybrid", "strategy.local=pipe", "strategy.engine=torch", "strategy.chunks=32")
    with pytest.raises(ConfigError, match=r"strategy.chunks=12 does not divide data.batch_size=32 over 2 pipelines \(16 each\)"):
        _plan("strategy=hybrid", "strategy.local=pipe", "strategy.engine=torch", "strategy.chunks=12")
    with pytest.raises(ConfigError, match=r"strategy.engine=torch .*strategy.local=split.*strategy.local=pipe strategy.engine=torch"):
        _plan("strategy=hybrid", "strategy.local=split", "strategy.engine=torch")
    plan = _plan("strategy=hybrid", "strategy.local=pipe", "strategy.engine=torch", "strategy.schedule=1f1b")
    assert (plan.trainer_kwargs["devices"], plan.data_parallel, plan.tags["schedule"]) == (4, 2, "1f1b")
    with pytest.raises(ConfigError, match=r"strategy.shard_size=3 .*\[1, 2, 4\]"):
        _plan("strategy=fsdp", "strategy.processes=4", "strategy.sharding=hybrid", "strategy.shard_size=3")
    with pytest.raises(ConfigError, match=r"strategy.shard_size=2 .*sharding=full.*strategy.sharding=hybrid"):
        _plan("strategy=fsdp", "strategy.shard_size=2")
    assert _plan("strategy=fsdp", "strategy.sharding=hybrid").tags["shard_size"] == "2", "null: the node's ranks"
    with pytest.raises(ConfigError, match=r"strategy.cut_point='after_conv9'.*after_conv4"):
        _plan("strategy=split", "strategy.cut_point=after_conv9")


LAUNCHED = {  # a cluster launcher started 4 ranks, 2 on each of 2 nodes (this process one of them)
    "srun": {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "2"},
    "torchrun": {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
}


@pytest.mark.parametrize("launcher", list(LAUNCHED))
def test_ddp_and_fsdp_ranks_follow_the_nodes_a_launcher_started(launcher, monkeypatch):
    """Under srun or torchrun the job's ranks are the launcher's, placed over its nodes: Lightning
    gets the ranks of a node and the node count, and HSDP's groups default to a node's ranks."""
    from ddlx.parallel.launch import settle_cluster_environment

    for name, value in LAUNCHED[launcher].items():
        monkeypatch.setenv(name, value)
    for strategy in (["strategy=ddp_gloo"], ["strategy=fsdp", "strategy.sharding=hybrid"]):
        plan = _plan(*strategy, "strategy.processes=4")
        assert (plan.trainer_kwargs["devices"], plan.trainer_kwargs["num_nodes"], plan.data_parallel) == (2, 2, 4)
        assert plan.tags["nodes"] == "2"
        settle_cluster_environment(plan.trainer_kwargs, strategy[0])
        assert plan.trainer_kwargs["strategy"].cluster_environment.creates_processes_externally
    assert plan.tags["shard_size"] == "2", "one node's ranks"
    with pytest.raises(ConfigError, match=r"strategy.shard_size=4 .*\[1, 2\]"):
        _plan("strategy=fsdp", "strategy.processes=4", "strategy.sharding=hybrid", "strategy.shard_size=4")
    with pytest.raises(ConfigError, match=rf"{launcher} started 4 ranks.*strategy.processes=2.*strategy.processes=4"):
        _plan("strategy=ddp_gloo", "strategy.processes=2")
    plan = _plan("strategy=cpu_mp", "strategy.processes=4")  # shared memory: one node
    with pytest.raises(ConfigError, match=r"on 2 nodes, but strategy=cpu_mp runs on one"):
        settle_cluster_environment(plan.trainer_kwargs, "cpu_mp")


@pytest.mark.integration
def test_indivisible_batches(tiny_config):
    """(Counts and choices of each knob are the schema's: tests/test_config.py.)"""
    from ddlx.run import train

    cfg = tiny_config("strategy=cpu_mp", "strategy.processes=3")
    with pytest.raises(ConfigError, match=r"data.batch_size=8 .*3 processes.*multiple of 3"):
        train(cfg, output_dir=cfg.paths.root)


def test_more_processes_than_cores_warns_once(caplog, monkeypatch):
    """Said by rank 0: every rank plans the job, and each said it (three times for three ranks)."""
    cores = len(os.sched_getaffinity(0))
    for name in ("DDLX_RANK_WORKER", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING):
        _plan("strategy=cpu_mp", f"strategy.processes={cores + 1}")
        monkeypatch.setenv("RANK", "1")
        _plan("strategy=cpu_mp", f"strategy.processes={cores + 1}")
    said = [r.getMessage() for r in caplog.records if "oversubscribe" in r.getMessage()]
    assert len(said) == 1 and f"asks for {cores + 1} processes but only {cores} cores" in said[0], said


def test_a_balance_by_profiled_time_leaves_the_runs_random_numbers_alone():
    """balance=auto profiles rank 0's layers on a random sample, through AlexNet's dropout: with
    the run's own random state, its draws shifted every later one of that rank (a resumed
    pipeline's masks then differed from those of the run it resumes)."""
    from ddlx.models import build_model
    from ddlx.parallel.balance import balance_by_time

    model = build_model("alexnet", 3, 3, 32).train()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    balance = balance_by_time(model, 2, (2, 3, 32, 32), torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before) and len(balance) == 2
