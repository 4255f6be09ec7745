"""train.py (or recommend.py) as a user runs it, but with a stop signal sent to its whole process
group, as a terminal's Ctrl-C, ``timeout`` or a scheduler sends it, at a point of the run the
first argument names:

    python tests/train_signalled.py validation SIGTERM [train.py overrides...]
    python tests/train_signalled.py composing:next SIGINT -m [train.py overrides...]
    python tests/train_signalled.py composing:1 SIGINT --script recommend.py [overrides...]

Points: ``validation`` (a validation batch of the second epoch, sent from another process;
before sending, it writes the time to ``$DDLX_SIGNAL_SENT`` so a test can tell how long the
process took to end after it). ``composing:N``: while the N-th config is composed (train.py's
check of the command line composes each job's, then Hydra composes its own); ``composing:next``:
the first composed after a run ends (a sweep's next job). Either inside omegaconf's ``ListConfig.append``
between making the new item's slot and filling it (its flags read), where a Ctrl-C fell in a user's sweep.
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


def signal_while_composing(which: str, signum: int) -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from omegaconf import ListConfig

    compose, wrap_and_set, trained = ConfigLoaderImpl.load_configuration, ListConfig._wrap_value_and_set, run.train
    state = {"compositions": 0, "runs": 0, "armed": False, "sent": False}

    def train(*args, **kwargs):
        try:
            return trained(*args, **kwargs)
        finally:
            state["runs"] += 1

    def load_configuration(self, *args, **kwargs):
        state["compositions"] += 1
        state["armed"] = not state["sent"] and (state["runs"] > 0 if which == "next" else state["compositions"] == int(which))
        try:
            return compose(self, *args, **kwargs)
        finally:
            state["armed"] = False

    def wrap_value_and_set(self, *args, **kwargs):
        if state["armed"]:
            state["armed"], state["sent"] = False, True
            os.killpg(os.getpgid(0), signum)  # its handler runs here, the slot made and not yet filled
        return wrap_and_set(self, *args, **kwargs)

    ConfigLoaderImpl.load_configuration, ListConfig._wrap_value_and_set = load_configuration, wrap_value_and_set
    run.train = train  # train.py's job imports it when it starts


def main() -> None:
    point, name, *overrides = sys.argv[1:]
    script = TRAIN_PY
    if overrides[:1] == ["--script"]:
        script, overrides = TRAIN_PY.parent / overrides[1], overrides[2:]
    if point == "validation":
        measured = run.measurement_callbacks
        run.measurement_callbacks = lambda cfg: [*measured(cfg), SignalTheGroup(signal.Signals[name])]
    else:
        kind, which = point.split(":")
        assert kind == "composing", point
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, where a background job ignores it
        signal_while_composing(which, signal.Signals[name])
    sys.argv = [str(script), *overrides]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
