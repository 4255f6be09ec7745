"""The commands ddlx prints for a user to paste: each word quoted where a shell would read it
otherwise, so that bash and zsh give train.py back the words ddlx meant."""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from .job_log import say
from .process import outside_launcher


def shell_words(*words: str) -> str:
    """``words`` as one command line: a word quoted where the shell would glob it (zsh refuses
    ``strategy.devices=[cpu,cpu]`` with "no matches found"), split it (a folder with a space) or
    expand it; plain words stay as they are."""
    return " ".join(shlex.quote(str(word)) for word in words)


def hydra_string(text) -> str:
    """A string value as a Hydra override writes it: as it is where Hydra reads it back as that
    string, else quoted (a path with ``,`` would be a sweep over its pieces; one with ``=`` or
    ``[`` does not parse; ``null`` or ``1`` would not be strings)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    text = str(text)
    if "${" not in text:  # OmegaConf would resolve it, quoted or not
        try:
            if OverridesParser.create().parse_override(f"k={text}").value() == text:
                return text
        except HydraException:  # it does not parse
            pass
    # Quoted, a backslash is an escape only before a quote or at the end (there it is doubled).
    quoted = re.sub(r"(\\+)(?='|$)", r"\1\1", text).replace("'", "\\'").replace("${", "\\${")
    return f"'{quoted}'"


def resume_command(overrides: list[str], checkpoint) -> str:
    """The train.py command that resumes a job of ``overrides`` (its own ckpt_path replaced) from ``checkpoint``."""
    kept = [o for o in overrides if not o.lstrip("+").startswith("ckpt_path=")]
    return f"python train.py {shell_words(*kept, f'ckpt_path={hydra_string(checkpoint)}')}"


def resume_words(launcher: tuple[str, int, str | None] | None = None) -> str:
    """'resume with', and under a launcher (:func:`ddlx.process.outside_launcher`: mpirun, srun,
    torchrun; with the nodes the job spread over) that it starts the resumed job too: its train.py
    command alone would be one process."""
    if not launcher:
        return "resume with"
    name, processes, nodes = launcher
    over = f" on {nodes} nodes" if nodes not in (None, "1") else ""
    return f"resume under {name} with {processes} processes{over}, as this job was started, with"


def task_overrides() -> list[str]:
    """The overrides of this Hydra job (a sweep job's own values); ValueError outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task)


def task_override_keys() -> frozenset[str] | None:
    """The keys this Hydra job's overrides name (``data.batch_size`` of ``+data.batch_size=8``, ``data``
    of ``data=cifar10``); None outside a Hydra job."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = task_overrides()
    except ValueError:
        return None
    return frozenset(o.key_or_group for o in OverridesParser.create().parse_overrides(overrides))


@dataclass(frozen=True)
class HowToResume:
    """A FAILED run's last line: the command that resumes it from its last checkpoint, or why
    there is none. Made while its job runs (Hydra unsets the job's config when it ends) and said
    at the end by the run's process or, when that was killed, by its watch
    (:mod:`ddlx.run_watch`, which takes it as :meth:`to_json`'s text)."""

    command: str | None  # resume_command(job's overrides, checkpoint_file); None: no checkpoints
    checkpoint_file: str | None
    weights_only: bool
    not_before: float | None = None  # when a new run started: an older file in its folder (one reused) is another run's
    launcher: tuple[str, int, str | None] | None = None  # the launcher that started its processes, its nodes (resume_words)

    @classmethod
    def of(cls, overrides: list[str], checkpoint_file, weights_only: bool, not_before: float | None = None,
           nodes: str | None = None) -> HowToResume:
        command = None if checkpoint_file is None else resume_command(overrides, checkpoint_file)
        launched = outside_launcher()
        return cls(command, None if checkpoint_file is None else str(checkpoint_file), weights_only, not_before,
                   (*launched, nodes) if launched else None)

    def say(self) -> None:
        if self.checkpoint_file is None:
            said = "checkpoints are off (checkpoint.save=none): the run cannot be resumed"
        elif self.weights_only:
            said = "its checkpoints hold the weights only (checkpoint.save=weights): the run cannot be resumed"
        elif (checkpoint := Path(self.checkpoint_file)).is_file() and (
                self.not_before is None or checkpoint.stat().st_mtime >= self.not_before):
            said = f"{resume_words(self.launcher)}: {self.command}"
        else:
            said = "no checkpoint was written before it"
        say(f"ddlx: {said}", err=True)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HowToResume:
        fields = json.loads(text)
        return cls(**{**fields, "launcher": tuple(fields["launcher"]) if fields.get("launcher") else None})
