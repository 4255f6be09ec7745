"""This process: who started it (ddlx's launcher, or mpirun, srun, torchrun), its name and its end
with its parent (Linux's prctl; elsewhere nothing), for the ranks, the fork server and the loader
workers alike."""
from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # linux/prctl.h
WORKER_ENV = "DDLX_RANK_WORKER"
PARENT_ENV = "DDLX_RANK_PARENT"  # the launching process: a worker ends with it (ddlx.rank_worker)
STARTED_EXTERNALLY = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID")
# Launchers that start every rank of a job themselves: the name a user runs, the variable that
# says how many processes they started, and those that name the job (the same in each of them).
LAUNCHERS = (("srun", "SLURM_STEP_NUM_TASKS", ("SLURM_JOB_ID", "SLURM_STEP_ID")),
             ("mpirun", "OMPI_COMM_WORLD_SIZE", ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")),
             ("mpiexec", "PMI_SIZE", ("PMIX_NAMESPACE",)),
             ("torchrun", "WORLD_SIZE", ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")))


def is_rank_worker() -> bool:
    """An extra rank started by ddlx's own launcher."""
    return os.environ.get(WORKER_ENV) == "1"


def outside_launcher() -> tuple[str, int] | None:
    """(its name, how many processes) where a launcher other than ddlx started this job's
    processes, several of them: a resumed run must be started the same way."""
    if is_rank_worker():
        return None
    # srun's last: mpirun within an allocation starts its daemons with srun, whose variables its ranks inherit
    for name, size, _ in sorted(LAUNCHERS, key=lambda launcher: launcher[0] == "srun"):
        count = int(os.environ.get(size) or 1)
        if count > 1 and (name != "torchrun" or "TORCHELASTIC_RUN_ID" in os.environ):  # (Lightning sets WORLD_SIZE)
            return name, count
    return None


def launch_rank() -> int:
    """This process's global rank as its launcher tells it, known before Lightning sets ranks up
    (Lightning's own guess at import time cannot see MPI ranks)."""
    if is_rank_worker():
        return int(os.environ.get("NODE_RANK", 0)) * 1000 + int(os.environ["LOCAL_RANK"])  # any non-zero
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def rank_logging() -> None:
    """An extra rank's logging: its warnings and errors, said plainly; rank 0 says the rest (in
    Hydra's job log). Set before Lightning is imported in a new interpreter: Lightning gives its
    loggers a handler of their own at INFO where the root has none, and rank 1 then printed
    'Seed set to 42' and 'Initializing distributed' beside rank 0's lines."""
    import logging

    root = logging.getLogger()
    for handler in list(root.handlers):  # a forked rank's: the launching process's (Hydra's job log)
        root.removeHandler(handler)
    said = logging.StreamHandler(sys.stderr)
    said.setLevel(logging.WARNING)  # Lightning's loggers are at INFO, and pass theirs on to the root
    root.addHandler(said)
    root.setLevel(logging.WARNING)


def end_with_parent(expected_parent: int | None = None) -> bool:
    """Have the kernel kill this process when its parent ends. False when the parent has already
    gone (the process was reparented before the call), or is not ``expected_parent``."""
    import ctypes

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    alive = parent != 1 and os.getppid() == parent
    return alive and (expected_parent is None or parent == expected_parent)


def ddlx_module_command(module: str, *args: str) -> list[str]:
    """The command that runs ``python -m module args`` on the ddlx this process runs: ``train.py``'s
    folder is on its own path, not on a child's, and may hold another clone than the installed one,
    or the only one; and a child's current folder comes before PYTHONPATH. An installed ddlx (a
    site folder) is left to the child's own path, whose other packages it must not move ahead."""
    import site

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root in {os.path.abspath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}:
        return [sys.executable, "-m", module, *args]
    run = f"import sys, runpy; sys.path.insert(0, {root!r}); runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", run, *args]


def forked(target, args: tuple, name: str, daemon: bool = True):
    """``target(*args)`` started in a forked child, for work done ahead of its need while this
    process does other work (:mod:`ddlx.predict.count_ahead`, :func:`ddlx.data.synthetic.write_ahead`);
    None where there is no fork (not Linux). ``target`` should end with ``os._exit``, so that no
    exit handler of this process's (Hydra's, logging's) runs in the child; a daemon (ended with this
    process at its exit) may not have children of its own."""
    if not sys.platform.startswith("linux"):
        return None
    import multiprocessing

    sys.stdout.flush()  # the child must not write out this process's buffered lines a second time
    sys.stderr.flush()
    child = multiprocessing.get_context("fork").Process(target=target, args=args, daemon=daemon, name=name)
    child.start()
    return child


# Longer than any work done ahead takes (counting ResNet-152 at 224 px: about 10 s on one core of
# the build machine): a child stuck past it is stopped, and the caller does the work itself.
WAIT_S = 300.0


def wait_for(child, timeout_s: float = WAIT_S) -> None:
    """Join a :func:`forked` child (None: there is none), killing it past ``timeout_s``."""
    if child is None:
        return
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()


def ended_by_ctrl_c(command: str, main, said: str = "no result was logged", hold_in_omegaconf: bool = False) -> int:
    """``main()``'s exit status, or 130 (the shell's for SIGINT) with one line where Ctrl-C stops
    ``command`` (a question, a report: seconds to minutes; train.py outside its run), not a
    traceback from wherever it fell (an import, a probe); ``said``: what that leaves. Its forked
    children take the same SIGINT and end silently; a result run being logged is marked KILLED
    (:func:`ddlx.tracking.log_result_run`).

    ``hold_in_omegaconf``: ``main`` composes Hydra configs and runs jobs wrapped in
    :func:`job_takes_ctrl_c`. Outside those jobs, a Ctrl-C that falls inside omegaconf (a config
    being composed) is held and raised at the next point where it cannot harm: after each job's
    composition in the command line's check (:func:`raise_held_ctrl_c`), where a job starts (Hydra
    has made its folder by then), where ``main`` ends. Raised inside omegaconf, it left a node half
    made and omegaconf's cleanup failed on it: a bogus config error (status 2), omegaconf's error
    (status 1), or it was lost and the job ran on. Elsewhere (a launcher waiting on its jobs) it
    stops at once.
    """
    _OutsideJobs.holding = hold_in_omegaconf
    try:
        _hold_ctrl_c()
        status = main() or 0
        raise_held_ctrl_c()  # one held since the last job (Hydra's own end) stops here
        return status
    except KeyboardInterrupt:
        pass
    except SystemExit:
        if not _OutsideJobs.held:  # a held Ctrl-C, not --help's 0 or a failed sweep's 1, says how it ended
            raise
    finally:
        _release_ctrl_c()
        _OutsideJobs.holding = _OutsideJobs.held = False
    print(f"\nddlx: {command} stopped by Ctrl-C before its end: {said}", file=sys.stderr)
    return 130


def job_takes_ctrl_c(job):
    """Inside ``job`` (a Hydra task function) Ctrl-C raises where it falls, as in any process (its
    imports; its run's stop signals: ddlx.stopping); a Ctrl-C held while Hydra composed the job's
    config (:func:`ended_by_ctrl_c`) is raised before the job runs, and holding resumes after it.
    The folder Hydra made for that job, holding only Hydra's files, goes with it: no run was in it
    (but for a job of a launcher's ranks, which share it: another may be writing there)."""
    import functools

    @functools.wraps(job)  # Hydra finds the job's file through __wrapped__ (its config_path is relative to it)
    def taking_ctrl_c(*args, **kwargs):
        _release_ctrl_c()
        if _OutsideJobs.held and _on_main_thread():
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.initialized() and outside_launcher() is None:  # (a launcher's ranks share it: one may write there)
                _remove_unstarted_job_folder(HydraConfig.get().runtime.output_dir)
        raise_held_ctrl_c()
        try:
            return job(*args, **kwargs)
        finally:
            _hold_ctrl_c()

    return taking_ctrl_c


def raise_held_ctrl_c() -> None:
    """A Ctrl-C held inside omegaconf (:func:`ended_by_ctrl_c`) stops the entry here."""
    if _OutsideJobs.held and _on_main_thread():
        _OutsideJobs.held = False
        raise KeyboardInterrupt


def _remove_unstarted_job_folder(output_dir: str) -> None:
    """Hydra's folder for a job stopped before it ran, if nothing but Hydra wrote in it: its config
    copies (.hydra) and an empty log. A folder with more (a fixed ``hydra.run.dir`` reused) is kept."""
    import contextlib
    import shutil
    from pathlib import Path

    folder = Path(output_dir)
    hydras = {Path(".hydra", name) for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if path.is_dir() and relative == Path(".hydra") or relative in hydras:
            continue
        if not (relative.suffix == ".log" and relative.parent == Path(".") and path.stat().st_size == 0):
            return
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # a run's day folder made for it alone; a sweep's holds multirun.yaml
        folder.parent.rmdir()


class _OutsideJobs:
    holding = False  # this process's entry holds a Ctrl-C that falls inside omegaconf outside its jobs
    held = False


def _hold_ctrl_c() -> None:
    """Where the entry holds (:func:`ended_by_ctrl_c`): a SIGINT ignored (a background job's) or
    handled by another (a run's) is left as it is."""
    if _OutsideJobs.holding and _on_main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _note_ctrl_c)


def _release_ctrl_c() -> None:
    if _on_main_thread() and signal.getsignal(signal.SIGINT) is _note_ctrl_c:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _note_ctrl_c(signum: int, frame) -> None:
    while frame is not None:
        if frame.f_globals.get("__name__", "").partition(".")[0] == "omegaconf":
            _OutsideJobs.held = True  # a second Ctrl-C inside omegaconf too: its next point is close
            return
        frame = frame.f_back
    raise KeyboardInterrupt


def _on_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def name_process(name: str) -> None:
    """This process's name as ps, top and psutil show it (its command line stays the launching
    one's: a forked process cannot change that)."""
    import ctypes

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15])


def exit_without_collecting() -> None:
    """At this process's exit, leave its objects to the operating system rather than to Python's
    last garbage collections, which walk every object torch, torchvision, Lightning and MLflow made
    (seconds of a train.py call's end: docs/measuring.md, ``benchmarks/exit_time.py``). Registered
    as the entry point starts, it runs after the exit handlers the job registers (MLflow's,
    Lightning's); every atexit handler still runs and closes what it owns. What no longer runs at
    exit is ``__del__`` (and weakref callbacks) of objects left in reference cycles: close files,
    connections and workers explicitly, not by garbage collection (ddlx does)."""
    import atexit
    import gc

    atexit.register(gc.freeze)
