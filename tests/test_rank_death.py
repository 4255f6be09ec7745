"""A rank process that dies (kill -9, the out-of-memory killer, a crash) is said once, by its
signal, with the resume command; an error a rank raises itself, or ddlx's own kill of ranks left
at a job's end, is not reported as a death. (A real kill: tests/test_strategies.py
test_killed_rank_does_not_hang_the_others.)"""
from __future__ import annotations

import subprocess
import sys
import threading

from ddlx.parallel.launch import WorkerLauncher, _RecordingObserver, how_it_ended
from ddlx.command_line import HowToResume
from ddlx.run import RankDeath


def _ended(code_line: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code_line])
    proc.wait()
    return proc


def _launcher(*procs: subprocess.Popen) -> WorkerLauncher:
    launcher = object.__new__(WorkerLauncher)  # only its ranks' processes matter here
    launcher.procs = list(procs)
    return launcher


def test_a_rank_end_is_named_by_its_signal_or_its_code():
    assert how_it_ended(1, -9) == "rank 1 was killed by SIGKILL (kill -9, or the out-of-memory killer)"
    assert how_it_ended(2, -11) == "rank 2 was killed by SIGSEGV"
    assert how_it_ended(3, 1) == "rank 3 exited with code 1"


def test_only_a_rank_killed_by_a_signal_counts_as_dead():
    killed = _ended("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    failed = _ended("raise SystemExit(1)")  # its own error: rank 0's may be the same, and is its own story
    assert _launcher(failed, killed).dead_ranks(wait_s=0.1) == "rank 2 was killed by SIGKILL (kill -9, or the out-of-memory killer)"
    assert _launcher(failed).dead_ranks(wait_s=0.1) is None
    assert _launcher().dead_ranks(wait_s=60) is None, "one process: nothing to wait for"


def test_ranks_ended_by_the_job_itself_are_not_reported():
    said = []
    observer = _RecordingObserver(0, [_ended("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")], said.append)
    observer.stopped = True  # WorkerLauncher.join, before it waits for (and may kill) the ranks
    assert observer._run() is True and said == []


def test_a_death_is_said_once_with_the_resume_command_then_recorded(tmp_path, capsys):
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.write_bytes(b"")
    death = RankDeath(tmp_path, HowToResume.of([], checkpoint, weights_only=False))
    threads = [threading.Thread(target=death, args=(None, "rank 1 was killed by SIGKILL")) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"ddlx: run FAILED: rank 1 was killed by SIGKILL; its folder: {tmp_path}",
                   f"ddlx: resume with: python train.py ckpt_path={checkpoint}"]
    RankDeath(tmp_path, HowToResume.of([], None, weights_only=False))(None, "rank 1 was killed by SIGKILL")
    assert "checkpoint.save=none" in capsys.readouterr().err
    RankDeath(tmp_path, HowToResume.of([], checkpoint, weights_only=True))(None, "rank 1 was killed by SIGKILL")  # a resume would be refused
    assert "checkpoint.save=weights" in capsys.readouterr().err


def test_a_checkpoint_older_than_the_run_is_not_offered_to_resume_it(tmp_path, capsys):
    """A new run in a reused folder fails before writing its own: the last.ckpt there is another run's."""
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.write_bytes(b"")
    HowToResume.of([], checkpoint, weights_only=False, not_before=checkpoint.stat().st_mtime + 60).say()
    assert capsys.readouterr().err == "ddlx: no checkpoint was written before it\n"
    HowToResume.of([], checkpoint, weights_only=False, not_before=checkpoint.stat().st_mtime).say()
    assert capsys.readouterr().err == f"ddlx: resume with: python train.py ckpt_path={checkpoint}\n"
