"""Shared by the Hydra entry points: config resolvers and schemas, sweep tags and user-facing error reporting."""
from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .command_line import resume_command, resume_words, shell_words
from .errors import CheckpointNotWritten, ConfigError, RankDied, RankLost, RanksDisagree, Stopped, StoreError
from .job_log import say
from .process import LAUNCHERS, launch_rank


class SweepJobRefused(Exception):
    """A sweep job refused before training: Hydra records the job as failed and runs the next."""


def register_config(project_dir: Path) -> None:
    """The schemas (:mod:`ddlx.config`) and the resolvers configs use: ``${project_dir:}``, the
    folder holding train.py, so mlflow.db and data/ land there whatever the working directory;
    ``${job_id:}``, this job's id (:func:`job_id`), which keeps every run's folder its own. Its
    value is cached in the config, as ``${now:}``'s is, so launchers that compose each sweep job's
    config again in another process (submitit, on SLURM) keep the sweep's one folder."""
    from .config import register_schemas

    register_schemas()
    OmegaConf.register_new_resolver("project_dir", lambda: str(project_dir), replace=True)
    OmegaConf.register_new_resolver("job_id", job_id, replace=True, use_cache=True)


def register_recommend_config(project_dir: Path) -> None:
    """:func:`register_config`, and the fields every machine description has as ``hw``'s option
    ``schema``, which the hw files (and ``mode=probe``'s) extend with ``- schema``."""
    from hydra.core.config_store import ConfigStore

    from .costmodel.hardware import HardwareSpec

    register_config(project_dir)
    ConfigStore.instance().store(group="hw", name="schema", node=HardwareSpec)


_RANDOM_JOB_ID = uuid.uuid4().hex[:8]
MAX_JOB_ID = 24  # longer launcher ids (torchrun's: 57 characters) name a folder by a hash of them


@functools.cache  # one value per process: every resolution of a folder name agrees
def job_id() -> str:
    """The same for every process of one job and for no other job: the launcher's job id when
    SLURM (srun), mpirun or torchrun started several processes of it (each composes its own
    config), else random, drawn once per process (two runs started in the same second, on one
    machine or several sharing a file system, or in one SLURM allocation, must not share a folder)."""
    for launcher, size, names in LAUNCHERS:
        ids = [os.environ[n] for n in names if os.environ.get(n)]
        if int(os.environ.get(size) or 1) > 1 and ids:
            name = re.sub(r"[^A-Za-z0-9_-]", "_", "-".join(dict.fromkeys(ids)))  # a folder name (OpenMPI 5's has an @)
            if len(name) <= MAX_JOB_ID:  # SLURM's job and step, OpenMPI's job number: as squeue and ps say them
                return name
            return f"{launcher}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"  # torchrun's UUID, host and port
    return _RANDOM_JOB_ID


def hydra_job_tags(project_root: str) -> tuple[str, dict[str, str]]:
    """The job's output folder and, in a ``-m`` sweep, the tags that tie its run to the sweep:
    ``sweep_id`` (the sweep folder, relative to the project when inside it) and ``sweep_job``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return hydra_cfg.runtime.output_dir, {}
    sweep_dir = Path(hydra_cfg.sweep.dir).resolve()
    try:
        sweep_id = str(sweep_dir.relative_to(Path(project_root).resolve()))
    except ValueError:
        sweep_id = str(sweep_dir)
    job = list(hydra_cfg.overrides.task)
    params = OmegaConf.to_container(hydra_cfg.sweeper.params) if hydra_cfg.sweeper.get("params") else None
    swept = " ".join(swept_overrides(job, sweep_overrides(sweep_dir, job, params)))
    return hydra_cfg.runtime.output_dir, {"sweep_id": sweep_id, "sweep_job": str(hydra_cfg.job.num), "overrides": " ".join(job),
                                          **({"swept": swept} if swept else {})}


def sweep_overrides(sweep_dir: Path, job: list[str], params: dict | None) -> list[str]:
    """What a sweep was asked to vary, as the job ``job`` (its overrides) reads it: its sweeper's
    ``params`` (the job's own config's), then the sweep's command line as Hydra's sweeper recorded
    it in ``sweep_dir``'s multirun.yaml before any job started. A job reads it there because under a
    launcher plugin (submitit) its process runs with the launcher's command line, not the sweep's.
    Where there is no such file, or it is another sweep's (a fixed override the job does not
    have: a folder reused), this process's command line."""
    return [f"{key}={value}" for key, value in (params or {}).items()] + _sweep_command_line(sweep_dir, job)


