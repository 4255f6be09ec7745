"""A process's exit after its work is done: Python's last garbage collections over everything
torch, torchvision, Lightning and MLflow made, against the same exit with those objects frozen
out of the collections (``ddlx.process.exit_without_collecting``, which train.py, recommend.py
and the report call).

    python benchmarks/exit_time.py                  # what train.py's job imports, 5 rounds
    python benchmarks/exit_time.py --imports torch  # torch alone

Each round starts one child per way, alternating: it imports ``--imports`` (and with ``--train``
trains a few steps of AlexNet at 32 px, as a job leaves its objects), writes the time, and exits;
the exit is from that time until its parent sees it end. Medians over the rounds, milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys, time
sys.path.insert(0, {root!r})
import {imports}
if {train}:
    import torch
    from ddlx.models import build_model
    model = build_model("alexnet", num_classes=3, image_size=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(8, 3, 32, 32)), torch.zeros(8, dtype=torch.long)).backward()
        opt.step()
if {freeze}:
    from ddlx.process import exit_without_collecting
    exit_without_collecting()
sys.stdout.write(f"{{time.monotonic():.6f}}\\n")
sys.stdout.flush()
"""


def exit_seconds(imports: str, train: bool, freeze: bool) -> float:
    child = CHILD.format(root=str(ROOT), imports=imports, train=train, freeze=freeze)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    ended = time.monotonic()  # (one clock for every process of the machine, on Linux)
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        sys.exit(f"exit_time.py: the child importing {imports} failed ({said}); give --imports modules that import")
    return ended - float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imports", default="torch, torchvision, pytorch_lightning, mlflow, ddlx.run",
                        help="the modules each child imports (a Python import list)")
    parser.add_argument("--train", action="store_true", help="also train a few steps before exiting")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    ways = {"collected (Python's default)": False, "frozen (exit_without_collecting)": True}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, freeze in ways.items():
            seconds[way].append(exit_seconds(args.imports, args.train, freeze))
    print(f"imports: {args.imports}{'; trained 3 steps' if args.train else ''}; {args.rounds} round(s)")
    print("| exit | median ms | min ms | max ms |")
    print("|---|---|---|---|")
    for way, times in seconds.items():
        ms = [1e3 * t for t in times]
        print(f"| {way} | {statistics.median(ms):.1f} | {min(ms):.1f} | {max(ms):.1f} |")


if __name__ == "__main__":
    main()
