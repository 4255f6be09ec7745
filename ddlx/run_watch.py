"""The watch of one run's process (:class:`ddlx.tracking.ProcessWatch` starts it):

    python -m ddlx.run_watch TRACKING_URI RUN_ID PID   (stdin: HOW_TO_RESUME, then "closed")

Waits for the run's process ``PID`` to end or to say the run is closed (a second line on stdin).
When the process ended first (kill -9, the out-of-memory killer, a crash), the run it left
RUNNING is marked FAILED with the reason, at once rather than at the next command against the
store, and the console is told how to resume it (the first line on stdin: a
:class:`ddlx.command_line.HowToResume` as JSON, or empty), as the process itself would have said.
That line comes on stdin, not among the arguments, so that ``pkill -f train.py`` (or any of the
job's words) takes the run's process and leaves its watch to mark the run.
"""
from __future__ import annotations

import os
import select
import signal
import sys

POLL_S = 0.5  # where the kernel cannot say when a process ends (no pidfd), how often to look


def read_line(fd: int, kept: bytearray) -> bytes | None:
    """The next line from ``fd``, without its newline (``kept``: what was read past it, for the
    next call); None at the end of the file (the run's process ended before writing it)."""
    while b"\n" not in kept:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        kept += chunk
    line, _, rest = bytes(kept).partition(b"\n")
    kept[:] = rest
    return line


def wait_for_end(pid: int, fd: int, kept: bytearray) -> bool:
    """Block until ``pid`` ends (False) or a line comes on ``fd``, the run closed (True)."""
    if kept:  # (read with the first line)
        return True
    watched: list = [fd]
    try:
        watched.append(os.pidfd_open(pid))  # readable when the process ends (Linux 5.3+)
    except (AttributeError, OSError):
        pass
    while True:
        ready, _, _ = select.select(watched, [], [], POLL_S)
        if fd in ready:
            return bool(os.read(fd, 1 << 16))  # end of file: the process closed the pipe by ending
        if ready or not _alive(pid):
            return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> int:
    tracking_uri, run_id, pid = argv[0], argv[1], int(argv[2])
    for signum in (signal.SIGINT, signal.SIGHUP):  # a terminal's signals are for the run's process
        signal.signal(signum, signal.SIG_IGN)
    fd, kept = sys.stdin.fileno(), bytearray()
    said = read_line(fd, kept)  # None: the process ended before saying how to resume
    if said is not None and wait_for_end(pid, fd, kept):
        return 0
    from .tracking import close_if_vanished

    reason = close_if_vanished(tracking_uri, run_id)
    if reason is not None:
        print(f"ddlx: MLflow run {run_id} marked FAILED: {reason}", file=sys.stderr, flush=True)
        if said:
            from .command_line import HowToResume

            HowToResume.from_json(said.decode()).say()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
