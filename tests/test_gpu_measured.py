"""What one real GPU measured (issue 44), and what ddlx does with it: the GPU time model fitted to
the per-layer times of an H200, and the memory prediction against its measured peaks."""
from __future__ import annotations

import csv
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ddlx.costmodel.costs import memory_need
from ddlx.costmodel.gpu_measured import (
    arrays_of,
    gpu_working_memory,
    leave_one_network_out,
    load_measured,
    measured_fit,
    measurement_files,
    memory_files,
    predicted_step_s,
    working_memory_residuals,
)
from ddlx.costmodel.hardware import GB
from ddlx.predict.hw_files import DEFAULT_HW_DIR, hw_file

ROOT = Path(__file__).resolve().parents[1]
H200 = "NVIDIA H200"


def h200_steps():
    (path,) = [p for p in measurement_files() if "h200" in p.name]
    return load_measured(path)


def test_the_measurements_cover_seven_networks_two_batches_three_precisions_with_their_versions():
    steps = h200_steps()
    assert {s.model for s in steps} == {"alexnet", "vgg11", "vgg16", "resnet18", "resnet50", "resnet152", "mobilenet_v2"}
    assert {s.batch for s in steps} == {32, 128} and {s.precision for s in steps} == {"32-true", "bf16-mixed", "16-mixed"}
    assert len(steps) == 42 and all(s.device == H200 and "torch 2.11" in s.versions and "CUDA 13.0" in s.versions for s in steps)
    for s in steps:  # each layer timed in both passes; the layers add up to the step (the hooks' cost aside)
        assert all(f > 0 for f in s.forward_s) and all(b >= 0 for b in s.backward_s)
        assert 0.85 < (sum(s.forward_s) + sum(s.backward_s) + s.optimizer_s) / s.step_s < 1.6, s.label  # hooks cost most in launch-bound steps


def test_every_measured_peak_is_predicted_within_ten_percent():
    working, basis = gpu_working_memory()
    assert 0 < working < 200 * 2**20 and "28 measured peaks" in basis
    (path,) = memory_files()
    errors = {}
    for row, excess in working_memory_residuals(path):
        measured = float(row["peak_mb"]) * 2**20
        errors[f"{row['model']} b{row['batch']} {row['precision']}"] = (measured - excess + working) / measured - 1
    assert len(errors) == 28
    assert max(abs(e) for e in errors.values()) < 0.10, errors


def test_the_gpu_memory_a_setup_needs_holds_the_libraries_working_memory():
    gpu, cpu = hw_file("h200_1x", DEFAULT_HW_DIR), hw_file("local", DEFAULT_HW_DIR)
    working, _ = gpu_working_memory()
    assert memory_need(gpu, 2**30).per_device_gb * GB == pytest.approx(2**30 + working, rel=1e-6)
    assert memory_need(cpu, 2**30).per_device_gb * GB == pytest.approx(2**30, rel=1e-6)


def test_an_h200_is_predicted_from_its_own_measured_layers_and_says_so():
    hw = hw_file("h200_1x", DEFAULT_HW_DIR)
    fitted = measured_fit(hw)
    assert fitted is not None and fitted.steps == 42 and fitted.layers == 1260
    assert "measured on an NVIDIA H200" in fitted.basis and "gpu_layers_h200.csv" in fitted.basis
    assert measured_fit(hw_file("h100_1x", DEFAULT_HW_DIR)) is None  # no H100 measured: the published fit
    errors = [predicted_step_s(arrays_of(s, hw), fitted.params) / s.step_s - 1 for s in h200_steps()]
    assert statistics.median(abs(e) for e in errors) < 0.12  # 9.7% when fitted


@pytest.mark.integration
def test_recommend_on_the_measured_gpu_names_its_basis(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "recommend.py"), "hw=h200_1x", "model=resnet18", "data=cifar10",
                          f"paths.root={tmp_path}"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "measured on an NVIDIA H200" in out.stdout


@pytest.mark.slow
def test_leave_one_network_out_on_the_h200():
    """Each network predicted by the parameters fitted to the other six: 13.3% median when written."""
    hw = hw_file("h200_1x", DEFAULT_HW_DIR)
    pairs = [(arrays_of(s, hw), s) for s in h200_steps()]
    errors = [predicted / m.step_s - 1 for m, predicted in leave_one_network_out(pairs)]
    assert statistics.median(abs(e) for e in errors) < 0.15


@pytest.mark.integration
def test_the_layer_benchmark_runs_without_a_gpu(tmp_path):
    """benchmarks/gpu_layers.py's dry run on the CPU: a row per layer, forward and backward timed."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_layers.py"), "--device", "cpu", "--models",
                          "alexnet", "--batches", "2", "--precisions", "32-true", "--image-size", "32", "--warmup", "1",
                          "--steps", "1", "--num-classes", "3", "--out", str(tmp_path / "l.csv"), "--memory-out",
                          str(tmp_path / "m.csv")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(open(tmp_path / "l.csv")))
    assert len(rows) == 22 and all(float(r["forward_ms"]) > 0 and float(r["step_ms"]) > 0 for r in rows)
