"""Extra ranks forked from a copy of the launching process made right after its imports.

A rank started as a new interpreter (``python -m ddlx.rank_worker``) imports torch, Lightning
and MLflow again: about half a GB of memory of its own (relocated library data, Python objects)
and seconds of start-up per rank, on the same machine as rank 0 that holds the same. train.py
instead forks a small server from its process once its imports are done and before anything has
computed, when its job starts ranks itself (:func:`start_fork_server`); the launcher asks it for each extra rank
(:meth:`RankForkServer.spawn`), a fork that shares those pages with rank 0 until written, and
runs the same ``ddlx.rank_worker`` entry on the job's own config and environment, as a new
interpreter would. Forking later would not do: a process whose OpenMP threads have run cannot
fork children that use them (they hang), which is why the server is made before any job runs
and is never used where it was not (a caller of ``ddlx.run.train`` in its own process gets
ranks as new interpreters, as before).

The server ends with its parent, each rank with the server (``PR_SET_PDEATHSIG``), so a rank 0
killed with -9 leaves no process behind; the server reports each rank's exit status, which
:class:`ForkedRank` answers as :class:`subprocess.Popen` would (what Lightning's watchdog reads).
A forked process keeps the command line it was forked with: ps and top tell them by name
(``ddlx-forker``, ``ddlx-rank-1``, ...; loader workers ``ddlx-loader``).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ..process import PARENT_ENV, STARTED_EXTERNALLY, end_with_parent, is_rank_worker, name_process

log = logging.getLogger(__name__)

SERVER_NAME, RANK_NAME = "ddlx-forker", "ddlx-rank-{}"  # what ps and top show
POLL_S = 0.2
# Stop signals go to every process of the terminal's group or the job: they are for the ranks
# (each stops after its step); the server outlives them until its parent ends.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

_server: RankForkServer | None = None
_first_job_seen = False


def start_fork_server(needed: bool, entry: Callable[[list[str]], None]) -> None:
    """Call it at the start of every job of this process, before anything computes: on Linux it
    forks the rank server when the process's first job ``needed`` one (it starts extra ranks
    itself, not mpirun, srun or torchrun; this is no rank). Later jobs of a sweep use that server;
    when the first job did not need one, they start their ranks as new interpreters (a process
    that has computed cannot fork a server: see the module's docstring). Each forked rank runs
    ``entry`` with the launcher's arguments (the server is given it: it does not import the
    rank's entry point, which imports the training above it)."""
    global _server, _first_job_seen
    first, _first_job_seen = not _first_job_seen, True

    if not (needed and first) or not sys.platform.startswith("linux") or is_rank_worker() \
            or any(name in os.environ for name in STARTED_EXTERNALLY):
        return
    _server = RankForkServer(entry)


def fork_server() -> RankForkServer | None:
    return _server if _server is not None and _server.pid is not None else None


class RankForkServer:
    def __init__(self, entry: Callable[[list[str]], None]) -> None:
        """``entry``: what each forked rank runs with the launcher's arguments (ddlx.rank_worker.main)."""
        ours, theirs = multiprocessing.Pipe()
        sys.stdout.flush()
        sys.stderr.flush()  # a forked copy would write what is buffered again
        pid = os.fork()
        if pid == 0:  # the server
            ours.close()
            code = 1
            try:
                _serve(theirs, entry)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        self.pid: int | None = pid
        self._conn = ours
        self._lock = threading.Lock()
        self._codes: dict[int, int] = {}  # exit codes of ended ranks, as Popen's returncode

    def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedRank:
        """A rank running ``ddlx.rank_worker`` with ``argv`` in ``env``, this directory and this
        process's standard output and error as they are now (where a started rank would write)."""
        with self._lock:
            try:
                self._conn.send(("spawn", argv, env, os.getcwd()))
                with socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as channel:
                    socket.send_fds(channel, [b"\0"], [1, 2])
                while True:
                    message = self._conn.recv()
                    if message[0] == "pid":
                        return ForkedRank(self, message[1], argv)
                    self._note(message)
            except BaseException:
                # A request cut short (an interrupt, a closed descriptor) would leave the two ends out
                # of step: the server is let go (it ends, and any rank it forked with it), and later
                # jobs start their ranks as new interpreters.
                self._conn.close()
                self.pid = None
                raise

    def returncode(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """``pid``'s exit code once the server has seen it end, waiting up to ``timeout`` (None: for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._codes:
                left = POLL_S if deadline is None else deadline - time.monotonic()
                try:
                    if left <= 0 and not self._conn.poll():
                        return None
                    if self._conn.poll(max(0.0, min(left, POLL_S))):
                        self._note(self._conn.recv())
                except (EOFError, OSError):  # the server is gone, and its ranks with it
                    self.pid = None
                    return self._codes.setdefault(pid, -signal.SIGKILL)
            return self._codes[pid]

    def _note(self, message) -> None:
        if message[0] == "exit":
            self._codes[message[1]] = message[2]


class ForkedRank:
    """A rank forked by the server, seen as the :class:`subprocess.Popen` of a started one."""

    def __init__(self, server: RankForkServer, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _serve(conn, entry: Callable[[list[str]], None]) -> None:
    """The server's loop: fork a rank per request, report each rank's end; leave when the
    launching process does (its end of the pipe closes, or the kernel's signal)."""
    if not end_with_parent():
        return
    name_process(SERVER_NAME)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    ranks: set[int] = set()
    while True:
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            ranks.discard(pid)
            conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))
        try:
            if not conn.poll(POLL_S):
                continue
            _, argv, env, cwd = conn.recv()
            with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as channel:
                marker, outputs, _, _ = socket.recv_fds(channel, 1, 2)
        except (EOFError, OSError):
            return
        if marker != b"\0" or len(outputs) != 2:  # not the request's second part: the launcher is gone
            for fd in outputs:
                os.close(fd)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            conn.close()
            for fd, standard in zip(outputs, (1, 2)):
                if fd != standard:
                    os.dup2(fd, standard)
                    os.close(fd)
            _run_rank(argv, env, cwd, entry)
        for fd in outputs:
            os.close(fd)
        ranks.add(pid)
        conn.send(("pid", pid))


def _run_rank(argv: list[str], env: dict[str, str], cwd: str, entry: Callable[[list[str]], None]) -> None:
    """In the forked rank: the job's environment and directory, default signal handling and
    error reporting, as a new interpreter would have them; then the rank's entry, which sets its
    logging (ddlx.rank_worker: the launching process's handlers are Hydra's job log). Never returns."""

    code = 1
    try:
        name_process(RANK_NAME.format(env.get("LOCAL_RANK", "")))
        end_with_parent()  # the server: it leaves only when the launching process has ended
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env, **{PARENT_ENV: str(os.getppid())})  # the server: the rank ends with it
        os.chdir(cwd)
        # The interpreter's own error reporting, not the launcher's (pytest's collect thread errors
        # into a list that a rank, ending with os._exit, would never print)
        sys.excepthook, sys.unraisablehook, threading.excepthook = \
            sys.__excepthook__, sys.__unraisablehook__, threading.__excepthook__
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # the descriptors, whatever wrapped them
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.argv = [sys.executable, "-m", "ddlx.rank_worker", *argv]
        entry(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as an interpreter would, then the exit code says it
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
