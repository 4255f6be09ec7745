"""The benchmarks that run ddlx's Trainer beside a hand-written loop still run (a change below
them, such as the typed config, broke both once without a test noticing): a dry run of each on
AlexNet at 32 px, its table row with a figure in every column."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--models", "alexnet", "--image-size", "32", "--batch-size", "4", "--steps", "2", "--rounds", "1"]


def table_row(script: str, tmp_path: Path) -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *TINY], capture_output=True, text=True,
                         cwd=ROOT, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("| alexnet |")]
    return [cell.strip() for cell in row.strip("|").split("|")]


@pytest.mark.integration
def test_the_overhead_benchmark_runs(tmp_path):
    cells = table_row("overhead.py", tmp_path)
    assert all(float(c) > 0 for c in cells[1:4]), cells  # hand, ddlx, ddlx without the monitor: ms/step


@pytest.mark.integration
def test_the_compile_benchmark_runs(tmp_path):
    cells = table_row("compile.py", tmp_path)
    assert all(float(c) > 0 for c in cells[1:3]), cells  # eager and compiled ms/step
    assert float(cells[4].split()[0]) > 0 and float(cells[6].split()[0]) > 0, cells  # ddlx/hand compiled, ddlx compile s
