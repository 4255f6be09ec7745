"""Every benchmark still runs (a change below them, such as the typed config, broke two once
without a test noticing): a dry run of each at its smallest (AlexNet at 32 px, a step or two),
its table row with figures. The figures themselves are the benchmarks' to report, not checked.
So do the studies written for a GPU sitting, on CPU: the next lent GPU's minutes are too few to
find them broken there. Those that check no behaviour of ddlx's (a refit, a dry run whose figures
cannot differ on CPU) are `slow`: `pytest -m slow` before a GPU sitting; the CI's integration
suite keeps the one that does (every layer compiled)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--models", "alexnet", "--image-size", "32", "--batch-size", "4", "--steps", "2", "--rounds", "1"]


def run_benchmark(script: str, *args: str, folder: str = "benchmarks") -> str:
    out = subprocess.run([sys.executable, str(ROOT / folder / script), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def table_row(script: str) -> list[str]:
    (row,) = [line for line in run_benchmark(script, *TINY).splitlines() if line.startswith("| alexnet |")]
    return [cell.strip() for cell in row.strip("|").split("|")]


@pytest.mark.integration
def test_the_overhead_benchmark_runs():
    cells = table_row("overhead.py")
    assert all(float(c) > 0 for c in cells[1:4]), cells  # hand, ddlx, ddlx without the monitor: ms/step


@pytest.mark.integration
def test_the_compile_benchmark_runs():
    cells = table_row("compile.py")
    assert all(float(c) > 0 for c in cells[1:3]), cells  # eager and compiled ms/step
    assert float(cells[4].split()[0]) > 0 and float(cells[6].split()[0]) > 0, cells  # ddlx/hand compiled, ddlx compile s


# Each benchmark without a test above: its smallest arguments, and what its table's row starts
# with, up to its first figure (a time).
SMALLEST = {
    "cpu_mp_step.py": (["--models", "alexnet", "--size", "32", "--steps", "4", "--setups", "cpu_mp split"],
                       r"\| alexnet 32px \| cpu_mp split \| "),
    "dataloader.py": (["--image-size", "32", "--batch-size", "4", "--num-images", "40", "--batches", "2", "--workers", "0",
                       "--threads", "1"], r"\| 0 \| none \| "),
    "epoch_start.py": (["--image-size", "32", "--batch-size", "4", "--num-images", "40", "--workers", "1", "--step-ms", "20",
                        "--epochs", "2", "--rounds", "1"], r"\| plain DataLoader \| [\d.]+ \| [\d.]+ \| "),  # its epoch s
    "exit_time.py": (["--imports", "json", "--rounds", "1"], r"\| (?:collected|frozen) \(.+\) \| "),
    "pipeline_stages.py": (["--model", "alexnet", "--image-size", "32", "--batch-size", "8", "--chunks", "2", "--rounds", "1",
                            "--steps", "1", "--schedules"], r"\| 2 \| \[\d+, \d+\] \| "),  # its cut, then stage 1's time
    "step_overhead.py": (["--steps", "5", "--rounds", "1"], r"\| "),
    "weight_grads.py": (["--models", "alexnet", "--image-size", "32", "--batch-size", "8", "--chunks", "2", "--rounds", "1"],
                        r"alexnet\s+2\s+"),
}


@pytest.mark.integration
@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_every_benchmark_runs_at_its_smallest(script):
    args, row_start = SMALLEST[script]
    rows = [m for line in run_benchmark(script, *args).splitlines() if (m := re.match(row_start + r"(\d+\.?\d*)", line))]
    assert rows, f"{script}: no row starting {row_start!r} and a figure"
    for row in rows:  # dataloader.py prints two tables of the same rows
        assert float(row.group(1)) > 0 and "nan" not in row.string, row.string


@pytest.mark.integration
def test_the_strategies_benchmark_runs_into_the_store_it_is_given(tmp_path):
    """strategies_cpu.py runs train.py per setup and reads the epoch times back from the store."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = run_benchmark("strategies_cpu.py", "--only", "sequential threads=1", "--image-size", "32", "--num-images", "40",
                        "--batch-size", "8", "--epochs", "1", "--tracking-uri", store, "--set", f"paths.root={tmp_path}")
    (row,) = [line for line in out.splitlines() if line.startswith("sequential threads=1")]
    epoch_s, speedup = float(row.split()[2]), row.split()[5]
    assert epoch_s > 0 and speedup == "1.00x", row
    assert (tmp_path / "mlflow.db").exists() and (tmp_path / "outputs").is_dir()


