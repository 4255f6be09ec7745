"""An entry point's exit with its objects left out of Python's last collections
(ddlx.process.exit_without_collecting): every exit handler still runs, and the exit status stands.
(How much faster it ends: benchmarks/exit_time.py.) Its end by Ctrl-C (ddlx.process.ended_by_ctrl_c)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import CONF_DIR, PROJECT_DIR, subprocess_env


def test_an_exit_without_collecting_still_runs_every_handler_and_keeps_its_status(tmp_path):
    child = f"""
import atexit, gc, sys
sys.path.insert(0, {str(PROJECT_DIR)!r})
from pathlib import Path
atexit.register(lambda: Path({str(tmp_path / 'earlier')!r}).write_text(str(gc.get_freeze_count())))  # as logging's
from ddlx.process import exit_without_collecting
exit_without_collecting()
atexit.register(lambda: Path({str(tmp_path / 'later')!r}).write_text(str(gc.get_freeze_count())))  # as MLflow's
raise SystemExit(3)
"""
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert (tmp_path / "later").read_text() == "0", "a handler the job registers runs, before the freeze"
    assert int((tmp_path / "earlier").read_text()) > 0, "one registered before it runs too, the objects frozen by then"


@pytest.mark.parametrize("entry", [["train.py"], ["recommend.py"], ["-m", "ddlx.report"]])
def test_every_entry_point_exits_without_collecting(entry, tmp_path):
    """train.py, recommend.py and the report each register the freeze (a handler registered
    before the entry runs sees its objects frozen), whatever their job; ``--help`` is the least."""
    child = f"""
import atexit, gc, runpy, sys
from pathlib import Path
atexit.register(lambda: Path({str(tmp_path / 'frozen')!r}).write_text(str(gc.get_freeze_count())))
entry = {entry!r}
sys.argv = [entry[-1], "--help"]
runpy.run_module(entry[1], run_name="__main__", alter_sys=True) if entry[0] == "-m" else runpy.run_path(entry[0], run_name="__main__")
"""
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=PROJECT_DIR,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int((tmp_path / "frozen").read_text()) > 0, f"{' '.join(entry)} ends without Python's last collections"


def test_ctrl_c_outside_the_jobs_is_held_inside_omegaconf_only():
    """Outside a Hydra entry's jobs, a Ctrl-C that falls inside omegaconf (a config being composed)
    is held and stops the entry where the next job starts, before the job, or where it ends, also
    by SystemExit (--help's); holding resumes after a job that failed. One anywhere else (a
    launcher waiting on its jobs) stops it at once. The handler is the default's again after."""
    from omegaconf import OmegaConf

    from ddlx.process import ended_by_ctrl_c, job_takes_ctrl_c

    OmegaConf.register_new_resolver("ddlx_test_ctrl_c", lambda: os.kill(os.getpid(), signal.SIGINT) or 1)
    done = []

    def compose_with_ctrl_c():
        assert OmegaConf.create({"x": "${ddlx_test_ctrl_c:}"}).x == 1  # the Ctrl-C falls inside omegaconf
        done.append("composed")

    @job_takes_ctrl_c
    def job(fail=False):
        done.append("job")
        if fail:
            raise ValueError("a failed job: Hydra's basic launcher goes on")

    def composing_then_job():
        compose_with_ctrl_c()
        job()

    def composing_then_exit():
        compose_with_ctrl_c()
        raise SystemExit(0)

    def failed_job_then_composing():
        try:
            job(fail=True)
        except ValueError:
            pass
        compose_with_ctrl_c()

    def waiting():
        os.kill(os.getpid(), signal.SIGINT)
        done.append("waited on")

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job's SIGINT is ignored
    try:
        assert ended_by_ctrl_c("cmd", composing_then_job, hold_in_omegaconf=True) == 130
        assert done == ["composed"], "held through the composing, raised where the job starts"
        assert ended_by_ctrl_c("cmd", composing_then_exit, hold_in_omegaconf=True) == 130
        done.clear()
        assert ended_by_ctrl_c("cmd", failed_job_then_composing, hold_in_omegaconf=True) == 130
        assert done == ["job", "composed"], "held again after the failed job, raised where the entry ends"
        done.clear()
        assert ended_by_ctrl_c("cmd", waiting, hold_in_omegaconf=True) == 130
        assert done == [], "outside omegaconf: at once"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
        OmegaConf.clear_resolver("ddlx_test_ctrl_c")


def test_a_job_folder_stopped_before_its_job_goes_only_if_hydra_alone_wrote_in_it(tmp_path):
    """A Ctrl-C held while Hydra composed a job stops it where it starts (above), after Hydra made
    its folder: that folder goes, with its day folder if that is left empty, unless something
    other than Hydra's config copies and an empty log is in it (a reused ``hydra.run.dir``)."""
    import shutil

    from ddlx.process import _remove_unstarted_job_folder

    def hydras_folder(name, *more):
        folder = tmp_path / "outputs" / "2026-11-29" / name
        (folder / ".hydra").mkdir(parents=True)
        for written in (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "train.log", *more):
            (folder / written).write_text("x" if written.endswith(".yaml") or written in more else "")
        return folder

    kept = [hydras_folder("with-a-checkpoint", "last.ckpt"), hydras_folder("with-a-log", "train.log")]
    for folder in kept:
        _remove_unstarted_job_folder(str(folder))
    assert all(folder.is_dir() and (folder / ".hydra" / "config.yaml").is_file() for folder in kept)
    for folder in kept:
        shutil.rmtree(folder)
    only_hydras = hydras_folder("only-hydras")
    _remove_unstarted_job_folder(str(only_hydras))
    assert not only_hydras.exists() and not only_hydras.parent.exists() and (tmp_path / "outputs").is_dir()


@pytest.mark.parametrize("launcher", [{}, {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}],
                         ids=["its own process", "a rank of mpirun's"])
def test_a_job_stopped_before_it_ran_leaves_its_folder_only_to_a_launchers_ranks(tmp_path, monkeypatch, launcher):
    """The ranks a launcher started share the job's folder: one stopped there must not take it
    from another that may be writing in it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict, read_write

    from ddlx import process

    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    folder = tmp_path / "outputs" / "2026-11-29" / "10-00-00-abc"
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("x")
    ran = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.runtime.output_dir = str(folder)
    HydraConfig.instance().set_config(cfg)
    monkeypatch.setattr(process._OutsideJobs, "held", True)
    try:
        with pytest.raises(KeyboardInterrupt):
            process.job_takes_ctrl_c(lambda: ran.append(1))()
    finally:
        HydraConfig.instance().cfg = None
    assert ran == [] and folder.exists() == bool(launcher)
