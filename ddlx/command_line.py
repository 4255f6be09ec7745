"""The commands ddlx prints for a user to paste: each word quoted where a shell would read it
otherwise, so that bash and zsh give train.py back the words ddlx meant."""
from __future__ import annotations

import shlex


def shell_words(*words: str) -> str:
    """``words`` as one command line: a word quoted where the shell would glob it (zsh refuses
    ``strategy.devices=[cpu,cpu]`` with "no matches found"), split it (a folder with a space) or
    expand it; plain words stay as they are."""
    return " ".join(shlex.quote(str(word)) for word in words)


def resume_command(overrides: list[str], checkpoint) -> str:
    """The train.py command that resumes a job of ``overrides`` (its own ckpt_path replaced) from ``checkpoint``."""
    kept = [o for o in overrides if not o.lstrip("+").startswith("ckpt_path=")]
    return f"python train.py {shell_words(*kept, f'ckpt_path={checkpoint}')}"


def task_overrides() -> list[str]:
    """The overrides of this Hydra job (a sweep job's own values); ValueError outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task)