def _sweep_command_line(sweep_dir: Path, job: list[str]) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def as_set(overrides):
        return {(o.key_or_group, o.get_value_element_as_str()) for o in overrides if not o.is_sweep_override()}

    parser = OverridesParser.create()
    try:
        recorded = OmegaConf.to_container(OmegaConf.load(sweep_dir / "multirun.yaml").hydra.overrides.task, resolve=False)
        if as_set(parser.parse_overrides(recorded)) <= as_set(parser.parse_overrides(job)):
            return [str(text) for text in recorded]
    except Exception:  # noqa: BLE001 - no such file, or not a sweeper's: the command line's
        pass
    from hydra._internal.utils import get_args_parser

    try:
        return list(get_args_parser().parse_args(sys.argv[1:]).overrides)
    except (Exception, SystemExit):  # noqa: BLE001 - not Hydra's command line (a launcher's own)
        return []


def swept_overrides(job: list[str], sweep: list[str]) -> list[str]:
    """Of a sweep job's overrides ``job``, those the sweep's overrides ``sweep`` vary (``a,b``,
    ``range()``, ``glob()``): what tells the job's run from the sweep's others. Of two overrides of
    one key the later counts, as Hydra's sweeper reads them (the command line's over the params)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        last = {o.key_or_group: o for o in parser.parse_overrides(sweep)}
        swept = {key for key, o in last.items() if o.is_sweep_override()}
        return [text for text, o in zip(job, parser.parse_overrides(job)) if o.key_or_group in swept]
    except Exception:  # noqa: BLE001 - not overrides Hydra reads: the name goes without
        return []


def report_config_errors(fn: Callable[[], Any], in_sweep: bool = False) -> Any:
    """Run ``fn``; a :class:`ConfigError` becomes one clear message, no traceback: exit status 2
    for a single run; in a sweep, a failed job (recorded as a FAILED MLflow run) and the sweep goes
    on, unless the store itself refuses (:class:`StoreError`): then no job could be recorded, and
    the sweep stops with exit status 2 rather than try each of them. In an MPI job (mpirun,
    srun), a single run's refusal ends every rank: the others may have passed the check that
    refused this one, and would wait for it forever."""
    try:
        return fn()
    except ConfigError as err:
        say(f"ddlx: error: {err}", err=True)
        if not in_sweep and not isinstance(err, RanksDisagree):  # RanksDisagree: every rank refuses together
            from .parallel.mpi_ranks import abort_job

            abort_job(2, show_traceback=False)
        if in_sweep:
            if not isinstance(err, StoreError):
                raise SweepJobRefused(str(err)) from None
            say("ddlx: the sweep stops here: its other jobs log to the same store and would be refused alike", err=True)
        raise SystemExit(2) from None


def run_training_job(fn: Callable[[], Any], in_sweep: bool, overrides: list[str], requeue=None) -> Any:
    """Run a train.py job (``fn``): config errors as :func:`report_config_errors`; a stop signal
    ends the process with 128 + its number (130 for Ctrl-C, 143 for SIGTERM), saying where the
    checkpoint is and the command that resumes from it (``overrides``: the job's own). Under
    SLURM (``requeue``: the job's :class:`ddlx.slurm.RequeueMarker`), a stopped job is left for
    its requeued start to resume, and requeued when SLURM warned it of its end."""
    try:
        result = report_config_errors(fn, in_sweep)
    except SweepJobRefused:
        if not jobs_run_in_this_process():
            raise  # the launcher counts the job failed by its exception (refused on every rank alike)
        REFUSED_JOBS.append(shell_words(*overrides))  # said once, and the sweep's exit status: end_sweep
        return None
    except (CheckpointNotWritten, RankLost) as err:
        _end_job_with_error(err)
    except RankDied:  # said in full where it was found (ddlx.run.RankDeath): no traceback
        from .parallel.mpi_ranks import abort_job

        abort_job(1, show_traceback=False)
        raise SystemExit(1) from None
    except Exception:
        from .parallel.mpi_ranks import abort_job

        abort_job(1)  # under mpirun: the other ranks may be gone (their node lost), and MPI's exit would wait for them
        raise
    except Stopped as stop:
        say(f"ddlx: {stop}", err=True)
        if stop.resumable:
            say(f"ddlx: {resume_words(stop.launcher)}: {resume_command(overrides, stop.checkpoint)}", err=True)
        if requeue is not None and stop.after_training:
            if launch_rank() == 0:
                requeue.forget()
        elif requeue is not None:
            requeue.after_stop(stop, rank0=launch_rank() == 0)
        raise SystemExit(stop.exit_status) from None
    if requeue is not None and launch_rank() == 0:
        requeue.forget()
    return result


def _end_job_with_error(err: BaseException) -> None:
    """An error the run has recorded (FAILED, tag ``error``) and one line says in full: no traceback."""
    from .parallel.mpi_ranks import abort_job

    say(f"ddlx: error: {err}", err=True)
    abort_job(1, show_traceback=False)
    raise SystemExit(1) from None


# The overrides of the sweep jobs this process refused before training (each a FAILED run).
REFUSED_JOBS: list[str] = []
# The sweeps whose jobs this process ran, as (sweep_id, tracking_uri, experiment): said at their end.
SWEEPS_RUN: dict[tuple[str, str, str], None] = {}


def jobs_run_in_this_process() -> bool:
    """Whether Hydra runs the sweep's jobs one after another in this process (its basic launcher),
    so a refused job can end without an exception and the sweep's exit status still say it."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().launcher.get("_target_", "").endswith("BasicLauncher")


def note_sweep_job(tags: dict[str, str], logger_cfg) -> None:
    """Keep the sweep of this job (``tags`` from :func:`hydra_job_tags`), when its jobs run in this
    process and this is the one that speaks for them, for :func:`end_sweep`."""
    if "sweep_id" in tags and jobs_run_in_this_process() and launch_rank() == 0:
        SWEEPS_RUN[(tags["sweep_id"], logger_cfg.tracking_uri, logger_cfg.experiment_name)] = None


def end_sweep(failed: bool = False) -> None:
    """After a sweep: what its runs came to and the command that compares them; then, unless it
    ``failed`` (its own exit status stands), exit 1 when any of its jobs was refused before
    training (each said why as it came, and has a FAILED run with the reason)."""
    from .report import sweep_end

    for sweep_id, tracking_uri, experiment in SWEEPS_RUN:
        try:
            print("\n".join(sweep_end(sweep_id, tracking_uri, experiment)), flush=True)
        except Exception as err:  # noqa: BLE001 (a summary: the store unreachable now, each run said where it is)
            if not failed:  # a failed sweep said why already (a store that refused is one)
                print(f"ddlx: sweep {sweep_id} ended; its runs could not be read back ({type(err).__name__}: {err})",
                      file=sys.stderr)
    if REFUSED_JOBS and not failed:
        print(f"ddlx: {len(REFUSED_JOBS)} job(s) of the sweep refused before training (FAILED runs, with the reason): "
              + "; ".join(REFUSED_JOBS), file=sys.stderr)
        raise SystemExit(1)


def resume_requeued_job(cfg, tags: dict[str, str]):
    """Under SLURM, the job's :class:`ddlx.slurm.RequeueMarker` (None outside SLURM); when SLURM
    requeued this job after a stop, ``cfg.ckpt_path`` becomes the checkpoint it stopped with."""
    from .slurm import RequeueMarker

    marker = RequeueMarker.of_this_job(cfg.paths.root, tags.get("sweep_job"))
    checkpoint = marker.checkpoint_to_resume() if marker is not None else None
    if checkpoint is not None:
        say(f"ddlx: SLURM job {marker.job} was requeued: resuming from {checkpoint}", err=True)
        cfg.ckpt_path = checkpoint
    return marker


