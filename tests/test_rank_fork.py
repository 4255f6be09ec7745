"""Extra ranks forked from train.py's server (ddlx.parallel.rank_fork): seen as started ranks
are (exit codes, kill, wait), and sharing the launching process's imports."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil
import pytest
from conftest import PROJECT_DIR, TINY, alive, compose_config, rank_workers, subprocess_env

from ddlx import rank_worker
from ddlx.parallel import rank_fork
from ddlx.parallel.rank_fork import RankForkServer
from ddlx.strategies import starts_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux only")


@contextlib.contextmanager
def fork_server():
    # Its ranks here never compute (a process whose OpenMP threads ran, as pytest's, cannot fork
    # ones that do).
    server = RankForkServer(rank_worker.main)
    try:
        yield server
    finally:
        server._conn.close()  # the server leaves when its pipe closes
        os.waitpid(server.pid, 0)


@pytest.mark.integration
def test_a_forked_rank_reports_its_exit_as_a_started_one(capfd):
    with fork_server() as server:
        rank = server.spawn(["only-one-argument"], {**os.environ, "LOCAL_RANK": "1"})
        assert rank.wait(timeout=30) == 1 and rank.poll() == 1
        assert psutil.Process(server.pid).name() == "ddlx-forker"
    assert "usage: python -m ddlx.rank_worker" in capfd.readouterr().err


@pytest.mark.integration
def test_a_forked_rank_writes_where_its_launcher_writes_when_it_asks(tmp_path):
    """The server was forked before the launcher's output went elsewhere (pytest's capture, a
    redirection): its ranks write where a rank started then would, the launcher's descriptors."""
    with fork_server() as server:
        saved = os.dup(2)
        with open(tmp_path / "err", "w") as err:
            os.dup2(err.fileno(), 2)
            try:
                rank = server.spawn(["only-one-argument"], {**os.environ, "LOCAL_RANK": "1"})
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        assert rank.wait(timeout=30) == 1
    assert "usage: python -m ddlx.rank_worker" in (tmp_path / "err").read_text()


def _ended(pid: int, timeout: float = 10.0) -> int | None:
    """The exit code of this process's child ``pid`` once it ends within ``timeout``; None if not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    return None


@pytest.mark.integration
@pytest.mark.parametrize("cut", ["interrupted_between_its_parts", "descriptors_missing"])
def test_a_rank_request_cut_short_lets_the_server_go(cut, monkeypatch):
    """A request is a message, then the launcher's descriptors 1 and 2. Cut short between the two
    (a Ctrl-C), or with its second part lacking them, the server ends rather than read the next
    request's message as this one's descriptors; the launcher lets it go, so no later job asks it."""
    server = RankForkServer(rank_worker.main)
    pid = server.pid

    def interrupted(channel, buffers, fds):
        raise KeyboardInterrupt

    def without_descriptors(channel, buffers, fds):
        return channel.sendmsg(buffers)

    monkeypatch.setattr(rank_fork.socket, "send_fds", interrupted if cut == "interrupted_between_its_parts" else without_descriptors)
    with pytest.raises(KeyboardInterrupt if cut == "interrupted_between_its_parts" else EOFError):
        server.spawn(["only-one-argument"], {**os.environ, "LOCAL_RANK": "1"})
    assert server.pid is None, "let go"
    assert _ended(pid) == 0, "the server ended, forking nothing"


@pytest.mark.integration
def test_a_forked_rank_is_waited_for_and_killed_as_a_started_one(tmp_path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)  # the rank blocks reading its config
    with fork_server() as server:
        rank = server.spawn([str(fifo), str(tmp_path)], {**os.environ, "LOCAL_RANK": "1"})
        with pytest.raises(subprocess.TimeoutExpired):
            rank.wait(timeout=1)
        assert rank.poll() is None and _named(rank.pid, "ddlx-rank-1")
        assert psutil.Process(rank.pid).ppid() == server.pid
        rank.kill()
        assert rank.wait(timeout=30) == -9


@pytest.mark.integration
def test_train_py_forks_its_ranks_sharing_its_imports(tmp_path):
    """rank 1 of a cpu_mp run under train.py is forked by its server, a child of rank 0, and the
    memory torch, Lightning and MLflow took at import is shared with rank 0, not its own."""
    proc = subprocess.Popen([sys.executable, str(PROJECT_DIR / "train.py"), f"paths.root={tmp_path}", *TINY,
                             "strategy=cpu_mp", "trainer.max_epochs=30"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=tmp_path)
    try:
        deadline, ranks = time.monotonic() + 120, []
        while not ranks and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            ranks = rank_workers(proc.pid)
        assert ranks, proc.stderr.read()[-3000:] if proc.poll() is not None else "no rank 1 within 120 s"
        rank = ranks[0]
        assert rank.name() == "ddlx-rank-1"
        server = psutil.Process(rank.ppid())
        assert server.name() == "ddlx-forker" and server.ppid() == proc.pid
        shared = _rollup_mb(rank.pid)["Shared_Dirty"]
        assert shared > 50, f"rank 1 shares {shared} MB of written memory with rank 0 and the server"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while alive([rank, server]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive([rank, server]), \
        "rank 0 killed: the server and its ranks end with it"


@pytest.mark.parametrize("overrides, forks", [
    (["strategy=sequential", "strategy.threads=2"], False),
    (["strategy=threads"], False),
    (["strategy=split"], False),
    (["strategy=pipe"], False),  # fairscale: one process
    (["strategy=mpi"], False),  # mpirun starts the ranks
    (["strategy=ddp_gloo", "strategy.processes=1"], False),
    (["strategy=cpu_mp", "strategy.processes=2"], True),
    (["strategy=fsdp", "strategy.processes=2"], True),
    (["strategy=pipe", "strategy.engine=torch"], True),
    (["strategy=hybrid", "strategy.processes=1", "strategy.local=pipe", "strategy.engine=torch"], True),
])
def test_only_a_job_that_starts_ranks_has_a_server(overrides, forks):
    """A server holds what its parent has written since the fork: made only for a job that
    starts ranks of its own."""
    assert starts_ranks(compose_config(overrides).strategy) is forks


@pytest.mark.integration
def test_a_sweep_whose_first_job_starts_no_ranks_forks_no_server_later(monkeypatch):
    """By its second job the process has computed, and cannot fork one (its ranks would hang)."""
    monkeypatch.setattr(rank_fork, "_first_job_seen", False)
    monkeypatch.setattr(rank_fork, "_server", None)
    rank_fork.start_fork_server(needed=False, entry=print)
    rank_fork.start_fork_server(needed=True, entry=print)
    assert rank_fork.fork_server() is None


def _named(pid: int, name: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while psutil.Process(pid).name() != name and time.monotonic() < deadline:
        time.sleep(0.1)
    return psutil.Process(pid).name() == name


def _rollup_mb(pid: int) -> dict[str, int]:
    values = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, *rest = line.split()
            if rest and rest[-1] == "kB":
                values[key.rstrip(":")] = int(rest[0]) // 1024
    return values
