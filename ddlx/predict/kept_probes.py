"""Probe results kept per machine, so that the same question gets the same answer: a probe of a
few batches moves by several percent from one call to the next, more than the gaps between the
best setups. Kept beside hw=local's timed rates (``detected_dir``), keyed by the machine and
everything the probe's time depends on; ``mode=probe`` measures again."""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def probes_file(cache_dir: Path, host: str) -> Path:
    return cache_dir / f"probes_{host}.json"


def kept(cache_dir: Path | None, machine: dict, kind: str, key: dict, measure: Callable[[], Any]) -> Any:
    """``measure()``'s result (JSON data) for ``kind`` and ``key`` on ``machine``: read back when
    kept, else measured and kept. ``cache_dir=None``: measured on every call."""
    if cache_dir is None:
        return measure()
    path = probes_file(cache_dir, machine["host"])
    name = json.dumps({"kind": kind, "machine": machine, **key}, sort_keys=True)
    found = _read(path).get(name)
    if found is not None:
        return found["value"]
    value = measure()
    doc = _read(path)  # again: another call may have kept something meanwhile
    doc[name] = {"value": value, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(doc, out, indent=1)
    os.replace(tmp, path)  # whole or not at all: a reader never sees half a file
    return value


def forget(cache_dir: Path | None, host: str) -> None:
    """Drop every kept probe of ``host`` (``mode=probe``: measure everything again)."""
    if cache_dir is not None:
        probes_file(cache_dir, host).unlink(missing_ok=True)


def _read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
