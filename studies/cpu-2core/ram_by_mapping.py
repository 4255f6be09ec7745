"""Where a run's RAM goes: peak PSS of each process of a command's tree, by mapping kind.

    python studies/cpu-2core/ram_by_mapping.py python train.py strategy=cpu_mp model=alexnet ...
    python studies/cpu-2core/ram_by_mapping.py --imports     # one process's anonymous memory per import

Samples /proc/PID/smaps of every process in the tree twice a second and prints, at the sample
with the largest total, each process's PSS split into anonymous memory (heap, tensors), shared
memory files (/dev/shm: cpu_mp's shared weights) and shared libraries. PSS divides a page among
the processes that map it, so the sum over the tree counts every page once. (It costs the
kernel a page-table walk per process per sample: expect this script to slow the run a little.)
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import time

import psutil

MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def pss_by_kind(pid: int) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    kind = None
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if MAPPING.match(line):
                    parts = line.split(None, 5)
                    path = parts[5].strip() if len(parts) > 5 else ""
                    kind = ("shm" if path.startswith("/dev/shm") else "libs" if ".so" in path
                            else "anon" if path in ("", "[heap]") else "other")
                elif line.startswith("Pss:"):
                    out[kind] += int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def tree_peak(command: list[str]) -> None:
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    best: tuple[int, dict] = (0, {})
    while proc.poll() is None:
        try:
            members = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        snapshot = {p.pid: pss_by_kind(p.pid) for p in members}
        total = sum(sum(c.values()) for c in snapshot.values())
        if total > best[0]:
            best = (total, snapshot)
        time.sleep(0.5)
    if proc.returncode:
        print(proc.stderr.read()[-2000:], file=sys.stderr)
    total, snapshot = best
    print(f"exit code {proc.returncode}; peak PSS of the tree {total / 2**20:.0f} MB")
    overall: collections.Counter = collections.Counter()
    for pid, kinds in snapshot.items():
        overall.update(kinds)
        print(f"  pid {pid}: {sum(kinds.values()) / 2**20:.0f} MB", {k: round(v / 2**20) for k, v in kinds.most_common() if v > 2**20})
    print("  by kind:", {k: round(v / 2**20) for k, v in overall.most_common()})


def imports() -> None:
    def anon() -> str:
        return f"{pss_by_kind(os.getpid())['anon'] / 2**20:.0f} MB"

    print("python", anon())
    import torch
    print("+ torch", anon())
    import pytorch_lightning  # noqa: F401
    print("+ pytorch_lightning", anon())
    import mlflow  # noqa: F401
    print("+ mlflow", anon())
    import ddlx.run  # noqa: F401
    print("+ ddlx.run (hydra, torchvision, ...)", anon())
    del torch


if __name__ == "__main__":
    imports() if sys.argv[1:] == ["--imports"] else tree_peak(sys.argv[1:])
