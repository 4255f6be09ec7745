"""The commands ddlx prints for a user to paste: each word quoted where a shell would read it
otherwise, so that bash and zsh give train.py back the words ddlx meant."""
from __future__ import annotations

import re
import shlex


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


def task_overrides() -> list[str]:
    """The overrides of this Hydra job (a sweep job's own values); ValueError outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task)