@pytest.mark.integration
@pytest.mark.slow
def test_the_sync_check_runs_on_cpu_and_compiles_its_compiled_runner():
    """studies/gpu_sync_check.py: ddlx's runner eager and compiled, a line of counts each (on CPU no
    call can wait for a device, and no batch is pinned)."""
    out = run_benchmark("gpu_sync_check.py", "--device", "cpu", "--model", "alexnet", "--image-size", "32", "--batch-size", "4",
                        "--steps", "2", folder="studies")  # AlexNet: its default ResNet-50 took 3 of CI's minutes to compile
    counts = {kind: dict(re.findall(r"(\w+)=([\d.]+)", line)) for kind, line in re.findall(r"^ddlx (eager|compiled): (.*)$", out, re.M)}
    assert set(counts) == {"eager", "compiled"}, out
    assert float(counts["eager"]["compile_s"]) == 0 and float(counts["compiled"]["compile_s"]) > 0, counts
    for kind in counts:
        assert counts[kind]["not_pinned"] == "4" and counts[kind]["syncs_in_step"] == "0", counts  # two epochs of two steps


@pytest.mark.integration
@pytest.mark.slow
def test_the_small_image_study_compares_every_measured_step():
    """studies/gpu_small_images.py: a row per step of its measurement file, and both pricings refitted."""
    out = run_benchmark("gpu_small_images.py", folder="studies")
    steps = (ROOT / "studies" / "gpu-h200" / "layers_32px.csv").read_text().splitlines()[1:]
    measured = {(row.split(",")[4], row.split(",")[6]) for row in steps}  # (model, batch)
    rows = [line for line in out.splitlines() if re.match(r"\| \w+ \| \d+ \| \d", line)]
    assert {(row.split("|")[1].strip(), row.split("|")[2].strip()) for row in rows} == measured, out
    assert len(re.findall(r"\| median \d+\.\d%, \d+ of \d+ within 15%", out)) == 4, out


@pytest.mark.integration
@pytest.mark.slow
def test_the_thesis_ratio_study_runs_every_variant():
    """studies/thesis_ratio_checks.py: a row per variant, with the eight ratios and Table 6.1's configs."""
    out = run_benchmark("thesis_ratio_checks.py", folder="studies")
    rows = re.findall(r"^\| ([\w.-]+) \| (\d) of 8 \| ((?:[^|;]+;){7}[^|;]+) \| A [-+][\d.]+%, B [-+][\d.]+%, C [-+][\d.]+% \|$", out, re.M)
    assert [row[0] for row in rows] == ["shipped", "gpu-times-0.78", "horovod-bucket-64", "recompute-forward"], out


@pytest.mark.integration
def test_every_layer_compiled_by_itself_is_compiled_not_left_eager():
    """studies/compile_layer_graphs.py: fsdp and PyTorch's pipelines compile each layer, one frame to
    dynamo, whose default limit of 8 cached graphs left all but the first 8 of VGG-11's 32 layers
    eager, with a warning only; and each for static shapes (a ResNet-50 compiled per block with
    symbolic ones on an H200 ran 0.77x its eager speed). Dynamo's eager backend: its caching
    without inductor's minutes."""
    (row,) = [line for line in run_benchmark("compile_layer_graphs.py", "vgg11", folder="studies").splitlines()
              if line.startswith("| vgg11 |")]
    layers, graphs, symbolic = (int(cell) for cell in row.strip("|").split("|")[1:4])
    assert graphs >= layers and symbolic == 0, row
