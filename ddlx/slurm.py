"""SLURM: a job warned before its time limit, or pre-empted, stops at the end of a step with a
checkpoint (:mod:`ddlx.stopping`); warned by ``--signal=USR1@SECONDS`` (or submitit's USR2), it
also requeues itself (``scontrol requeue``); and the requeued job resumes that run from that
checkpoint, into the same MLflow run, with no ``ckpt_path=`` to give.

A requeued batch job runs its script again under the same ``SLURM_JOB_ID``, with
``SLURM_RESTART_COUNT`` counting its starts; it gets new output folders (they carry the start
time). What ties the two together is a marker under ``paths.root``: ``outputs/requeued/JOB_ID``
(``-N`` for job N of a ``-m`` sweep), written by rank 0 when the job stops with a resumable
checkpoint, holding that checkpoint's path. Every rank of the requeued job reads it, so the
folder must be shared by the nodes, as the output folder already is.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from .errors import Stopped
from .job_log import say

# The signals SLURM sends ahead of a job's end when asked to (sbatch --signal=USR1@90; submitit's
# is USR2): a stop by one of them requeues the job. SIGTERM (scancel, or a pre-emption SLURM
# requeues itself) does not: it still leaves the marker, for a requeue that SLURM makes.
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def job_id() -> str | None:
    """This job's id as ``squeue`` shows it: ``ARRAY_TASK`` for a task of an array (a submitit
    sweep's jobs), else ``SLURM_JOB_ID``; None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID") or None


def run_tags() -> dict[str, str]:
    """The SLURM job a run belongs to (``squeue``, ``sacct`` and the run's record agree)."""
    job = job_id()
    return {"slurm_job_id": job} if job else {}


def started_ranks() -> int | None:
    """How many processes SLURM started for this process's job step: srun's tasks, and 1 for a
    batch script's own process (where ``SLURM_NTASKS`` is the job's, not what ran). None
    outside SLURM."""
    if job_id() is None:
        return None
    return int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1)


class RequeueMarker:
    """The marker of this SLURM job (and sweep job), under ``root``."""

    def __init__(self, root: str | os.PathLike, job: str, sweep_job: str | None = None) -> None:
        self.job = job
        self.path = Path(root) / "outputs" / "requeued" / (job if sweep_job is None else f"{job}-{sweep_job}")

    @classmethod
    def of_this_job(cls, root: str | os.PathLike, sweep_job: str | None) -> RequeueMarker | None:
        """None outside a SLURM job."""
        job = job_id()
        return cls(root, job, sweep_job) if job else None

    def checkpoint_to_resume(self) -> str | None:
        """The checkpoint the previous start of this job stopped with, once SLURM has requeued it."""
        if int(os.environ.get("SLURM_RESTART_COUNT") or 0) < 1 or not self.path.is_file():
            return None
        return self.path.read_text().strip() or None

    def after_stop(self, stop: Stopped, rank0: bool) -> None:
        """Rank 0 leaves the marker and, warned by SLURM, requeues the job."""
        if not rank0 or not stop.resumable or stop.checkpoint is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.partial")
        partial.write_text(f"{Path(stop.checkpoint).resolve()}\n")
        os.replace(partial, self.path)
        if stop.signum not in WARNING_SIGNALS:
            return
        # The last thing this process does: SLURM ends the job's processes as it requeues it.
        say(f"ddlx: requeueing SLURM job {self.job}: when it starts again it resumes from {stop.checkpoint}", err=True)
        try:
            done = subprocess.run(["scontrol", "requeue", self.job], capture_output=True, text=True, timeout=60)
            why = (done.stderr.strip() or f"exit status {done.returncode}") if done.returncode else None
        except (OSError, subprocess.TimeoutExpired) as err:  # no scontrol here (a container in the job)
            why = str(err)
        if why is not None:
            say(f"ddlx: SLURM did not requeue job {self.job} ({why}); submit it with --requeue, or resume by hand "
                f"with ckpt_path={stop.checkpoint}", err=True)

    def forget(self) -> None:
        """The job's run is done: a later requeue (a node failure) starts no stale resume."""
        self.path.unlink(missing_ok=True)
