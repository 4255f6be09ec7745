"""train.py as a user runs it, but with a stop signal sent to its whole process group, as a
terminal's Ctrl-C, ``timeout`` or a scheduler sends it, from another process, at a point of the
run the first argument names:

    python tests/train_signalled.py validation SIGTERM [train.py overrides...]

Points: ``validation`` (a validation batch of the second epoch). Before sending, it writes the
time to ``$DDLX_SIGNAL_SENT`` so a test can tell how long the process took to end after it.
"""
from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytorch_lightning as pl

from ddlx import run

TRAIN_PY = Path(__file__).resolve().parents[1] / "train.py"


class SignalTheGroup(pl.Callback):
    def __init__(self, signum: int) -> None:
        self.signum, self.sent = signum, False

    def on_validation_batch_start(self, trainer, *args, **kwargs) -> None:
        if trainer.current_epoch == 1 and not trainer.sanity_checking and not self.sent:
            self.sent = True
            Path(os.environ["DDLX_SIGNAL_SENT"]).write_text(f"{time.time()}")
            subprocess.run(["kill", "-s", signal.Signals(self.signum).name.removeprefix("SIG"), "--",
                            f"-{os.getpgid(0)}"], check=False)


def main() -> None:
    point, name, *overrides = sys.argv[1:]
    assert point == "validation", point
    measured = run.measurement_callbacks
    run.measurement_callbacks = lambda cfg: [*measured(cfg), SignalTheGroup(signal.Signals[name])]
    sys.argv = [str(TRAIN_PY), *overrides]
    runpy.run_path(str(TRAIN_PY), run_name="__main__")


if __name__ == "__main__":
    main()
