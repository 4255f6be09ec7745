"""How multi-process strategies start their other ranks.

Lightning's script launcher re-runs ``sys.argv`` for each rank; under Hydra it copies the whole
command line, so a DDP job inside a ``-m`` sweep would start a sweep per rank, and under pytest
it would re-run pytest (Lightning PRs 11617, 18145, 18175; Hydra issue 2070). ddlx instead
starts each extra rank as ``python -m ddlx.rank_worker CONFIG OUTPUT_DIR``: the job's own
resolved config, whatever started it; under train.py, forked from a copy of its process made
after its imports (:mod:`.rank_fork`), which saves each rank the imports' memory and time.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from lightning_fabric.strategies.launchers.subprocess_script import (
    _ChildProcessObserver,
)
from lightning_fabric.utilities.distributed import _set_num_threads_if_needed
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher,
)

from ..process import PARENT_ENV, STARTED_EXTERNALLY, WORKER_ENV, ddlx_module_command, is_rank_worker

log = logging.getLogger(__name__)

# Set by the launcher in the parent; removed after the job so the next job of a sweep picks a
# fresh port instead of the previous job's.
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class StartedRanks:
    """The ranks a cluster launcher started, this process one of them."""

    launcher: str  # srun | torchrun
    ranks: int
    per_node: int | None  # None: srun without --ntasks-per-node
    nodes: int


def started_ranks() -> StartedRanks | None:
    """The ranks srun (a job step of several tasks) or torchrun started, when this process is one
    of them; None when ddlx starts a job's ranks itself (one process, a batch script's own, or a
    rank worker of ddlx's launcher)."""
    from .. import slurm

    if is_rank_worker():
        return None
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None and "LOCAL_WORLD_SIZE" in os.environ:
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        return StartedRanks("torchrun", world, local, max(1, world // local))
    tasks = slurm.started_ranks()
    if tasks is None or tasks == 1:
        return None
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE")
    nodes = int(os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    return StartedRanks("srun", tasks, int(per_node) if per_node else None, nodes)


def ranks_per_node(processes: int, strategy_name: str) -> tuple[int, int]:
    """(ranks per node, nodes) of a DDP-family job of ``processes`` ranks: all on this machine
    when ddlx starts them, else as srun or torchrun placed them (checked: they are the job's
    ranks, and every node holds as many)."""
    from ..errors import ConfigError

    started = started_ranks()
    if started is None:
        return processes, 1
    if started.ranks != processes:
        how = ("as one task (srun --ntasks=1 --cpus-per-task=N: ddlx starts the processes itself) "
               f"or as {processes} tasks (srun --nodes=N --ntasks-per-node={processes}/N)" if started.launcher == "srun"
               else f"with torchrun --nnodes=N --nproc-per-node={processes}/N, or without torchrun (ddlx starts them)")
        raise ConfigError(
            f"{started.launcher} started {started.ranks} ranks, but strategy={strategy_name} strategy.processes={processes}: "
            f"set strategy.processes={started.ranks}, or run it {how}")
    if started.per_node is None:  # Lightning reads the local ranks from it
        raise ConfigError(f"srun --ntasks={processes} for strategy={strategy_name}: give the tasks per node instead, "
                          f"srun --nodes={started.nodes} --ntasks-per-node={processes // started.nodes}")
    if started.per_node * started.nodes != processes:
        raise ConfigError(f"{started.launcher} placed {processes} ranks unevenly over {started.nodes} nodes; "
                          f"strategy={strategy_name} runs as many ranks on every node: --ntasks-per-node=N with "
                          f"strategy.processes=N x nodes")
    return started.per_node, started.nodes


def settle_cluster_environment(trainer_kwargs: dict, strategy_name: str) -> None:
    """Who starts the ranks of a multi-process strategy that names no cluster environment.

    Under ``srun``, Lightning takes SLURM's tasks for the job's ranks (its SLURMEnvironment),
    whatever their number: one task with ``processes=2`` trained alone, recorded as two, and a
    batch script's own process waited for ranks of the job's ``--ntasks`` that nobody started.
    Here: nobody else started ranks, so ddlx starts them itself, as on any machine; or srun or
    torchrun started exactly the job's ranks, one per task, on the nodes the strategy planned
    for (Lightning's way); anything else is refused.
    """
    from lightning_fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    from ..errors import ConfigError
    from ..slurm import job_id as slurm_job_id

    strategy = trainer_kwargs.get("strategy")
    if getattr(strategy, "cluster_environment", False) is not None:
        return  # one process, or the strategy has its own (mpi: MPI's ranks)
    per_node, nodes = int(trainer_kwargs.get("devices", 1)), int(trainer_kwargs.get("num_nodes", 1))
    started = started_ranks()
    if started is None:
        if slurm_job_id() is not None:  # not Lightning's SLURMEnvironment: ddlx starts the ranks
            strategy.cluster_environment = LightningEnvironment()
        return
    ranks_per_node(per_node * nodes, strategy_name)  # the same ranks, evenly placed
    if started.nodes != nodes:
        raise ConfigError(
            f"{started.launcher} started the ranks on {started.nodes} nodes, but strategy={strategy_name} runs on one: "
            f"start it on one node, or use strategy=fsdp or strategy=ddp_* (across nodes under srun or torchrun), "
            f"or strategy=mpi")
    strategy.cluster_environment = (SLURMEnvironment(auto_requeue=False) if started.launcher == "srun"  # ddlx requeues
                                    else TorchElasticEnvironment())
    _set_num_threads_if_needed(num_processes=per_node)  # as Lightning's own launcher does: the node's cores shared


def cluster_environment_plugins(strategy) -> list:
    """The cluster environment to hand Lightning when the strategy carries none (one process, or
    ranks ddlx starts itself, :func:`settle_cluster_environment`): Lightning's own detection
    would import mpi4py (starting MPI, and an OpenMPI ``orted`` beside every run) and print
    SLURM hints, though ddlx has already decided who starts the ranks."""
    from lightning_fabric.plugins.environments import LightningEnvironment

    return [] if getattr(strategy, "cluster_environment", None) is not None else [LightningEnvironment()]


def end_distributed_job(strategy=None, timeout_s: float = 120.0) -> None:
    """After a job in the launching process: leave nothing for the next job of a sweep.

    The other ranks are waited for; and Lightning destroys the process group only at
    interpreter exit, so a second DDP job in one ``-m`` sweep would otherwise reuse the first
    job's group, whose other ranks are gone.
    """
    if is_rank_worker() or any(name in os.environ for name in STARTED_EXTERNALLY):
        return  # this process ends with its job, or its launcher (mpirun, srun) owns the env
    launcher = getattr(strategy, "launcher", None)
    if isinstance(launcher, WorkerLauncher):
        launcher.join(timeout_s)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name in DIST_ENV:
        os.environ.pop(name, None)


class _RecordingObserver(_ChildProcessObserver):
    """Lightning's watchdog (a dead rank kills the others instead of leaving them waiting), but
    ``rank_died`` is told why (the run is marked FAILED with it) before rank 0 is killed."""

    def __init__(self, main_pid: int, child_processes, rank_died: Callable[[str], None]) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=1)
        self.rank_died = rank_died
        self.stopped = False  # the job is ending: ranks that end now (or that ddlx kills) did not die

    def _run(self) -> bool:
        return True if self.stopped else super()._run()

    def _terminate_all(self) -> None:
        if self.stopped:
            return
        codes = {rank: p.returncode for rank, p in enumerate(self._child_processes, start=1) if p.returncode}
        self.rank_died(", ".join(how_it_ended(r, c) for r, c in codes.items()))
        super()._terminate_all()


def how_it_ended(rank: int, code: int) -> str:
    """A rank process's end in words: its exit code, or the signal that killed it."""
    if code >= 0:
        return f"rank {rank} exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"rank {rank} was killed by {name}" + (" (kill -9, or the out-of-memory killer)" if -code == signal.SIGKILL else "")


class WorkerLauncher(_SubprocessScriptLauncher):
    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, worker_args: list[str],
                 rank_died: Callable[[object, str], None]) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.worker_args = worker_args
        self.rank_died = rank_died  # (the Trainer's logger, why): the run layer records it
        self.observer: _RecordingObserver | None = None  # the watchdog, from launch on

    def join(self, timeout_s: float) -> None:
        """Wait for the other ranks to exit (kill what is left after ``timeout_s``), so the next
        job of a sweep never overlaps this one's processes."""
        if self.observer is not None:
            self.observer.stopped = True
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank process %d still running %.0f s after the job: killing it", proc.pid, timeout_s)
                proc.kill()
                proc.wait()

    def dead_ranks(self, wait_s: float = 2.0) -> str | None:
        """Which rank processes a signal killed (kill -9, the out-of-memory killer, a crash), in
        words; None: none within ``wait_s``. Asked when this one failed, which it does on a dead
        rank's lost connection before the watchdog sees it. A rank that exited with an error of its
        own is not counted: this one's error may be the same, and is its own story."""
        if not self.procs:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            dead = {rank: code for rank, proc in enumerate(self.procs, start=1)
                    if (code := proc.poll()) is not None and code < 0}
            if dead or time.monotonic() > deadline:
                return ", ".join(how_it_ended(rank, code) for rank, code in dead.items()) or None
            time.sleep(0.1)

    def launch(self, function, *args, trainer=None, **kwargs):
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        self._call_children_scripts()
        logger = trainer.logger if trainer is not None else None
        self.observer = _RecordingObserver(os.getpid(), self.procs, lambda reason: self.rank_died(logger, reason))
        self.observer.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        self.procs = []
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        from .rank_fork import fork_server

        server = fork_server()  # train.py's: the ranks share its imports (else new interpreters)
        for local_rank in range(1, self.num_processes):
            child_env = {**os.environ, "LOCAL_RANK": str(local_rank), WORKER_ENV: "1", PARENT_ENV: str(os.getpid())}
            if server is not None:
                self.procs.append(server.spawn(self.worker_args, child_env))
            else:
                self.procs.append(subprocess.Popen(ddlx_module_command("ddlx.rank_worker", *self.worker_args), env=child_env))


def plain_optimizer(optimizer):
    """The torch optimizer inside Lightning's wrapper (strategies' state hooks receive either)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class RelaunchingDDPStrategy(DDPStrategy):
    """DDPStrategy whose extra ranks run ``ddlx.rank_worker`` on the job's resolved config."""

    worker_args: list[str] | None = None  # [config file, output dir], set by ddlx.run before fit
    # Called with the Trainer's logger and the reason when a rank dies (ddlx.run: the run is FAILED)
    rank_died: Callable[[object, str], None] = staticmethod(lambda logger, reason: None)
    recompute: bool = False  # activation checkpointing at the model's cut points (strategy.checkpoint=always)

    def configure_ddp(self) -> None:
        if self.recompute:
            from .recompute import recompute_at_cut_points

            recompute_at_cut_points(self.model)
        super().configure_ddp()

    def _configure_launcher(self) -> None:
        env = self.cluster_environment
        if env.creates_processes_externally or self.worker_args is None:
            super()._configure_launcher()  # mpirun / SLURM / torchrun started every rank already
            return
        self._launcher = WorkerLauncher(env, self.num_processes, self.num_nodes, self.worker_args, self.rank_died)
