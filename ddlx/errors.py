"""User-facing errors: raised before any work starts, printed without a traceback by the entry points."""
from __future__ import annotations

import re
import signal
import sys
import traceback
from pathlib import Path


class ConfigError(ValueError):
    """A bad value in the configuration or the environment. The message names the value,
    what was expected, and the override that fixes it."""


class StoreError(ConfigError):
    """The MLflow store (or the experiment) cannot take runs: every job that logs there would be
    refused alike, so a sweep stops at the first instead of failing each of its jobs."""


class RanksDisagree(ConfigError):
    """The ranks of one job composed different jobs: every rank finds it at once, and refuses."""


class CheckpointNotWritten(OSError):
    """The file system refused a checkpoint (full, over a quota or a size limit); the previous
    checkpoint file is as it was. The message says which file and why."""


class RankDied(RuntimeError):
    """Another rank process died (kill -9, the out-of-memory killer, a crash) and this one failed
    on its lost connection. The console has said so, and how to resume (``ddlx.run.RankDeath``)."""


class RankLost(RuntimeError):
    """This rank failed on its connection to another rank of a job whose ranks a launcher started
    (mpirun, srun, torchrun; ddlx's own say which rank died: :class:`RankDied`). The run is
    FAILED with the reason, and one line says it: gloo's traceback says no more."""


# gloo's words for a peer that is gone (its process died, its node was lost) or silent past the timeout.
LOST_PEER = re.compile(r"Connection (?:closed|reset) by peer|Timed out waiting")


def rank_lost(err: BaseException, rank: int) -> RankLost | None:
    """:class:`RankLost` for ``err`` where it is gloo's lost or silent peer, else None."""
    line = (str(err).splitlines() or [""])[0]  # gloo's own words (an error quoting a traceback is another's)
    if not isinstance(err, RuntimeError) or not LOST_PEER.search(line):
        return None
    # gloo's first sentence, with the peer's address, without its source location ("[.../pair.cc:561] ")
    said = re.sub(r"^\s*\[[^\]]*\]\s*", "", line).split(". ")[0].strip()
    if "Timed out waiting" in line:  # no peer went away: where this rank waited is what tells a hang from a lost node
        return RankLost(f"rank {rank} waited strategy.timeout_s{waiting_in(err.__traceback__)} and no other rank "
                        f"answered ({said}): one died without closing its connection (its node was lost), hangs, or "
                        f"waits at another point of the job (a deadlock); the launcher's lines say which")
    return RankLost(f"rank {rank} lost another rank of the job ({said}): it died (a crash, kill -9, the out-of-memory "
                    f"killer), its node was lost, or it ended after waiting strategy.timeout_s itself (its own line "
                    f"says where); the launcher's lines say which")


def waiting_in(tb) -> str:
    """`` in all_gather_object (from ddlx.data.cache:58)``: the torch call a traceback failed in
    (its torch.distributed collective, else its first public torch function: ``backward`` where
    DDP's gradient hooks waited, ``forward`` where it broadcasts buffers) and the code outside torch
    and the standard library that made it, by module name (not path: an environment may be named
    ``torch``), as far as the traceback holds them."""
    frames = [(frame.f_globals.get("__name__") or "", frame.f_code.co_name, line) for frame, line in traceback.walk_tb(tb)]
    callers = [i for i, (module, _, _) in enumerate(frames)
               if module and not _of_torch(module) and module.partition(".")[0] not in sys.stdlib_module_names]
    if not callers:
        return ""
    module, _, line = frames[callers[-1]]
    inside = [(m, name) for m, name, _ in frames[callers[-1] + 1:]
              if _of_torch(m) and not name.startswith("_") and name != "wrapper"]  # (c10d's logging decorator)
    called = ([name for m, name in inside if m.startswith("torch.distributed")] or [name for _, name in inside] or [None])[0]
    return f"{f' in {called}' if called else ''} (from {module}:{line})"


def _of_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


class Stopped(BaseException):
    """Training was stopped by a signal (:mod:`ddlx.stopping`). A BaseException, as
    KeyboardInterrupt, so no ``except Exception`` on the way swallows it. ``checkpoint``: the
    state the run can resume from, when one was written."""

    def __init__(self, signum: int, checkpoint: Path | None = None, step: int | None = None,
                 resumable: bool = False, after_training: bool = False, at_once: bool = False) -> None:
        self.signum, self.checkpoint, self.step, self.resumable = signum, checkpoint, step, resumable
        self.after_training = after_training  # the run had trained to its end: it is FINISHED
        self.at_once = at_once  # a second Ctrl-C while training: ``checkpoint`` is the last one written before it
        self.launcher = None  # (name, processes, nodes) of the launcher that started the job (command_line.resume_words)
        super().__init__(self.describe())

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM

    def describe(self) -> str:
        if self.after_training:
            return f"{self.signal_name} came after training had finished: the run is FINISHED"
        where = f" after step {self.step}" if self.step is not None else " before training"
        kind = "checkpoint" if self.resumable else "checkpoint of the weights only"
        if self.at_once:
            kept = f"; the last {kind}, written before it: {self.checkpoint}" if self.checkpoint else "; no checkpoint written"
            return f"stopped at once by a second {self.signal_name}{where}{kept}"
        kept = f"; {kind} {self.checkpoint}" if self.checkpoint else "; no checkpoint written"
        return f"stopped by {self.signal_name}{where}{kept}"


# The data keys data=imagefolder leaves null for the folder at data.root to fill (classes and
# num_images may stay null without one: a named synthetic set names its classes, counts its images).
FROM_THE_FOLDER = ("name", "classes", "num_classes", "num_images", "channels", "mean", "std")


def unset_data_root(data) -> str | None:
    """Why ``data`` (a data config) cannot be trained without a folder: keys it leaves to be read
    from one, and no ``data.root``; None where it can."""
    open_keys = [key for key in FROM_THE_FOLDER if getattr(data, key) is None and key not in ("classes", "num_images")]
    if data.root is not None or not open_keys:
        return None
    return (f"data.root is not set, but data.{open_keys[0]} is to be read from the folder there (data=imagefolder): "
            f"give data.root=DIR (an ImageFolder: one sub-folder of images per class), or train on a named dataset "
            f"(data=firesmall)")


def missing_data_root(root) -> str:
    shown = root if str(root).strip() else repr(root)
    return (f"data.root={shown} does not exist. Point data.root at an ImageFolder (one sub-folder per class with "
            f"its images), or set data.root=null to train on a synthetic stand-in that ddlx writes under "
            f"data.synthetic_dir on first use")
