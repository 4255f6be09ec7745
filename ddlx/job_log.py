"""ddlx's own lines about a job (how its run ended, why it was refused, how to resume it): said
on the console as they are, and written to the job's log file too (Hydra's ``train.log`` or
``recommend.log`` in the job's folder), so that the folder says how its job ended once the
console is gone (a sweep's jobs, a batch job's output). No torch here: some are said before it loads."""
from __future__ import annotations

import logging
import sys


def say(text: str, *, err: bool = False) -> None:
    """Print ``text`` (to stderr with ``err``) and add it to the log files of this process's
    logging (none outside a Hydra job), where the console's handler would print it again."""
    print(text, file=sys.stderr if err else sys.stdout, flush=True)
    record = logging.LogRecord("ddlx", logging.WARNING if err else logging.INFO, __file__, 0,
                               text.removeprefix("ddlx: "), None, None)  # (the record names ddlx)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
