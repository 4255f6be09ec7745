"""The watch of one run's process (:class:`ddlx.tracking.ProcessWatch` starts it):

    python -m ddlx.run_watch TRACKING_URI RUN_ID PID [HOW_TO_RESUME]

Waits for the run's process ``PID`` to end or to say the run is closed (a line on stdin). When
the process ended first (kill -9, the out-of-memory killer, a crash), the run it left RUNNING is
marked FAILED with the reason, at once rather than at the next command against the store, and
the console is told how to resume it (``HOW_TO_RESUME``: :class:`ddlx.command_line.HowToResume`
as JSON), as the process itself would have said.
"""
from __future__ import annotations

import os
import select
import signal
import sys

POLL_S = 0.5  # where the kernel cannot say when a process ends (no pidfd), how often to look


def wait_for_end(pid: int) -> bool:
    """Block until ``pid`` ends (False) or a line comes on stdin, the run closed (True)."""
    watched: list = [sys.stdin]
    try:
        watched.append(os.pidfd_open(pid))  # readable when the process ends (Linux 5.3+)
    except (AttributeError, OSError):
        pass
    while True:
        ready, _, _ = select.select(watched, [], [], POLL_S)
        if sys.stdin in ready:
            return bool(sys.stdin.readline())  # end of file: the process closed the pipe by ending
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
    if wait_for_end(pid):
        return 0
    from .tracking import close_if_vanished

    reason = close_if_vanished(tracking_uri, run_id)
    if reason is not None:
        print(f"ddlx: MLflow run {run_id} marked FAILED: {reason}", file=sys.stderr, flush=True)
        if len(argv) > 3:
            from .command_line import HowToResume

            HowToResume.from_json(argv[3]).say()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
