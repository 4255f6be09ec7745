"""The recommender's parts: each formula on hand-computed cases, the model profile, memory
filter, calibration, leave-one-out validation, hardware configs and recommend.py's output."""
from __future__ import annotations

import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torchvision
from conftest import CONF_DIR, PROJECT_DIR, alive, as_a_shell_reads, compose_config, runs, signalled, subprocess_env
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ddlx.errors import ConfigError
from ddlx.job import Batches, Job
from ddlx.costmodel import perf_models as pm
from ddlx.predict.calibration import Calibration
from ddlx.predict.cli import hardware, load_hw_file
from ddlx.predict.cli import run as run_recommend
from ddlx.costmodel.hardware import GB, HardwareSpec, LinkSpec
from ddlx.predict.prediction import Predictor
from ddlx.costmodel.profile import profile_model
from ddlx.predict.choices import check_tries
from ddlx.predict.setups import (
    SequentialTime,
    Setup,
    is_baseline,
    memory_need,
    model_batch_s,
    model_cost,
    overrides,
)
from ddlx.predict.sequential_time import ProbedBatch
from ddlx.predict.validation import ValidationRow, pick, validate
from ddlx.records import MeasuredRun, job_of_run, workload_of
from ddlx.strategies import STRATEGIES

FAST = pm.Link(latency_s=1e-5, bandwidth_mb_s=1000.0)  # 10 µs, 1 GB/s
SLOW = pm.Link(latency_s=1e-4, bandwidth_mb_s=100.0)


# ---- formulas -------------------------------------------------------------------------------

def test_ring_allreduce_is_eq_5_1_over_the_slowest_link():
    assert pm.ring_allreduce_s(4, 100.0, [FAST] * 4) == pytest.approx(2 * 3 * (1e-5 + 100 / (4 * 1000)))
    assert pm.ring_allreduce_s(4, 100.0, [FAST, FAST, SLOW, FAST]) == pytest.approx(6 * (1e-4 + 100 / 400))
    assert pm.ring_allreduce_s(2, 8.0, [FAST] * 2, fixed_s=0.003) == pytest.approx(2 * (1e-5 + 8 / 2000) + 0.003)
    assert pm.ring_allreduce_s(1, 100.0, [FAST]) == 0.0


def test_data_parallel_exposes_the_last_bucket_or_every_bucket():
    overlapped = pm.data_parallel_s(2.0, 4, gradient_mb=60.0, bucket_mb=25.0, ring=[FAST] * 4, fixed_s=0.001)
    assert overlapped == pytest.approx(0.5 + 6 * (1e-5 + 25 / 4000) + 0.001)  # min(G, th) = 25 MB
    exposed = pm.data_parallel_s(2.0, 4, gradient_mb=60.0, bucket_mb=25.0, ring=[FAST] * 4, fixed_s=0.001, overlap=False)
    per = [6 * (1e-5 + size / 4000) + 0.001 for size in (25, 25, 10)]
    assert exposed == pytest.approx(0.5 + sum(per))
    small = pm.data_parallel_s(2.0, 4, gradient_mb=5.0, bucket_mb=25.0, ring=[FAST] * 4)
    assert small == pytest.approx(0.5 + 6 * (1e-5 + 5 / 4000)), "min(G, th) with G < th"


def test_ddp_buckets_go_as_the_backward_pass_reaches_them():
    """Gradients bucketed from the last layer (the first bucket 1 MB): each allreduce starts when
    its bucket is ready and the one before is done; the step waits for the last."""
    one = 6 * (1e-5 + 25 / 4000)  # a 25 MB bucket on four FAST devices
    # Three layers of 25 MB whose backward takes longer than a bucket's allreduce: only the last is exposed.
    slow_backward = pm.exposed_allreduce_s([1.0, 1.0, 1.0], [25.0, 25.0, 25.0], 4, 25.0, [FAST] * 4)
    assert slow_backward == pytest.approx(one)
    # A backward that takes no time: every bucket's allreduce is exposed, one after the other.
    instant = pm.exposed_allreduce_s([0.0, 0.0, 0.0], [25.0, 25.0, 25.0], 4, 25.0, [FAST] * 4)
    assert instant == pytest.approx(3 * one)
    # The first bucket closes at 1 MB: the last layer's 0.5 MB waits for the one before it.
    small = pm.exposed_allreduce_s([0.0, 0.0, 0.0], [24.0, 0.6, 0.5], 4, 25.0, [FAST] * 4)
    assert small == pytest.approx(6 * (1e-5 + 1.1 / 4000) + 6 * (1e-5 + 24 / 4000))
    assert pm.exposed_allreduce_s([0.0], [25.0], 1, 25.0, [FAST]) == 0.0, "one worker has nothing to reduce"


def test_fsdp_gathers_before_each_unit_and_reduce_scatters_after():
    """FSDP per unit on one queue: a gather before each forward (one ahead), again before each
    backward in full sharding, a reduce-scatter after each backward; the step waits for the last."""
    half = 3 * (1e-5 + 40 / 4000)  # one 40 MB unit gathered (or reduce-scattered) over four FAST devices
    assert pm.ring_gather_s(4, 40.0, [FAST] * 4) == pytest.approx(half)
    assert pm.ring_gather_s(4, 40.0, [FAST] * 4) * 2 == pytest.approx(pm.ring_allreduce_s(4, 40.0, [FAST] * 4))
    # Nothing to hide behind: full sharding sends 3 halves per unit, grad_op 2 (its weights stay gathered).
    zero = [0.0, 0.0]
    assert pm.exposed_sharded_s(zero, zero, [40.0, 40.0], 4, [FAST] * 4) == pytest.approx(6 * half)
    assert pm.exposed_sharded_s(zero, zero, [40.0, 40.0], 4, [FAST] * 4, regather=False) == pytest.approx(4 * half)
    # Long layers: the first gather (nothing to hide it behind), the last unit's regather as the
    # backward starts (full sharding only) and the last reduce-scatter are exposed.
    slow = [1.0, 1.0]
    assert pm.exposed_sharded_s(slow, slow, [40.0, 40.0], 4, [FAST] * 4) == pytest.approx(3 * half)
    assert pm.exposed_sharded_s(slow, slow, [40.0, 40.0], 4, [FAST] * 4, regather=False) == pytest.approx(2 * half)
    assert pm.exposed_sharded_s(slow, slow, [40.0, 40.0], 1, [FAST]) == 0.0


def test_gpipe_compute_is_eq_6_1():
    assert pm.gpipe_compute_s(10.0, 4, 12) == pytest.approx(10.0 * 15 / 48)
    assert pm.gpipe_compute_s(10.0, 4, 1) == pytest.approx(10.0), "one micro-batch: plain model parallelism"


def test_gpipe_comm_is_eq_6_2():
    # Two stages: every one of the #mb steps crosses the one boundary, forward and backward.
    assert pm.gpipe_comm_s(8, 4, [0.5], [FAST]) == pytest.approx(2 * 4 * (1e-5 + 8 * 0.5 / 1000))
    # Three stages, links of different speed: fill max(s1), full (#mb-1) x max(s1, s2), drain max(s2).
    s1, s2 = 1e-5 + 4 * 1.0 / 1000, 1e-4 + 4 * 0.25 / 100
    assert pm.gpipe_comm_s(4, 6, [1.0, 0.25], [FAST, SLOW]) == pytest.approx(2 * (s1 + 5 * max(s1, s2) + s2))


def test_split_threads_cpu_mp_and_hybrid():
    assert pm.split_s(1.0, 32, 0.1, FAST) == pytest.approx(1.0 + 2 * (1e-5 + 3.2 / 1000))
    assert pm.threads_s(1.0, 4, join_s=0.01) == pytest.approx(0.26)
    # Shared weights: (3P - 1) passes over the gradient by the ranks together, two barriers.
    assert pm.cpu_mp_s(1.0, 2, gradient_mb=100.0, bandwidth_mb_s=10000.0, barrier_s=1e-4) == pytest.approx(
        0.5 + 5 * 100 / 10000 + 2e-4)
    assert pm.cpu_mp_s(1.0, 1, gradient_mb=100.0, bandwidth_mb_s=10000.0, barrier_s=1e-4) == 1.0
    assert pm.hybrid_s(0.4, 2, 60.0, 25.0, [FAST, FAST], 0.0) == pytest.approx(0.4 + 2 * (1e-5 + 25 / 2000))


# ---- model profile ----------------------------------------------------------------------------

def test_profile_counts_torchvisions_parameters_and_3x_forward_flops():
    profile = profile_model("alexnet", 1000, 3, 224)
    assert profile.params == sum(p.numel() for p in torchvision.models.alexnet().parameters())
    last = profile.layers[-1]  # Linear(4096, 1000): 4096 x 1000 multiply-adds per sample
    assert last.forward_flops == 2 * 4096 * 1000 and last.output_bytes == 1000 * 4
    assert profile.train_flops_per_sample == pytest.approx(3 * sum(layer.forward_flops for layer in profile.layers))


def test_a_profile_is_kept_on_disk_read_back_equal_and_counted_again_when_unreadable(tmp_path, monkeypatch):
    from ddlx.costmodel import profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    profile.profile_model.cache_clear()
    counted = profile.profile_model("resnet18", 3, 3, 64)
    (kept,) = (tmp_path / "ddlx" / "profiles").glob("resnet18-3-3-64-*.json")
    calls = []
    monkeypatch.setattr(profile, "_count_profile", lambda *args: calls.append(args) or counted)
    profile.profile_model.cache_clear()
    assert profile.profile_model("resnet18", 3, 3, 64) == counted and calls == [], "read from disk, not counted"
    kept.write_text("{cut off")
    profile.profile_model.cache_clear()
    assert profile.profile_model("resnet18", 3, 3, 64) == counted and calls == [("resnet18", 3, 3, 64)]
    assert json.loads(kept.read_text())["arch"] == "resnet18", "written again whole"
    profile.profile_model.cache_clear()


@pytest.mark.parametrize("log", [True, False])
def test_a_first_question_imports_the_stores_client_while_its_child_counts(tmp_path, monkeypatch, capsys, log):
    """With no store to read, MLflow's import (seconds) is made while the child counts, not after
    the answer, where logging the answer needs it; with log=false, not at all."""
    from ddlx.predict import cli

    said = []
    monkeypatch.setattr(cli, "count_ahead", lambda job, gpu: said.append("counting") or "child")
    monkeypatch.setattr(cli, "wait_for", lambda child: said.append(f"waited for the {child}"))
    monkeypatch.setattr(cli, "import_store_client", lambda uri: said.append(f"imported for {uri}"))
    monkeypatch.setattr(cli, "log_recommendation", lambda *args: ("1", "run"))  # (a new store's migration: seconds)
    uri = f"sqlite:///{tmp_path / 'new.db'}"
    cfg = _compose_recommend("hw=titanrtx_4x", "probe=false", "output=json", f"paths.root={tmp_path}", f"log={log}",
                             f"logger.tracking_uri={uri}", "cpu_allocator=system")
    run_recommend(cfg, tmp_path / "out", CONF_DIR / "hw")
    assert json.loads(capsys.readouterr().out)["runs"].startswith("no MLflow store")
    assert said == ["counting", *([f"imported for {uri}"] if log else []), "waited for the child"]


def test_a_question_counts_its_model_in_a_child_while_it_reads_the_runs(tmp_path, monkeypatch, capfd):
    """recommend.py's child fills the profile cache with what this process would count (the
    answer then reads it instead of counting); a child that fails says why in one line and leaves
    the count to the answer."""
    from ddlx.costmodel import kernels, profile
    from ddlx.predict.count_ahead import count_ahead
    from ddlx.process import wait_for

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    job = Job("resnet18", "firesmall", 3, 3, 32, 16, 64, precision="bf16-mixed")
    # Forked from a fresh process, as recommend.py forks it before any work: forked from this one,
    # after other tests' training here, the child could fail in its backward with torch's "Unable to
    # handle autograd's threading in combination with fork-based multiprocessing" in some full runs.
    code = ("import sys\nfrom ddlx.job import Job\nfrom ddlx.predict.count_ahead import count_ahead\n"
            "from ddlx.process import wait_for\nchild = count_ahead(Job('resnet18', 'firesmall', 3, 3, 32, 16, 64, "
            "precision='bf16-mixed'), gpu=True)\nwait_for(child)\nsys.exit(child.exitcode)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**subprocess_env(), "XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0, f"the child's line: {proc.stderr[-2000:]}"
    kept = sorted(path.name for path in (tmp_path / "ddlx" / "profiles").iterdir())
    assert len(kept) == 2 and kept[1].endswith(".kernels-1.json"), kept
    calls = []
    monkeypatch.setattr(profile, "_count_profile", lambda *args: calls.append(args))
    monkeypatch.setattr(kernels, "_trace", lambda *args: calls.append(args))
    profile.profile_model.cache_clear()
    kernels.kernel_profile.cache_clear()
    read = profile.profile_model("resnet18", 3, 3, 32), kernels.kernel_profile("resnet18", 3, 3, 32, True)
    assert calls == [], "the answer reads the child's count"
    monkeypatch.undo()
    assert read == (profile._count_profile("resnet18", 3, 3, 32), kernels._trace("resnet18", 3, 3, 32, True))
    profile.profile_model.cache_clear()
    kernels.kernel_profile.cache_clear()

    failing = count_ahead(replace(job, model="no_such_net"), gpu=False)
    capfd.readouterr()
    wait_for(failing)
    lines = capfd.readouterr().err.splitlines()  # (and whatever else this process's stderr took meanwhile)
    prefix = "ddlx: counting no_such_net ahead in a child failed ("
    said = [line for line in lines if line.startswith(prefix)]
    assert failing.exitcode == 1 and len(said) == 1 and "no_such_net" in said[0][len(prefix):], lines
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "stuck"))  # nothing kept: the child must count
    monkeypatch.setattr(profile, "_count_profile", lambda *args: time.sleep(60))
    stuck = count_ahead(job, gpu=False)
    started = time.perf_counter()
    wait_for(stuck, timeout_s=1.0)
    assert not stuck.is_alive() and stuck.exitcode != 0 and time.perf_counter() - started < 30, "stopped, not awaited"


def test_partitions_and_boundaries_follow_the_balance():
    profile = profile_model("alexnet", 3, 3, 64)
    balance = profile.even_balance(3)
    assert len(balance) == 3 and sum(balance) == len(profile.layers) and min(balance) >= 1
    bounds = profile.boundary_bytes([profile.split_index, len(profile.layers) - profile.split_index])
    assert bounds == [profile.layers[profile.split_index - 1].output_bytes]
    with pytest.raises(ValueError, match="does not cover"):
        profile.partitions([1, 1])


def test_a_steps_tensors_scale_with_the_batch_and_those_of_32_mib_are_mapped_afresh():
    """ResNet18 at 128 px: its first conv's 64 x 64 x 64 maps reach 32 MiB at 32 samples, not at
    16 (the conv and batch-norm outputs forward, three gradients of that size backward). AlexNet's
    first classifier weight (9216 x 4096) gets a 151 MB gradient every step whatever the batch."""
    from ddlx.costmodel.profile import mapped_bytes, step_allocations

    ceiling = 32 * 2**20
    assert mapped_bytes("resnet18", 3, 3, 128, 16, ceiling) == 0
    assert mapped_bytes("resnet18", 3, 3, 128, 32, ceiling) == 5 * 64 * 64 * 64 * 32 * 4
    assert (9216 * 4096 * 4, 0) in step_allocations("alexnet", 3, 3, 64)
    assert mapped_bytes("alexnet", 3, 3, 64, 1, ceiling) == mapped_bytes("alexnet", 3, 3, 64, 64, ceiling) >= 9216 * 4096 * 4


def test_the_allocator_advice_names_what_glibc_maps_afresh_for_the_recommended_setup(monkeypatch):
    from ddlx.predict.prediction import allocator_advice
    from ddlx.costmodel.profile import mapped_bytes
    from ddlx.predict.setups import worker_batch

    job = Job("mobilenet_v2", "firesmall", 3, 3, 192, 32, 320)
    rec = Predictor(_hw(), []).recommend(job)
    mapped = mapped_bytes("mobilenet_v2", 3, 3, 192, worker_batch(rec.best.setup, job), 32 * 2**20)
    assert mapped > 0 and f"maps {mapped / 1e6:.0f} MB" in allocator_advice(rec)
    assert allocator_advice(Predictor(_hw(), []).recommend(replace(job, cpu_allocator="keep_freed"))) is None
    assert allocator_advice(Predictor(_hw(), []).recommend(replace(job, image_size=64))) is None, "nothing of 32 MiB"
    gpu = _hw(device_kind="gpu", memory_per_device_gb=80, peak_tflops=10.0)
    assert allocator_advice(Predictor(gpu, []).recommend(job)) is None
    # This machine as the target, where glibc does not serve malloc (musl, a preloaded jemalloc):
    # train.py here would refuse keep_freed, so it is not advised; a described machine still gets it.
    monkeypatch.setattr("ddlx.predict.prediction.keep_freed_possible", lambda: False)
    assert allocator_advice(Predictor(_hw(host=socket.gethostname()), []).recommend(job)) is None
    assert allocator_advice(Predictor(_hw(), []).recommend(job)) is not None
    assert [worker_batch(s, job) for s in (STRATEGIES["sequential"].setup(threads=2), STRATEGIES["threads"].setup(threads=2),
                                           STRATEGIES["cpu_mp"].setup(processes=2), STRATEGIES["pipe"].setup(chunks=4))] == [32, 16, 16, 8]


# ---- hardware, memory, calibration ------------------------------------------------------------

def _hw(**over) -> HardwareSpec:
    spec = HardwareSpec(name="test", nodes=1, device_kind="cpu", device_name="x", devices_per_node=2, cores_per_node=2,
                        memory_per_device_gb=24, ram_per_node_gb=24, peak_tflops=0.1,
                        intra_node=LinkSpec(5.0, 20.0), memory_bandwidth_gb_s=10.0, host="test-host")
    for key, value in over.items():
        setattr(spec, key, value)
    return spec


JOB = Job("resnet18", "firesmall", 3, 3, 64, 32, 320)


def test_memory_filter_refuses_what_does_not_fit():
    profile = profile_model("vgg16", 3, 3, 224)
    job = Job("vgg16", "firesmall", 3, 3, 224, 256, 633)
    gpu = _hw(device_kind="gpu", memory_per_device_gb=16, devices_per_node=4)
    seq = memory_need(STRATEGIES["sequential"].setup(trainer="gpu"), job, gpu, profile)
    ddp = memory_need(STRATEGIES["ddp_nccl"].setup(processes=4), job, gpu, profile)
    pipe = memory_need(STRATEGIES["pipe"].setup(chunks=8, devices=("cuda:0", "cuda:1", "cuda:2", "cuda:3")), job, gpu, profile)
    assert not seq.fits and seq.per_device_gb > 16
    assert ddp.per_device_gb < seq.per_device_gb and pipe.per_device_gb < seq.per_device_gb
    assert pipe.fits and ddp.fits


def test_a_pipelines_memory_is_of_the_cut_its_time_model_times():
    """balance=auto cuts a pipeline by its layers' times on the device; where the prediction knows
    them per layer, the memory column holds the stages of that cut, not of the FLOPs'."""
    from ddlx.costmodel.costs import stage_bytes
    from ddlx.parallel.cuts import contiguous_balance

    profile = profile_model("vgg16", 3, 3, 224)
    job = Job("vgg16", "firesmall", 3, 3, 224, 256, 633)
    gpu = _hw(device_kind="gpu", memory_per_device_gb=16, devices_per_node=4)
    times = ((1.0, 2.0),) + ((0.01, 0.02),) * (len(profile.layers) - 1)  # the first layer is the slow one
    seq = SequentialTime(0.01, 0.0, "test", layers_s=lambda samples: times)
    cut = contiguous_balance([f + b for f, b in times], 4)
    devices = ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    fairscale = STRATEGIES["pipe"].setup(chunks=8, devices=devices)
    torch_gpipe = STRATEGIES["pipe"].setup(chunks=8, devices=devices, engine="torch", schedule="gpipe")
    for setup in (fairscale, torch_gpipe):
        by_flops, by_time = memory_need(setup, job, gpu, profile), memory_need(setup, job, gpu, profile, seq)
        assert by_time.per_device_gb != pytest.approx(by_flops.per_device_gb), setup.label
    expected = max(stage_bytes(profile, cut, job.batch_size, 8, "never")) / GB
    assert memory_need(fairscale, job, gpu, profile, seq).per_device_gb == pytest.approx(expected, rel=0.05)


def test_recommendation_ranks_fitting_setups_first():
    gpu = _hw(device_kind="gpu", memory_per_device_gb=8, devices_per_node=4, peak_tflops=10.0)
    rec = Predictor(gpu, []).recommend(Job("vgg16", "firesmall", 3, 3, 224, 256, 633))
    fits = [p.memory.fits for p in rec.predictions]
    assert fits == sorted(fits, reverse=True), "setups that do not fit come last"
    assert rec.best is not None and rec.best.memory.fits and rec.best.setup.strategy != "sequential"
    assert "per-layer GPU model fitted to" in rec.sequential.basis and rec.sequential.estimated, "no GPU run: the model"


def test_close_calls_are_the_fitting_setups_within_the_band_of_the_best():
    gpu = _hw(device_kind="gpu", memory_per_device_gb=8, devices_per_node=4, peak_tflops=10.0)
    rec = Predictor(gpu, []).recommend(Job("vgg16", "firesmall", 3, 3, 224, 256, 633))
    fitting = [p for p in rec.predictions if p.memory.fits]
    runner_up = fitting[1].epoch_s / fitting[0].epoch_s - 1
    assert rec.close_calls(runner_up / 2) == []
    assert rec.close_calls(runner_up * 1.001)[0] is fitting[1]
    assert all(p.memory.fits for p in rec.close_calls(10.0)) and rec.best not in rec.close_calls(10.0)
    from ddlx.predict.setups import calibration_group

    groups = [calibration_group(p.setup) for p in fitting[:2]]
    rec.errors = {groups[0]: runner_up * 1.001, groups[1]: runner_up / 2}
    assert rec.close_calls(0.0)[0] is fitting[1], "the larger validated error of the two groups decides, not the band"
    rec.errors = {groups[0]: runner_up / 2}
    assert rec.close_calls(runner_up * 1.001)[0] is fitting[1], "a group without a validated error: the band"
    from ddlx.predict.render import recommendation_table

    rec.errors = {groups[0]: 0.025, "sequential": 0.0}  # the baseline measured at the job's batch: exact
    (line,) = [line for line in recommendation_table(rec, "", 0.0, 10.0, []).splitlines() if line.startswith("close calls")]
    assert f"leave-one-out on this hardware's runs: {groups[0]} 2.5%; sequential measured at this batch, exact;" in line, \
        "a measured baseline is no leave-one-out figure"


def test_group_errors_are_the_validated_median_errors_of_groups_with_enough_configurations():
    from ddlx.predict.validation import group_errors

    hw = _hw()
    runs = _consistent_runs(hw)
    errors = group_errors(Predictor(hw, runs))
    assert errors and all(e == pytest.approx(0.0, abs=1e-6) for g, e in errors.items() if g != "sequential"), \
        "runs exactly as the models say: every calibrated group validates at 0"


def _run(run_id: str, setup: Setup, params: dict, epoch_s: float, host: str = "test-host") -> MeasuredRun:
    from dataclasses import fields

    from ddlx.strategies import spec_of

    # A run records every knob, the ones its setup leaves at their defaults too.
    strategy_params = {f"strategy.{f.name}": str(f.default) for f in fields(spec_of(setup.strategy).config)}
    strategy_params.update({f"strategy.{k}": str(v) for k, v in setup.knobs if k != "devices"})
    tags = {"strategy": setup.strategy, "host": host, "accelerator": "cpu"}
    if getattr(setup, "devices", None):
        tags["devices"] = ",".join(setup.devices)
    samples = int(params["train"])
    return MeasuredRun(run_id, "FINISHED", workload_of(params, tags), "cpu", setup.strategy, setup.label, epoch_s,
                       params={**{k: v for k, v in params.items() if k != "train"}, **strategy_params,
                               "measure.warmup_epochs": "1"}, tags=tags,
                       metrics={"mean_epoch_time_s": epoch_s, "mean_samples_per_s": samples / epoch_s, "measured_epochs": 3})


def _workload_params(model: str, size: int) -> dict:
    return {"model.name": model, "data.name": "firesmall", "data.num_classes": "3", "data.channels": "3",
            "data.image_size": str(size), "data.batch_size": "32", "data.num_images": "400", "train": "320"}


SETUPS = [STRATEGIES["sequential"].setup(threads=1), STRATEGIES["threads"].setup(threads=2),
          STRATEGIES["cpu_mp"].setup(processes=2), STRATEGIES["pipe"].setup(chunks=4, devices=("cpu", "cpu"))]
# What the implementation adds to the model: the batch-splitting strategies one compute factor,
# each its own overhead factor; pipe one factor on the whole.
TRUTH = {"threads": Calibration(1.1, 1.5, 3), "cpu_mp": Calibration(1.1, 1.2, 3), "pipe": Calibration(2.0, 2.0, 3)}


def _consistent_runs(hw: HardwareSpec, workloads=(("alexnet", 64, 0.010), ("resnet18", 64, 0.030), ("vgg11", 64, 0.050)),
                     network_truth: dict | None = None) -> list[MeasuredRun]:
    """Runs whose times are exactly model x a per-strategy factor (x ``network_truth``'s factor
    for a (network, strategy)): leave-one-out must recover them."""
    from ddlx.predict.setups import weight_seconds

    runs = []
    for model, size, per_sample in workloads:
        params = _workload_params(model, size)
        job = Job(model, "firesmall", 3, 3, size, 32, 320)
        profile = profile_model(model, 3, 3, size)
        seq = SequentialTime(per_sample, weight_seconds(profile, hw), "truth")
        for setup in SETUPS:
            truth = TRUTH.get(setup.strategy, Calibration(1.0, 1.0, 3))
            own = (network_truth or {}).get((model, setup.strategy), 1.0)
            batch_s = own * truth.apply(model_cost(setup, job, hw, profile, seq))
            runs.append(_run(f"{model}-{size}-{setup.label}", setup, params, batch_s * job.steps, host=hw.host))
    return runs


def test_calibration_learns_each_strategys_factor():
    hw = _hw()
    runs = _consistent_runs(hw)
    rec = Predictor(hw, runs).recommend(Job("alexnet", "firesmall", 3, 3, 64, 32, 320), SETUPS)
    measured = {r.setup: r.mean_epoch_time_s for r in runs if r.params["model.name"] == "alexnet"}
    for p in rec.predictions:
        assert p.epoch_s == pytest.approx(measured[p.setup.label], rel=1e-6), p.setup.label
    assert "measured (1 run, same batch)" in rec.sequential.basis
    (pipe,) = [p for p in rec.predictions if p.setup.strategy == "pipe"]
    assert "x2.00 calibrated on 3 test run(s)" in pipe.basis
    assert all(p.basis_kind == "calibrated" for p in rec.predictions)
    bare = Predictor(hw, []).recommend(Job("alexnet", "firesmall", 3, 3, 64, 32, 320), SETUPS)
    assert all(p.basis_kind == "estimate" for p in bare.predictions), "no run: counted FLOPs, uncalibrated models"


def test_a_figure_carries_the_digits_of_its_basis():
    from ddlx.predict.render import figure

    assert (figure(1146.69, calibrated=False), figure(1146.69, calibrated=True)) == ("~1100", "1150")
    assert (figure(0.7893, calibrated=False), figure(3.4812, calibrated=True)) == ("~0.79", "3.48")


def test_runs_of_another_precision_do_not_inform_a_prediction():
    """bf16-mixed copies of every run, twice as fast: an fp32 job is predicted from the fp32 runs
    alone, and a bf16-mixed job from the bf16-mixed ones."""
    from dataclasses import replace

    hw = _hw()
    runs = _consistent_runs(hw)
    bf16 = [replace(r, run_id=r.run_id + "-bf16", workload=replace(r.workload, precision="bf16-mixed"),
                    mean_epoch_time_s=r.mean_epoch_time_s / 2,
                    metrics={**r.metrics, "mean_epoch_time_s": r.metrics["mean_epoch_time_s"] / 2,
                             "mean_samples_per_s": r.metrics["mean_samples_per_s"] * 2}) for r in runs]
    job = Job("alexnet", "firesmall", 3, 3, 64, 32, 320)
    alone = Predictor(hw, runs).recommend(job, SETUPS)
    pooled = Predictor(hw, runs + bf16).recommend(job, SETUPS)
    assert [p.epoch_s for p in pooled.predictions] == pytest.approx([p.epoch_s for p in alone.predictions], rel=1e-9)
    half = Predictor(hw, runs + bf16).recommend(replace(job, precision="bf16-mixed"), SETUPS)
    (seq_half,), (seq,) = ([p for p in r.predictions if p.setup.strategy == "sequential"] for r in (half, alone))
    assert seq_half.epoch_s == pytest.approx(seq.epoch_s / 2, rel=1e-9), "measured by the bf16-mixed baseline"


def test_leave_one_out_recovers_consistent_runs_and_picks_the_fastest():
    hw = _hw()
    runs = _consistent_runs(hw)
    probe_calls = []

    def probe(job):
        def batches(n):  # the held-out baseline's own time: what a perfect probe would measure
            probe_calls.append(job.model)
            (base,) = [r for r in runs if r.params["model.name"] == job.model and r.strategy == "sequential"]
            return [ProbedBatch(base.mean_epoch_time_s / job.steps, 0.0)] * n
        return batches

    rows, picks = validate(Predictor(hw, runs, local=hw, probe=probe))
    assert len(rows) == len(runs)
    assert max(abs(r.error) for r in rows) < 1e-6
    assert sorted(set(probe_calls)) == ["alexnet", "resnet18", "vgg11"], "held-out baselines are probed"
    assert len(picks) == 3 and all(p.correct and p.slowdown == 0 for p in picks.values())


def test_a_network_measured_at_other_sizes_corrects_its_strategies_own_miss():
    """threads runs 8% slower than its calibrated model on every ResNet18 workload (intra-op work
    shares out differently per layer mix): a ResNet18 size not measured is predicted with that
    factor, learned from its two other sizes; AlexNet, measured at one size, and VGG11 are not
    given one, and a workload's repeats count once."""
    from ddlx.predict.calibration import WorkloadRatio, workload_ratios
    from ddlx.predict.setups import Cost

    hw = _hw()
    workloads = (("alexnet", 64, 0.010), ("vgg11", 64, 0.050), ("alexnet", 96, 0.020),
                 ("resnet18", 64, 0.030), ("resnet18", 80, 0.045), ("resnet18", 96, 0.065))
    runs = _consistent_runs(hw, workloads, {("resnet18", "threads"): 1.08})
    threads = STRATEGIES["threads"].setup(threads=2)
    held = "resnet18-96-" + threads.label
    measured = next(r.mean_epoch_time_s for r in runs if r.run_id == held)
    (pred,) = Predictor(hw, [r for r in runs if r.run_id != held]).recommend(Job("resnet18", "firesmall", 3, 3, 96, 32, 320), [threads]).predictions
    assert pred.epoch_s == pytest.approx(measured, rel=0.01)
    assert "for resnet18 (its 2 measured workloads)" in pred.basis
    fewer = [r for r in runs if r.run_id != held and not r.run_id.startswith("resnet18-80-")]
    (alone,) = Predictor(hw, fewer).recommend(Job("resnet18", "firesmall", 3, 3, 96, 32, 320), [threads]).predictions
    assert "measured workloads" not in alone.basis and alone.epoch_s < 0.97 * measured, "one other size: pooled only"
    (vgg,) = Predictor(hw, runs).recommend(Job("vgg11", "firesmall", 3, 3, 64, 32, 320), [threads]).predictions
    assert "measured workloads" not in vgg.basis, "one workload is no network's character"

    job = Job("resnet18", "firesmall", 3, 3, 64, 32, 320)
    other = Job("resnet18", "firesmall", 3, 3, 80, 32, 320)
    one, two = Cost(1.0, 0.0), Cost(2.0, 0.0)
    ratios = workload_ratios(Calibration(1.0, 1.0, 5), [(one, 1.2), (one, 1.2), (one, 1.2), (two, 2.0), (two, 2.2)],
                             [job, job, job, other, other])
    assert sorted(ratios, key=lambda w: w.job.image_size) == [WorkloadRatio(job, pytest.approx(1.2)), WorkloadRatio(other, pytest.approx(1.05))]
    three = Calibration(1.0, 1.0, 6, workloads=ratios + (WorkloadRatio(replace(job, image_size=96), 1.0),))
    assert three.network_factor(job).factor == pytest.approx(1.05), "the median of workloads, not of runs (1.2)"
    assert three.apply(one, job) == pytest.approx(1.05) and three.apply(one) == 1.0


def test_runs_of_another_allocator_inform_only_jobs_with_it():
    """cpu_allocator changes every CPU timing: a job with glibc's default is predicted from the runs
    with it (those without the param), a keep_freed job from the keep_freed runs, and validation
    holds out only the runs of the allocator it was asked for."""
    hw = _hw()
    runs = _consistent_runs(hw)
    kept = [replace(r, run_id=r.run_id + "-kept", params={**r.params, "cpu_allocator": "keep_freed"},
                    workload=replace(r.workload, cpu_allocator="keep_freed"),
                    mean_epoch_time_s=0.7 * r.mean_epoch_time_s,
                    metrics={**r.metrics, "mean_epoch_time_s": 0.7 * r.mean_epoch_time_s,
                             "mean_samples_per_s": r.metrics["mean_samples_per_s"] / 0.7}) for r in runs]
    predictor = Predictor(hw, runs + kept)
    job = Job("alexnet", "firesmall", 3, 3, 64, 32, 320)
    measured = {r.setup: r.mean_epoch_time_s for r in runs if r.params["model.name"] == "alexnet"}
    # 0.7 x every time is not exactly the models' shape (the weight traffic does not shrink): pipe's
    # single factor recovers it within 4%, the others exactly.
    for allocator, factor, within in (("system", 1.0, 1e-5), ("keep_freed", 0.7, 0.04)):
        rec = predictor.recommend(replace(job, cpu_allocator=allocator), SETUPS)
        assert rec.runs_used == len(runs)
        for p in rec.predictions:
            assert p.epoch_s == pytest.approx(factor * measured[p.setup.label], rel=within), (allocator, p.setup.label)
    rows, _ = validate(predictor, "keep_freed")
    assert len(rows) == len(kept) and all(r.run_ids.endswith("-kept") for r in rows)
    assert all("cpu_allocator=keep_freed" in r.workload for r in rows)


def test_a_probe_stands_as_measured_and_beats_scaling_a_run_at_another_batch():
    """Every probe reads 0.8 x the runs' time: held-out baselines in validation and a
    recommendation for a batch no run measured both take the probe as measured now."""
    hw = _hw()
    runs = _consistent_runs(hw)

    def probe(job):
        def batches(n):
            (base,) = [r for r in runs if r.params["model.name"] == job.model and r.strategy == "sequential"]
            return [ProbedBatch(0.8 * base.mean_epoch_time_s / job.steps, 0.0)] * n
        return batches

    rows, _ = validate(Predictor(hw, runs, local=hw, probe=probe))
    baselines = [r for r in rows if r.group == "sequential"]
    assert len(baselines) == 3 and all(r.error == pytest.approx(-0.2) for r in baselines)
    assert all("local probe" in r.basis for r in baselines)
    b16 = Job("alexnet", "firesmall", 3, 3, 64, 16, 320)
    now = Predictor(hw, runs, local=hw, probe=probe).sequential(b16, hw, runs)
    assert "local probe" in now.basis, "a probe of the batch itself beats scaling batch 32 per sample"
    assert Predictor(hw, runs).sequential(b16, hw, runs).basis.startswith("measured (1 run, batch 32, scaled per sample")


def test_a_pick_says_when_the_repeats_cannot_tell_the_setups_apart():
    def row(setup, predicted, runs):
        return ValidationRow("", "w", setup, setup, predicted, "", tuple(runs))

    noisy = pick([row("a", 1.0, [9.0, 10.0, 12.0]), row("b", 2.0, [9.4, 9.5, 9.6]), row("c", 3.0, [20.0])])
    assert (noisy.recommended, noisy.fastest, noisy.correct) == ("a", "b", False)
    assert noisy.slowdown == pytest.approx(10.0 / 9.5 - 1) and noisy.overlapping
    clear = pick([row("a", 1.0, [10.0, 10.2]), row("b", 2.0, [9.4, 9.6])])
    assert not clear.correct and not clear.overlapping
    right = pick([row("a", 1.0, [9.0]), row("b", 2.0, [9.5])])
    assert right.correct and not right.overlapping


def test_the_recommendation_is_the_predicted_fastest():
    def row(setup, group, predicted, measured):
        return ValidationRow("", "w", setup, group, predicted, "", (measured,))

    rows = [row("threads", "threads", 9.8, 10.1), row("seq2", "sequential-threads", 10.0, 9.9),
            row("seq1", "sequential", 19.0, 18.0)]
    chosen = pick(rows)
    assert (chosen.recommended, chosen.fastest, chosen.correct) == ("threads", "seq2", False)
    assert chosen.slowdown == pytest.approx(10.1 / 9.9 - 1)


def test_validation_keeps_workloads_apart_that_differ_only_in_dataset_size():
    hw = _hw()
    runs = _consistent_runs(hw)
    bigger = [_run(f"{r.run_id}-n800", r.strategy_setup, {**r.params, "data.num_images": "800", "train": "640"},
                   2 * r.mean_epoch_time_s, host=hw.host) for r in runs if r.params["model.name"] == "alexnet"]
    rows, picks = validate(Predictor(hw, runs + bigger, local=hw))
    alexnet = sorted(w for w in picks if w.startswith("alexnet"))
    assert alexnet == ["alexnet/firesmall 64px b32 num_images=400", "alexnet/firesmall 64px b32 num_images=800"]
    assert len(rows) == len(runs) + len(bigger), "the n=800 runs are their own configurations, not repeats"


def test_runs_of_another_machine_are_not_this_machines_measurements():
    hw = _hw()
    runs = [_run("x", SETUPS[0], _workload_params("alexnet", 64), 10.0, host="elsewhere")]
    rec = Predictor(hw, runs).recommend(Job("alexnet", "firesmall", 3, 3, 64, 32, 320), SETUPS[:1])
    assert rec.sequential.basis.startswith("scaled estimate")


# ---- hardware configs and the command --------------------------------------------------------

def _compose_recommend(*overrides: str):
    """recommend.py's config, composed as its entry does."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="recommend", overrides=list(overrides))


def _compose_hw(*overrides: str):
    return _compose_recommend(*overrides).hw


@pytest.mark.parametrize("name", ["titanrtx_4x", "h100_1x", "v100_8x", "cpu_2core_cluster"])
def test_every_described_machine_loads(name):
    spec = hardware(_compose_hw(f"hw={name}"))
    assert spec.name == name and spec.total_devices >= 1


@pytest.mark.parametrize("name", ["titanrtx_4x", "v100_8x", "cpu_2core_cluster"])
def test_every_machine_with_two_devices_gets_torch_pipeline_setups_with_time_memory_and_basis(name):
    spec = hardware(_compose_hw(f"hw={name}"))
    rec = Predictor(spec, []).recommend(Job("vgg11", "firesmall", 3, 3, 224, 32, 633))
    torch_pipes = [p for p in rec.predictions if getattr(p.setup, "engine", None) == "torch"]
    assert {p.setup.schedule for p in torch_pipes} == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}
    for p in torch_pipes:
        assert p.epoch_s > 0 and p.memory.per_device_gb > 0 and p.basis
        stages = len(p.setup.devices) if p.setup.strategy == "pipe" else 2  # hybrid, mpi: two-stage pipelines
        assert "strategy.engine=torch" in overrides(p.setup) and p.setup.chunks >= stages
    # Data-parallel pipelines where a node has 4 devices (hybrid) or there are several nodes (mpi).
    expected = {"hybrid"} if spec.devices_per_node >= 4 else set()
    assert {p.setup.strategy for p in torch_pipes} - {"pipe"} == expected | ({"mpi"} if spec.nodes > 1 else set())


def test_a_printed_command_pasted_into_a_shell_gives_train_py_the_words_meant(tmp_path):
    """zsh refuses an unquoted strategy.devices=[0,1] ("no matches found"), and any shell splits a
    folder with a space: a printed command reads back, word for word, as what train.py is to get."""
    from ddlx.config_check import check_config
    from ddlx.predict.render import train_command

    folder = tmp_path / "my images"
    rec = Predictor(hardware(_compose_hw("hw=titanrtx_4x")), []).recommend(Job("vgg11", "firesmall", 3, 3, 224, 32, 633))
    job = [f"data.root={folder}", "data.mean=[0.5,0.5,0.5]"]
    listed = [p for p in rec.predictions if "=[" in overrides(p.setup)]
    assert listed, "pipe and split setups name their devices as a list"
    for p in rec.predictions:
        words = as_a_shell_reads(train_command(rec, p, job), cwd=tmp_path)
        assert words[:2] == ["python", "train.py"] and f"data.root={folder}" in words and "data.mean=[0.5,0.5,0.5]" in words
        assert words[-len(overrides(p.setup).split()) - 1:-1] == overrides(p.setup).split(), p.setup.label
        check_config(compose_config(words[2:]))


@pytest.mark.integration
@pytest.mark.parametrize("overrides", [["hw=cpu_2core_cluster"], ["hw=titanrtx_4x", "hw.nodes=2"]], ids=["cpu", "gpu_2_nodes"])
def test_every_printed_command_composes_and_names_its_launcher(overrides):
    """What a user copies from the table runs: its train.py overrides compose, train on the
    machine's kind of device, and setups whose ranks span nodes are started by their launcher
    (mpirun's -np, srun's tasks per node)."""
    from ddlx.predict.render import train_command

    spec = hardware(_compose_hw(*overrides))
    rec = Predictor(spec, []).recommend(Job("resnet18", "cifar10", 3, 3, 32, 256, 50000))
    commands = {p.setup.label: train_command(rec, p, []) for p in rec.predictions}
    for label, command in commands.items():
        launcher, train = command.split("python train.py ")
        cfg = compose_config(as_a_shell_reads(train))  # a key the config does not have fails here
        assert cfg.trainer.accelerator == ("cpu" if spec.device_kind == "cpu" else "gpu"), label  # the machine's devices
        if label.startswith("mpi "):
            assert launcher == f"mpirun -np {spec.total_devices} ", label
    srun = f"srun --nodes={spec.nodes} --ntasks-per-node={spec.devices_per_node} python train.py"
    ddp = "ddp_gloo" if spec.device_kind == "cpu" else "ddp_nccl"
    for over_nodes in (f"fsdp processes={spec.total_devices} sharding=hybrid shard_size={spec.devices_per_node}",
                       f"{ddp} processes={spec.total_devices}", f"{ddp} processes={spec.total_devices} checkpoint=always"):
        assert commands[over_nodes].startswith(srun), over_nodes
    for on_a_node in (f"fsdp processes={spec.devices_per_node} sharding=full", f"{ddp} processes={spec.devices_per_node}"):
        assert commands[on_a_node].startswith("python train.py"), on_a_node


def test_a_tried_data_parallel_count_is_a_candidate_only_where_its_ranks_have_a_place():
    """Tried process counts for ddp_* and fsdp: on several nodes, a node's devices on each of a
    whole number of them (srun starts them so), never more than the machine has; on one node of
    GPUs at most a GPU each; CPU processes may share cores."""
    from ddlx.predict.setups import candidates

    job = Job("resnet18", "cifar10", 10, 3, 32, 96, 50000)
    for machine, kept in ((["hw=titanrtx_4x", "hw.nodes=4"], {2, 8}), (["hw=titanrtx_4x"], {2}),
                          (["hw=cpu_2core_cluster", "hw.nodes=1"], {2, 6, 8, 32})):
        hw = hardware(_compose_hw(*machine))
        ddp = "ddp_gloo" if hw.device_kind == "cpu" else "ddp_nccl"
        tries = {name: {"processes": [2, 6, 8, 32]} for name in (ddp, "fsdp")}
        for name in (ddp, "fsdp"):
            counts = {s.processes for s in candidates(hw, job, tries=tries) if s.strategy == name}
            assert counts == kept, (machine, name, counts)
    four_nodes = hardware(_compose_hw("hw=titanrtx_4x", "hw.nodes=4"))
    eight = STRATEGIES["ddp_nccl"].setup(processes=8)
    assert STRATEGIES["ddp_nccl"].launcher(eight, four_nodes) == "srun --nodes=2 --ntasks-per-node=4"


def test_an_hsdp_setup_without_a_shard_size_is_priced_with_the_groups_its_plan_makes():
    """strategy.shard_size unset makes a shard group of each node's ranks (the plan resolves it so):
    time and memory are those of shard_size = a node's devices, not of one group over every rank."""
    hw = hardware(_compose_hw("hw=titanrtx_4x", "hw.nodes=2"))
    job, profile = Job("resnet18", "cifar10", 10, 3, 32, 256, 50000), profile_model("resnet18", 10, 3, 32)
    seq = SequentialTime(0.001, 0.001, "test")
    fsdp = STRATEGIES["fsdp"]
    unset = fsdp.setup(processes=8, sharding="hybrid")
    assert unset.shard_size is None
    for size, same in ((4, True), (8, False)):
        given = fsdp.setup(processes=8, sharding="hybrid", shard_size=size)
        assert (model_batch_s(unset, job, hw, profile, seq) == model_batch_s(given, job, hw, profile, seq)) is same, size
        assert (memory_need(unset, job, hw, profile).per_device_gb == memory_need(given, job, hw, profile).per_device_gb) is same


def test_data_parallel_pipelines_are_one_pipeline_on_its_share_then_a_gradient_average_per_stage():
    gpu = _hw(device_kind="gpu", devices_per_node=4, memory_per_device_gb=16, memory_bandwidth_gb_s=600.0)
    job, profile = Job("vgg11", "firesmall", 3, 3, 224, 64, 633), profile_model("vgg11", 3, 3, 224)
    seq = SequentialTime(0.01, 0.0, "test")
    knobs = {"chunks": 8, "engine": "torch", "schedule": "1f1b"}
    one = STRATEGIES["pipe"].setup(devices=("cuda:0", "cuda:1"), **knobs)
    two = STRATEGIES["hybrid"].setup(processes=2, local="pipe", **knobs)
    half = replace(job, batch_size=32)
    averaging = model_batch_s(two, job, gpu, profile, seq) - model_batch_s(one, half, gpu, profile, seq)
    # Each rank's stage gradient (the split point's share of VGG11's weights) over a ring of the two pipelines.
    grads = [profile.partitions([profile.split_index, len(profile.layers) - profile.split_index])[r] for r in (0, 1)]
    mb = [sum(layer.params for layer in part) / profile.params * profile.gradient_mb for part in grads]
    ring = [pm.Link(gpu.intra_node.latency_us * 1e-6, gpu.intra_node.bandwidth_gb_s * 1e3)] * 2
    buckets = [-(-x // 25) for x in mb]
    assert averaging == pytest.approx(max(pm.ring_allreduce_s(2, x, ring, n * gpu.allreduce_fixed_us * 1e-6)
                                          for x, n in zip(mb, buckets)))
    assert memory_need(two, job, gpu, profile).per_device_gb == pytest.approx(memory_need(one, half, gpu, profile).per_device_gb)
    # On CPU, four processes on two cores time-share them.
    cpu = _hw()
    cpu_one, cpu_two = STRATEGIES["pipe"].setup(devices=("cpu", "cpu"), **knobs), STRATEGIES["hybrid"].setup(processes=2, local="pipe", **knobs)
    assert model_batch_s(cpu_two, job, cpu, profile, seq) > 2 * model_batch_s(cpu_one, half, cpu, profile, seq)


def test_pipeline_schedules_follow_their_papers():
    from ddlx.parallel.schedules import bubble_steps, in_flight

    t, w, m = 12.0, 4, 8
    balanced = [t / (m * w)] * w
    assert pm.pipeline_schedule_s(balanced, m, bubble_steps("gpipe", w, m)) == pytest.approx(pm.gpipe_compute_s(t, w, m))
    assert bubble_steps("1f1b", w, m) == bubble_steps("gpipe", w, m) == w - 1, "PipeDream-flush saves memory, not time"
    assert bubble_steps("interleaved_1f1b", w, m) == (w - 1) / 2
    assert bubble_steps("zero_bubble", w, m) == 0 and bubble_steps("zero_bubble", w, 4) == (w - 1) / 2
    assert [in_flight("gpipe", r, w, m) for r in range(w)] == [m] * w
    assert [in_flight("1f1b", r, w, m) for r in range(w)] == [4, 3, 2, 1]
    job = Job("vgg16", "firesmall", 3, 3, 224, 256, 633)
    gpu = _hw(device_kind="gpu", memory_per_device_gb=80, devices_per_node=4, peak_tflops=10.0)
    devices = tuple(f"cuda:{i}" for i in range(4))
    setups = [STRATEGIES["pipe"].setup(chunks=16, devices=devices, engine="torch", schedule=s)
              for s in ("gpipe", "1f1b")]
    gpipe, one_f_one_b = sorted(Predictor(gpu, []).recommend(job, setups).predictions, key=lambda p: p.setup.schedule != "gpipe")
    assert one_f_one_b.epoch_s == pytest.approx(gpipe.epoch_s)
    assert one_f_one_b.memory.per_device_gb < gpipe.memory.per_device_gb / 2, "4 micro-batches in flight at most, not 16"


def test_titanrtx_links_follow_the_nvlink_pairs():
    spec = hardware(_compose_hw("hw=titanrtx_4x", "hw.nodes=2"))
    assert spec.link(0, 1).bandwidth_gb_s == 25.0 and spec.link(1, 2).bandwidth_gb_s == 10.0
    assert spec.link(3, 4) == spec.inter_node and spec.total_devices == 8


def test_local_is_detected():
    spec = hardware(_compose_hw("hw=local"))
    assert spec.cores_per_node >= 1 and spec.ram_per_node_gb > 1 and spec.peak_tflops > 0 and spec.host
    if spec.device_kind == "cpu":  # a core's rate in each format, timed (a GPU's are its data sheet's)
        assert set(spec.peak_tflops_by_type) == {"fp64", "bf16", "fp16"} and min(spec.peak_tflops_by_type.values()) > 0


def test_local_rates_are_timed_once_per_machine(tmp_path, monkeypatch):
    from ddlx.costmodel import hardware as hw_module

    def rates(value):
        return lambda spec: {k: {"bf16": value} if k == "peak_tflops_by_type" else value
                             for k in hw_module.TIMED_RATES[spec.device_kind]}

    first = hardware(_compose_hw("hw=local"), tmp_path)
    timed = hw_module.TIMED_RATES[first.device_kind]
    (kept,) = tmp_path.glob("detected_*.json")
    monkeypatch.setattr(hw_module, "_measure_rates", rates(1.0))  # a second timing would read 1.0
    again = hardware(_compose_hw("hw=local"), tmp_path)
    assert [getattr(again, k) for k in timed] == [getattr(first, k) for k in timed]
    assert again.memory_bandwidth_gb_s != 1.0  # timed on CPUs and GPUs alike
    doc = json.loads(kept.read_text())
    doc["machine"]["cores_per_node"] += 1  # kept by another container on this host
    kept.write_text(json.dumps(doc))
    assert hardware(_compose_hw("hw=local"), tmp_path).memory_bandwidth_gb_s == 1.0
    assert json.loads(kept.read_text())["machine"]["cores_per_node"] == first.cores_per_node
    monkeypatch.setattr(hw_module, "_measure_rates", rates(2.0))
    assert hardware(_compose_hw("hw=local"), tmp_path, refresh=True).memory_bandwidth_gb_s == 2.0
    kept.write_text("[2.0]")  # valid JSON, not a kept-rates file: timed again, not a crash
    monkeypatch.setattr(hw_module, "_measure_rates", rates(3.0))
    assert hardware(_compose_hw("hw=local"), tmp_path).memory_bandwidth_gb_s == 3.0


def test_a_question_times_this_machines_rates_only_for_a_machine_of_its_kind(tmp_path, monkeypatch, capsys):
    """On a CPU machine, a GPU question (its first on the machine) leaves this machine's rates
    untimed (a second): nothing in its answer reads them. Compared with a CPU machine, they are
    timed, and the GPU answer is the same with rates a thousand times off."""
    from ddlx.costmodel import hardware as hw_module

    if hardware(_compose_hw("hw=local"), None, timed=False).device_kind != "cpu":
        pytest.skip("this machine has a GPU: a GPU question prices it")
    timed = []

    def rates(spec):
        timed.append(spec.name)
        return {"peak_tflops": 1e-3, "peak_tflops_by_type": {"bf16": 1e-3}, "memory_bandwidth_gb_s": 1e-2,
                "node_memory_bandwidth_gb_s": 1e-2}

    monkeypatch.setattr(hw_module, "_measure_rates", rates)

    def answer(*overrides):
        cfg = _compose_recommend("hw=titanrtx_4x", "probe=false", "output=json", "log=false", f"paths.root={tmp_path}",
                                 f"detected_dir={tmp_path / 'hw'}", "cpu_allocator=system", *overrides)
        run_recommend(cfg, tmp_path / "out", CONF_DIR / "hw")
        return json.loads(capsys.readouterr().out)

    alone = answer()
    assert timed == [] and not (tmp_path / "hw").exists(), "no rate timed, none kept"
    compared = answer("compare=[cpu_2core_cluster]")
    assert timed == ["local"], "timed for the CPU machine compared"
    gpu_only = {k: v for k, v in compared.items() if k not in ("compared", "comparison", "seconds")}
    assert gpu_only == {k: v for k, v in alone.items() if k != "seconds"}


def test_a_loading_probe_kept_by_a_question_is_found_by_one_that_times_the_rates(tmp_path, monkeypatch, capsys):
    """This machine's probes are kept under its identity (host, cores, devices), which a GPU
    question detects without timing the machine's rates; a question that also asks about a CPU
    machine times them on that same identity, and finds the loading probe kept."""
    from ddlx.costmodel import hardware as hw_module
    from ddlx.predict import cli

    if hardware(_compose_hw("hw=local"), None, timed=False).device_kind != "cpu":
        pytest.skip("this machine has a GPU: a GPU question prices it")
    monkeypatch.setattr(hw_module, "_measure_rates", lambda spec: timed.append("rates") or {
        "peak_tflops": 0.4, "peak_tflops_by_type": {"bf16": 0.4}, "memory_bandwidth_gb_s": 3.0, "node_memory_bandwidth_gb_s": 6.0})
    timed = []
    monkeypatch.setattr(cli, "probe_loading", lambda data, max_s: lambda: timed.append("loading") or 1e-3)
    monkeypatch.setattr(cli, "probe_batches", lambda *args, **kwargs: lambda n: timed.append("training") or [ProbedBatch(0.5, 0.01)] * n)

    def answer(*overrides: str) -> dict:
        cfg = _compose_recommend("hw=titanrtx_4x", "output=json", "log=false", f"paths.root={tmp_path}",
                                 f"detected_dir={tmp_path / 'hw'}", "cpu_allocator=system", "model=resnet18",
                                 "data.image_size=32", *overrides)
        run_recommend(cfg, tmp_path / "out", CONF_DIR / "hw")
        return json.loads(capsys.readouterr().out)

    alone = answer()
    assert timed == ["loading"], "a GPU question times the loading its target's CPU cores would do, and no rate"
    compared = answer("compare=[cpu_2core_cluster]")
    assert timed == ["loading", "rates"], "the rates, for the CPU machine; the loading probe is found, not timed again"
    assert compared["predictions"] == alone["predictions"]


def test_a_gpu_machine_asked_about_a_cpu_cluster_times_nothing_of_its_own(tmp_path, monkeypatch, capsys):
    """The other way round from the test above: on a (stood-in) GPU machine, a question about a
    CPU cluster has no machine of this one's kind, so this machine's rates are not timed and it
    probes nothing; the answer comes from the cluster's description."""
    import types

    import torch

    from ddlx.costmodel import hardware as hw_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(name="NVIDIA H200", total_memory=141e9))
    assert hardware(_compose_hw("hw=local"), None, timed=False).device_kind == "gpu"
    timed = []
    monkeypatch.setattr(hw_module, "_measure_rates", lambda spec: timed.append(spec.name) or {})
    cfg = _compose_recommend("hw=cpu_2core_cluster", "output=json", "log=false", f"paths.root={tmp_path}",
                             f"detected_dir={tmp_path / 'hw'}", "cpu_allocator=system", "model=resnet18", "data.image_size=32")
    run_recommend(cfg, tmp_path / "out", CONF_DIR / "hw")
    answer = json.loads(capsys.readouterr().out)
    assert timed == [] and not (tmp_path / "hw").exists(), "no rate timed, no probe kept"
    assert answer["hw"] == "cpu_2core_cluster" and answer["recommended"]["fits"]
    assert "probe" not in answer["recommended"]["basis"]


def test_the_runs_line_counts_and_leaves_out_the_runs_of_the_questions_machines_only(monkeypatch):
    """A question about a GPU machine was told '19 not steady state' of this machine's CPU runs,
    none of which could inform its answer."""
    from ddlx.config_check import typed_recommend_config
    from ddlx.predict import cli
    from ddlx.predict.hw_files import from_dict
    from ddlx.records import measured_run

    doc = json.loads((PROJECT_DIR / "tests" / "fixtures" / "cpu2core_runs.json").read_text())
    measured = [measured_run(**run) for run in doc["runs"][:3]]
    failed = replace(measured[0], status="FAILED", run_id="f" * 32)
    monkeypatch.setattr(cli, "store_exists", lambda uri: True)
    monkeypatch.setattr(cli, "check_tracking_uri", lambda *args, **kwargs: None)
    monkeypatch.setattr(cli, "load_runs", lambda uri, names: [*measured, failed])
    cfg = typed_recommend_config(_compose_recommend("hw=titanrtx_4x"))
    gpus, cpus = hardware(_compose_hw("hw=titanrtx_4x")), from_dict(doc["hardware"])  # the runs' machine

    runs, note = cli.measured_runs(cfg, [gpus])
    assert len(runs) == 4 and note.endswith(", 0 of them on hw=titanrtx_4x"), note
    _, note = cli.measured_runs(cfg, [gpus, cpus])
    assert note.endswith(f", 4 of them on hw=titanrtx_4x or hw={cpus.name}; left out: 1 status FAILED (ffffffff)"), note

    from ddlx.costmodel import hardware as hw_module

    if hardware(_compose_hw("hw=local"), None, timed=False).device_kind == "cpu":  # this machine's CPU runs: none for a GPU
        monkeypatch.setattr(hw_module, "_measure_rates", lambda spec: {  # (validate times them: no second spent here)
            "peak_tflops": 0.4, "peak_tflops_by_type": {}, "memory_bandwidth_gb_s": 3.0, "node_memory_bandwidth_gb_s": 6.0})
        with pytest.raises(ConfigError, match=r"mode=validate: no measured runs on hw=titanrtx_4x \(4 runs from .*, "
                                              r"0 of them on hw=titanrtx_4x\)"):
            run_recommend(_compose_recommend("hw=titanrtx_4x", "mode=validate", "detected_dir=null", "cpu_allocator=system"),
                          Path("unused"), CONF_DIR / "hw")  # (the process's allocator: keep_freed would stay)


def test_only_a_baseline_measured_at_the_jobs_batch_is_exact_in_the_close_calls():
    """A baseline scaled from runs at another batch is an estimate: counted exact (0%), it
    narrowed the close-call band and was said to be 'measured at this batch, exact'."""
    from ddlx.predict.cli import close_call_errors

    gpu = _hw(device_kind="gpu", memory_per_device_gb=8, devices_per_node=4, peak_tflops=10.0)
    rec = Predictor(gpu, []).recommend(Job("vgg16", "firesmall", 3, 3, 224, 256, 633))
    rec.sequential = replace(rec.sequential, basis="measured (2 runs, batch 64, scaled per sample)", measured=False)
    assert "sequential" not in close_call_errors(Predictor(gpu, []), "system", rec)
    rec.sequential = replace(rec.sequential, basis="measured (2 runs, same batch)", measured=True)
    assert close_call_errors(Predictor(gpu, []), "system", rec)["sequential"] == 0.0


def test_bad_hw_configs_are_clear_errors():
    with pytest.raises(Exception, match="Could not override 'hw.bogus'"):
        _compose_hw("hw=titanrtx_4x", "hw.bogus=1")
    with pytest.raises(ConfigError, match="hw.bogus is not a hardware field"):
        hardware(_compose_hw("hw=titanrtx_4x", "+hw.bogus=1"))
    with pytest.raises(Exception, match="nodes"):
        _compose_hw("hw=titanrtx_4x", "hw.nodes=two")
    with pytest.raises(ConfigError, match=r"hw.nodes=0 .* must be 1 or more"):
        hardware(_compose_hw("hw=titanrtx_4x", "hw.nodes=0"))
    with pytest.raises(ConfigError, match=r"hw.memory_bandwidth_gb_s=-1.0 for hw=titanrtx_4x; must be > 0"):
        hardware(_compose_hw("hw=titanrtx_4x", "hw.memory_bandwidth_gb_s=-1"))
    with pytest.raises(ConfigError, match=r"hw.allreduce_fixed_us=-5.0 for hw=titanrtx_4x; must be >= 0"):
        hardware(_compose_hw("hw=titanrtx_4x", "hw.allreduce_fixed_us=-5"))
    for key in ("peak_tflops", "intra_node.bandwidth_gb_s", "peak_tflops_by_type.fp16"):  # NaN passes every range
        with pytest.raises(ConfigError, match=rf"hw.{re.escape(key)}=nan for hw=titanrtx_4x; expected a finite number"):
            hardware(_compose_hw("hw=titanrtx_4x", f"hw.{key}=nan"))
    with pytest.raises(ConfigError, match="no inter_node link"):
        hardware(_compose_hw("hw=h100_1x", "hw.nodes=2"))
    with pytest.raises(ConfigError, match=r"intra_node_pairs\[0\].devices=\[0, 7\]"):
        hardware(_compose_hw("hw=titanrtx_4x", "hw.intra_node_pairs=[{devices:[0,7],bandwidth_gb_s:1,latency_us:1}]"))
    missing = OmegaConf.merge(OmegaConf.structured(HardwareSpec), {"name": "x"})
    with pytest.raises(ConfigError, match=r"hw=x: hw.device_kind is missing"):
        hardware(missing)


@pytest.mark.integration
def test_recommend_py_answers_as_json_with_no_runs(tmp_path):
    cmd = [sys.executable, str(PROJECT_DIR / "recommend.py"), "hw=titanrtx_4x", "model=vgg16", "data.image_size=128",
           "output=json", f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path}/out"]
    elsewhere = tmp_path / "elsewhere"  # the folder the user happens to run it from
    elsewhere.mkdir()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout)
    rec = answer["recommended"]
    gpus = "" if "trainer=gpu" in rec["overrides"] else "trainer=gpu "
    assert rec["command"] == (f"python train.py model=vgg16 data=firesmall data.image_size=128 {gpus}{rec['overrides']} "
                              f"++logger.tags.hw=titanrtx_4x"), \
        "the command trains the job asked about, at its image size, on the GPUs, tagged as that machine's run"
    assert answer["hw"] == "titanrtx_4x" and answer["runs"].startswith("no MLflow store")
    assert answer["allocator_advice"] is None, "GPUs: CUDA's caching allocator keeps freed blocks"
    setups = {p["strategy"] for p in answer["predictions"]}
    assert {"sequential", "ddp_nccl", "split", "pipe", "hybrid"} <= setups
    assert answer["recommended"]["fits"] and answer["recommended"]["predicted_epoch_s"] > 0
    assert answer["recommended"]["basis_kind"] == "estimate" and "not measured" in answer["memory_basis"]
    assert any("strategy=sequential trainer=gpu ++logger.tags.hw=titanrtx_4x" in c for c in answer["calibrate_with"]), \
        "an estimate says what to run on the target to calibrate it"
    from ddlx.config_check import check_config

    for command in [rec["command"], *filter(None, [rec["command_with_loading_fix"]]), *answer["calibrate_with"],
                    *(c["command"] for c in answer["close_calls"])]:
        check_config(compose_config(as_a_shell_reads(command)[2:]))  # each printed command is one train.py takes
    assert all({"predicted_epoch_s", "speedup", "memory_per_device_gb", "fits", "basis"} <= set(p) for p in answer["predictions"])
    best = answer["recommended"]["predicted_epoch_s"]
    assert best == min(p["predicted_epoch_s"] for p in answer["predictions"] if p["fits"]), "the fastest that fits"
    close = {p["setup"] for p in answer["close_calls"]}
    assert close == {p["setup"] for p in answer["predictions"] if p["fits"] and p["setup"] != answer["recommended"]["setup"]
                     and p["predicted_epoch_s"] <= best * (1 + answer["close_call_band"])}
    from conftest import runs

    (logged,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "recommendations")
    assert logged.data.tags["recommended"] == answer["recommended"]["setup"]
    assert list((tmp_path / "mlruns").rglob("recommendation.json")) and not (elsewhere / "mlruns").exists(), \
        "the answer's artifact beside train.py's (paths.root/mlruns), not in the current folder"
    written = [d.name for d in (tmp_path / "data" / "synthetic").iterdir()]
    assert written and all("-n256-" in name for name in written), f"the loading probe wrote a few hundred images: {written}"
    (kept,) = (tmp_path / "outputs" / "hw").glob("probes_*.json")
    assert any('"kind": "loading"' in key for key in json.loads(kept.read_text()))
    again = subprocess.run(cmd[:-1] + [f"hydra.run.dir={tmp_path}/out2"], capture_output=True, text=True, timeout=300,
                           env=subprocess_env(), cwd=elsewhere)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads(again.stdout)
    assert (second["predictions"], second["recommended"]) == (answer["predictions"], answer["recommended"]), \
        "the same question asked twice: the same answer (the loading probe is kept, not timed again)"
    nodes = subprocess.run(cmd[:-1] + ["hw.nodes=2", "compare=[titanrtx_4x]", "log=false", f"hydra.run.dir={tmp_path}/out3"],
                           capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=elsewhere)
    assert nodes.returncode == 0, nodes.stderr[-3000:]
    both = json.loads(nodes.stdout)
    assert [(m["hw"], m["hw_overrides"]) for m in [both, *both["compared"]]] == \
        [("titanrtx_4x", ["hw.nodes=2"]), ("titanrtx_4x", [])], "hw=X changed and X as its file: two machines"


@pytest.mark.integration
def test_ctrl_c_stops_recommend_py_with_one_line(tmp_path):
    """Ctrl-C reaches recommend.py and its forked children (the count, the probe's image writers):
    it ends with status 130 and one line, none of them with a traceback, and none lives on."""
    import signal

    cmd = [sys.executable, str(PROJECT_DIR / "recommend.py"), "hw=titanrtx_4x", f"paths.root={tmp_path}",
           f"hydra.run.dir={tmp_path}/out"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=tmp_path, start_new_session=True)  # its own group, as a terminal's Ctrl-C reaches
    deadline = time.monotonic() + 240
    while not list((tmp_path / "data" / "synthetic").glob("*.partial/*/*.jpg")):  # the loading probe's images
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == "ddlx: recommend.py stopped by Ctrl-C before its end: no result was logged", err[-3000:]
    for _ in range(100):
        left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if not left:
            break
        time.sleep(0.1)
    assert not left, "its children end with it"


@pytest.mark.parametrize("composition", [1, 2], ids=["the command line's check", "hydra's"])
def test_ctrl_c_while_recommend_py_composes_its_config_stops_it(tmp_path, composition):
    """Ctrl-C inside omegaconf building the config left a node half made: in the check it became
    a config error (status 2), in Hydra's first composition it was lost and the answer ran on to
    its end (status 0). It is held to the check's end or until the job starts, which stops with the line."""
    proc = signalled(tmp_path, f"composing:{composition}", "SIGINT", "--script", "recommend.py", "hw=titanrtx_4x",
                     f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path}/out")
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == "ddlx: recommend.py stopped by Ctrl-C before its end: no result was logged"
    assert runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "recommendations") == []
    assert not (tmp_path / "out").exists(), "the folder made for a job that never ran went with it"


@pytest.mark.integration
def test_recommend_py_names_bad_values(tmp_path):
    cmd = [sys.executable, str(PROJECT_DIR / "recommend.py"), "hw=titanrtx_4x", "mode=guess",
           f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path}/out"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 2 and "mode=guess; expected one of recommend, validate, probe" in proc.stderr
    assert "Traceback" not in proc.stderr
    # The same way out (ConfigError, above), in this process: a recommend.py start-up apiece is 5 s.
    for bad, message in [("data.image_size=8", "data.image_size=8: expected a value >= 16"),
                         ("detected_dir=/proc/ddlx", "detected_dir=/proc/ddlx"),
                         ("close_call=5", "close_call=5; expected a fraction in [0, 1)"),
                         ("probe_max_s=abc", "probe_max_s=abc: expected a number"),
                         ("probe_max_s=0", "probe_max_s=0.0: expected a value > 0"),
                         ("seed=-1", "seed=-1: expected a value in [0, 4294967295]"),
                         ("trainer.max_epochs=0", "trainer.max_epochs=0: expected a value >= 1"),
                         ("data.batch_size=100000", "but data.batch_size=100000: lower data.batch_size to at most 633 or raise data.num_images")]:
        cfg = _compose_recommend("hw=local", bad, f"paths.root={tmp_path}")
        with pytest.raises(ConfigError, match=re.escape(message)):
            run_recommend(cfg, tmp_path / "out", CONF_DIR / "hw")


def test_link_probe_writes_a_loadable_hw_file(tmp_path):
    from ddlx.predict.linkprobe import fit_line, write_probed_hw

    assert fit_line([0, 1, 2], [1.0, 3.0, 5.0]) == pytest.approx((1.0, 2.0))
    local = hardware(_compose_hw("hw=local"))
    path, doc = write_probed_hw(local, tmp_path)
    assert path.name == f"probed_{local.host}.yaml"
    assert doc["intra_node"]["bandwidth_gb_s"] > 0 and doc["intra_node"]["latency_us"] > 0
    assert doc["memory_bandwidth_gb_s"] > 0
    spec = hardware(load_hw_file(path))
    assert spec.host == local.host and spec.intra_node.bandwidth_gb_s == doc["intra_node"]["bandwidth_gb_s"]


def test_checkpointed_pipe_trades_time_for_memory():
    gpu = _hw(device_kind="gpu", devices_per_node=4, memory_per_device_gb=16, memory_bandwidth_gb_s=600.0)
    job = Job("vgg16", "firesmall", 3, 3, 224, 256, 633)
    profile = profile_model("vgg16", 3, 3, 224)
    seq = SequentialTime(0.01, 0.001, "test")
    devices = ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    plain = STRATEGIES["pipe"].setup(chunks=16, devices=devices)
    ckpt = STRATEGIES["pipe"].setup(chunks=16, devices=devices, checkpoint="always")
    assert memory_need(ckpt, job, gpu, profile).per_device_gb < memory_need(plain, job, gpu, profile).per_device_gb
    slower = model_batch_s(ckpt, job, gpu, profile, seq) - model_batch_s(plain, job, gpu, profile, seq)
    # Eq. 6.1's compute with every sample's forward (1/3 of its work) done again.
    assert slower == pytest.approx(pm.gpipe_compute_s(256 * 0.01 / 3, 4, 16))
    # torchgpipe's and fairscale's default names micro-batches: all but the last recompute, on every stage.
    last = STRATEGIES["pipe"].setup(chunks=16, devices=devices, checkpoint="except_last")
    assert model_batch_s(last, job, gpu, profile, seq) - model_batch_s(plain, job, gpu, profile, seq) == \
        pytest.approx(slower * 15 / 16)
    always, except_last, never = (memory_need(s, job, gpu, profile).per_device_gb for s in (ckpt, last, plain))
    assert except_last == pytest.approx(always, rel=0.05) and except_last < never / 4, \
        "one micro-batch's activations at a time, whichever keeps the last one's"


def test_a_batch_stated_per_worker_grows_with_each_setups_processes():
    """Jansen's thesis, Table 3.3, states DDP's batch per GPU and GPipe's per pipeline, each its own."""
    job = Job("resnet18", "imagenet", 1000, 3, 224, 32, 1280000)
    per_worker = Batches("worker", (("pipe", 384),))
    assert per_worker.job_of(job, "ddp_nccl", 4).batch_size == 128
    assert per_worker.job_of(job, "sequential", 1) is job
    assert per_worker.job_of(job, "pipe", 1).batch_size == 384
    assert Batches().job_of(job, "ddp_nccl", 4) is job, "global: every setup trains the stated batch"
    rec = Predictor(_compose_hw_spec("titanrtx_4x"), []).recommend(job, batches=per_worker, tries={"pipe": {"chunks": [12]}})
    by_label = {p.setup.label: p for p in rec.predictions}
    ddp, one = by_label["ddp_nccl processes=4"], by_label["sequential trainer=gpu"]
    assert (ddp.batch_size, one.batch_size) == (128, 32)
    assert ddp.speedup == pytest.approx(one.epoch_s / ddp.epoch_s), "epochs compared, whatever each one's batch"
    pipes = [p for p in rec.predictions if p.setup.strategy == "pipe"]
    assert pipes and {p.setup.chunks for p in pipes} == {12}, "any micro-batch count"
    assert {p.batch_size for p in pipes} == {384} and all(p.data_overrides == ("data.batch_size=384",) for p in pipes)
    assert {p.setup.checkpoint for p in pipes} >= {"never", "except_last"}, "torchgpipe's default tried"


def test_a_process_stated_its_own_batch_pays_that_batchs_measured_step():
    """With data.batch_per=worker, cpu_mp's two processes each train the batch a sequential run
    measured: each pays that run's step, not half of a step of twice the batch. At 32 px a step
    is mostly fixed cost, so the batch of 8 (probed) takes no longer than the measured 4; scaled
    per sample from it, two processes would be predicted more than twice as fast as one."""
    hw = _hw()
    params = {**_workload_params("alexnet", 32), "data.batch_size": "4"}
    four = Job("alexnet", "firesmall", 3, 3, 32, 4, 320)
    step_4 = 0.5
    runs = [_run("seq-4", STRATEGIES["sequential"].setup(threads=1), params, step_4 * four.steps)]

    def probe(job):
        return lambda n: [ProbedBatch(step_4, 0.0)] * n  # batch 8 no slower than batch 4

    predictor = Predictor(hw, runs, local=hw, probe=probe)
    rec = predictor.recommend(four, batches=Batches("worker"))
    by_label = {p.setup.label: p for p in rec.predictions}
    cpu_mp = by_label["cpu_mp processes=2"]
    assert cpu_mp.batch_size == 8 and "from runs at that batch" in cpu_mp.basis
    eight = replace(four, batch_size=8)
    seq = predictor.sequential(eight, hw, predictor.runs)
    each = model_cost(cpu_mp.setup, eight, hw, profile_model("alexnet", 3, 3, 32), seq).compute_s
    assert each == pytest.approx(step_4 - seq.weight_s), "each process's compute is the measured step of 4"
    # Two processes at batch 8 step the weights half as often as one at batch 4, so a little over
    # 2x is the model's due; scaled per sample from the probe it said 3.8x.
    assert 1.0 < cpu_mp.speedup < 2.5, f"two processes on two cores: {cpu_mp.speedup:.2f}x"
    unsplit = {p.setup.label: p.epoch_s for p in Predictor(hw, runs, local=hw, probe=probe).recommend(four).predictions}
    assert unsplit["sequential threads=1"] == pytest.approx(by_label["sequential threads=1"].epoch_s), \
        "the stated batch's own setups keep their measured time"


def test_a_question_can_rank_only_the_strategies_it_names():
    """strategies=[...] keeps those strategies' setups and the one-device reference; a name that
    is no strategy, or strategies with no setup on the machine, are refused naming them."""
    from ddlx.predict.choices import check_strategies
    from ddlx.predict.setups import candidates, only_strategies

    gpu = _compose_hw_spec("titanrtx_4x")
    job = Job("resnet18", "imagenet", 1000, 3, 224, 32, 1280000)
    every = candidates(gpu, job)
    kept = only_strategies(every, check_strategies(["ddp_nccl", "pipe"]), gpu)
    assert {s.strategy for s in kept} == {"ddp_nccl", "pipe", "sequential"}
    assert [s for s in kept if s.strategy == "sequential"] == [s for s in every if is_baseline(s)]
    assert only_strategies(every, [], gpu) == every
    rec = Predictor(gpu, []).recommend(job, kept)
    assert {p.setup.label for p in rec.predictions} == {s.label for s in kept}
    from ddlx.predict.render import recommendation_dict, recommendation_table

    rec.strategies = ("ddp_nccl", "pipe")
    assert recommendation_dict(rec, "", 0.0, 0.05, [])["strategies"] == ["ddp_nccl", "pipe"], "a narrowed answer says so"
    assert "ranked: only ddp_nccl, pipe (strategies=[ddp_nccl,pipe])" in recommendation_table(rec, "", 0.0, 0.05, [])
    with pytest.raises(ConfigError, match=r"ddp_ncl is not a strategy; did you mean ddp_nccl\?"):
        check_strategies(["ddp_ncl"])
    with pytest.raises(ConfigError, match=r"strategies=\[cpu_mp\]: none has a setup on hw=titanrtx_4x"):
        only_strategies(every, ["cpu_mp"], gpu)
    assert only_strategies(every, ["cpu_mp"], gpu, required=False) == [s for s in every if is_baseline(s)], \
        "a machine compared with the target keeps its reference"


def test_the_candidates_option_is_checked_and_names_the_key():
    assert check_tries({"pipe": {"chunks": [12, 24], "checkpoint": "except_last", "batch_size": 48}}) == \
        ({"pipe": {"chunks": [12, 24], "checkpoint": ["except_last"]}}, [("pipe", 48)])
    assert check_tries({"pipe": {"chunks": None, "checkpoint": None, "batch_size": None}}) == ({"pipe": {}}, [])
    for bad, key in [({"gpipe": {"chunks": [4]}}, "candidates.gpipe"),
                     ({"pipe": {"micro": [4]}}, "candidates.pipe.micro"),
                     ({"pipe": {"chunks": [0]}}, r"candidates.pipe.chunks=\[0\]"),
                     ({"pipe": {"checkpoint": ["sometimes"]}}, "candidates.pipe.checkpoint"),
                     ({"ddp_gloo": {"comm_hook": ["fp16"]}}, "candidates.ddp_gloo.comm_hook"),  # no model reads it
                     ({"pipe": {"batch_size": [48]}}, "candidates.pipe.batch_size")]:
        with pytest.raises(ConfigError, match=key):
            check_tries(bad)


def _compose_hw_spec(name: str) -> HardwareSpec:
    return hardware(load_hw_file(CONF_DIR / "hw" / f"{name}.yaml"))


def test_recommend_py_reproduces_the_thesis_out_of_memory_case(tmp_path, capsys):
    """ResNet-152 on Highres with Jansen's settings (32 per GPU; GPipe 48 in 12 micro-batches,
    recomputing as torchgpipe does): DDP keeping every activation and one GPU run out of memory,
    GPipe fits (its Table 8.1), and so do DDP and FSDP recomputing their blocks in backward, which
    the thesis did not try; the epoch is the whole set. In this process: recommend.py's start-up
    and its JSON on stdout are the subject of the tests above."""
    job = ["model=resnet152", "data=highres"]
    cfg = _compose_recommend(
        "hw=titanrtx_4x", *job, "candidates.pipe.batch_size=48", "candidates.pipe.chunks=[12]",
        "candidates.pipe.checkpoint=[except_last]", "probe=false", "output=json", f"paths.root={tmp_path}",
        "cpu_allocator=system")  # the process's allocator: keep_freed would stay for every later test (compose_config)
    capsys.readouterr()
    run_recommend(cfg, tmp_path / "out", CONF_DIR / "hw", job)
    said = capsys.readouterr()
    answer = json.loads(said.out)
    from conftest import runs

    (logged,) = runs(cfg.logger.tracking_uri, "recommendations")
    assert f"logged as MLflow run {logged.info.run_id} in experiment 'recommendations': mlflow ui" in said.err, \
        "where the answer was kept, as the report says it, beside the JSON (stdout holds the JSON alone)"
    by_setup = {p["setup"]: p for p in answer["predictions"]}
    assert answer["job"]["train_samples"] == 60000, "an epoch is the whole of Highres, as the thesis timed it"
    ddp = by_setup["ddp_nccl processes=4"]
    assert ddp["global_batch"] == 128 and not ddp["fits"], "32 per GPU does not fit a 24 GB Titan RTX"
    assert not by_setup["sequential trainer=gpu"]["fits"]
    gpipe = by_setup["pipe chunks=12 devices=[cuda:0,cuda:1,cuda:2,cuda:3] checkpoint=except_last"]
    assert gpipe["fits"] and gpipe["global_batch"] == 48
    recomputed = by_setup["ddp_nccl processes=4 checkpoint=always"]
    assert recomputed["fits"] and recomputed["global_batch"] == 128
    best = answer["recommended"]
    assert best["fits"] and best["predicted_epoch_s"] <= gpipe["predicted_epoch_s"]
    assert best["command"].endswith(f"data=highres trainer=gpu {best['overrides']} ++logger.tags.hw=titanrtx_4x"), \
        "the thesis job, on the GPUs, tagged as that machine's run"
    over = answer["speedup_over"]
    assert over != "one device" and by_setup[over]["fits"] and by_setup[over]["speedup"] == 1.0, \
        "one GPU cannot hold it: the speedups are over the fitting setup of the fewest processes"
    assert all(by_setup[over]["predicted_epoch_s"] / p["predicted_epoch_s"] == pytest.approx(p["speedup"], rel=1e-3)
               for p in answer["predictions"])
    assert not any("strategy=sequential" in c for c in answer["calibrate_with"]), "no run that cannot be made"


def test_calibration_is_chosen_by_how_well_it_predicts_held_out_runs():
    from ddlx.predict.calibration import fit_calibration
    from ddlx.predict.setups import Cost

    costs = [Cost(1.0, 0.2), Cost(0.5, 0.5), Cost(0.2, 1.0), Cost(0.8, 0.1)]
    # Runs that are 1.5 x compute + 3 x overheads: two factors, recovered exactly.
    two = fit_calibration([(c, 1.5 * c.compute_s + 3 * c.overhead_s) for c in costs])
    assert (two.compute_factor, two.overhead_factor) == (pytest.approx(1.5), pytest.approx(3.0))
    # Runs that are the model x 1.3: one factor.
    one = fit_calibration([(c, 1.3 * c.total_s) for c in costs])
    assert one.compute_factor == pytest.approx(1.3) and one.overhead_factor == pytest.approx(1.3)
    # Each mix of compute and overheads measured twice, 10% either side of the model: no factor
    # predicts a held-out run better than the model, which stays as is.
    pairs = [Cost(1.0, 0.2), Cost(0.5, 0.5), Cost(0.2, 1.0)]
    noisy = fit_calibration([(c, c.total_s * f) for c in pairs for f in (0.9, 1.1)])
    assert (noisy.compute_factor, noisy.overhead_factor) == (1.0, 1.0)
    assert "model as is" in noisy.describe("local")


def test_batch_splitting_strategies_share_one_compute_factor():
    """threads, cpu_mp and DDP run the same network on the same b/W samples per worker: one
    compute factor between them, each its own overhead factor; other groups, and a group with
    too few runs, are fitted apart."""
    from ddlx.predict.calibration import fit_group_calibrations
    from ddlx.predict.setups import Cost

    costs = [Cost(1.0, 0.2), Cost(0.5, 0.5), Cost(0.2, 1.0), Cost(0.9, 0.05)]
    fits = fit_group_calibrations({
        "threads": [(c, 1.1 * c.compute_s + 1.5 * c.overhead_s) for c in costs],
        "cpu_mp": [(c, 1.1 * c.compute_s + 1.2 * c.overhead_s) for c in costs],
        "ddp_gloo": [(costs[0], 3.0)],
        "pipe": [(c, 2.0 * c.total_s) for c in costs],
    })
    assert (fits["threads"].compute_factor, fits["threads"].overhead_factor) == (pytest.approx(1.1), pytest.approx(1.5))
    assert (fits["cpu_mp"].compute_factor, fits["cpu_mp"].overhead_factor) == (pytest.approx(1.1), pytest.approx(1.2))
    assert fits["threads"].compute_shared_with == ("cpu_mp",)
    assert "compute x1.10 (shared with cpu_mp), overheads x1.50" in fits["threads"].describe("local")
    assert fits["ddp_gloo"].compute_shared_with == () and fits["ddp_gloo"].compute_factor == pytest.approx(3.0 / 1.2)
    assert fits["pipe"].compute_shared_with == () and fits["pipe"].compute_factor == pytest.approx(2.0)
    # Compute that differs between the groups beyond noise cannot be shared: each keeps its own
    # two factors when the shared fit would need a non-positive one.
    apart = fit_group_calibrations({
        "threads": [(c, 1.0 * c.compute_s + 0.01 * c.overhead_s) for c in costs],
        "cpu_mp": [(c, 3.0 * c.compute_s + 0.01 * c.overhead_s) for c in costs],
    })
    assert apart["threads"].compute_shared_with == () and apart["threads"].compute_factor == pytest.approx(1.0)


def test_a_probe_keeps_the_loading_apart():
    """A probe splits its batches' loading from their compute, as the runs' data_wait_s does:
    threads loads every sample in one thread, cpu_mp's processes half each, so a probe that
    folded the loading into compute would credit threads with splitting it."""
    from ddlx.predict.sequential_time import from_probe

    hw, profile = _hw(), profile_model("mobilenet_v2", 3, 3, 64)
    job = Job("mobilenet_v2", "firesmall", 3, 3, 64, 32, 320)
    seq = from_probe(job, hw, profile, lambda n: [ProbedBatch(1.0, 0.16), ProbedBatch(1.2, 0.16), ProbedBatch(1.1, 0.2)][:n])
    assert seq.batch_s(32) == pytest.approx(1.1) and seq.load_per_sample_s == pytest.approx(0.16 / 32)
    assert "0.160 s of it loading" in seq.basis
    folded = SequentialTime(seq.per_sample_s + seq.load_per_sample_s, seq.weight_s, "no loading apart")
    threads, cpu_mp = STRATEGIES["threads"].setup(threads=2), STRATEGIES["cpu_mp"].setup(processes=2)
    gap = model_batch_s(threads, job, hw, profile, seq) - model_batch_s(cpu_mp, job, hw, profile, seq)
    folded_gap = model_batch_s(threads, job, hw, profile, folded) - model_batch_s(cpu_mp, job, hw, profile, folded)
    assert gap - folded_gap == pytest.approx(0.16 / 2), "threads pays the half of the loading cpu_mp's other process does"


def test_gpu_predictions_are_bound_by_the_data_loaders():
    """A GPU's T_seq leaves out the host's loading: with data.num_workers > 0 each training process
    loads its share in its workers, on at most its share of the node's cores, and no setup is
    faster than that; with 0 the loading is added to the step. CPU targets time it in T_seq."""
    from ddlx.predict.setups import loader_bound_s

    gpu = _hw(device_kind="gpu", devices_per_node=4, cores_per_node=8, peak_tflops=100.0, memory_per_device_gb=24,
              memory_bandwidth_gb_s=1000.0, intra_node=LinkSpec(10000.0, 1.0))  # links that hide AlexNet's 244 MB of gradients
    job = Job("alexnet", "firesmall", 3, 3, 64, 32, 320, num_workers=2)
    ddp, one = STRATEGIES["ddp_nccl"].setup(processes=4), STRATEGIES["sequential"].setup(trainer="gpu")
    assert loader_bound_s(ddp, job, gpu, 0.005) == pytest.approx(32 / 4 * 0.005 / 2)
    assert loader_bound_s(one, job, gpu, 0.005) == pytest.approx(32 * 0.005 / 2)
    many = Job("alexnet", "firesmall", 3, 3, 64, 32, 320, num_workers=4)
    assert loader_bound_s(ddp, many, gpu, 0.005) == pytest.approx(32 / 4 * 0.005 / 2), "8 cores for 4 processes: 2 each"
    assert loader_bound_s(one, many, gpu, 0.005) == pytest.approx(32 * 0.005 / 4)

    timed = []

    def loading(j):
        timed.append(j)
        return lambda: 0.005

    rec = Predictor(gpu, [], loading=loading).recommend(job, [one, ddp])
    assert len(timed) == 1
    by = {p.setup.strategy: p for p in rec.predictions}
    assert by["sequential"].epoch_s == pytest.approx(32 * 0.005 / 2 * job.steps)
    assert by["ddp_nccl"].epoch_s == pytest.approx(32 / 4 * 0.005 / 2 * job.steps)
    assert by["ddp_nccl"].speedup == pytest.approx(4.0) and "bound by data loading: 2 worker(s)" in by["ddp_nccl"].basis
    assert "not even all of a process's share of the node's 8 cores would" in by["ddp_nccl"].basis
    from ddlx.predict.setups import workers_to_keep_up

    assert workers_to_keep_up(ddp, job, replace(gpu, cores_per_node=64), 0.005, 0.012) == 4, "8 samples x 5 ms in 12 ms"
    assert workers_to_keep_up(ddp, job, gpu, 0.005, 0.012) is None, "2 cores per process"
    unbound = Predictor(gpu, []).recommend(job, [one])
    assert unbound.predictions[0].epoch_s < by["sequential"].epoch_s / 5, "AlexNet at 64 px is loader-bound here"
    assert by["ddp_nccl"].loading_fix is None, "no number of workers on its 2 cores would keep up"

    # with the cores for it, the answer gives the workers that keep up, the epoch then, and the command
    from ddlx.config_check import check_config
    from ddlx.predict.render import recommendation_dict, recommendation_table

    roomy = Predictor(replace(gpu, cores_per_node=64), [], loading=loading).recommend(job, [one])
    workers, epoch_s = roomy.predictions[0].loading_fix
    assert epoch_s == pytest.approx(unbound.predictions[0].epoch_s), "the step's own time, loading hidden"
    assert workers == math.ceil(32 * 0.005 / (epoch_s / job.steps))
    table = recommendation_table(roomy, "no runs", 0.0, 0.05, [])
    saved = 100 * (1 - epoch_s / roomy.predictions[0].epoch_s)
    assert f"with data.num_workers={workers} it would take" in table
    assert f"({saved:.1f}% less):" in table, "two digits may print both epochs alike: the saving says the difference"
    command = recommendation_dict(roomy, "no runs", 0.0, 0.05, [])["recommended"]["command_with_loading_fix"]
    assert f" data.num_workers={workers} " in command and "strategy=sequential trainer=gpu" in command
    check_config(compose_config(as_a_shell_reads(command)[2:]))  # a command train.py takes

    serial = Predictor(gpu, [], loading=loading).recommend(Job("alexnet", "firesmall", 3, 3, 64, 32, 320), [one])
    assert serial.sequential.load_per_sample_s == 0.005 and "data.num_workers=0" in serial.sequential.basis
    assert serial.predictions[0].epoch_s == pytest.approx(unbound.predictions[0].epoch_s + 320 * 0.005)
    assert serial.predictions[0].loading_fix is None, "8 cores cannot load 32 samples in a step's time"
    serial = Predictor(replace(gpu, cores_per_node=64), [], loading=loading).recommend(
        Job("alexnet", "firesmall", 3, 3, 64, 32, 320), [one])
    assert serial.predictions[0].loading_fix == (workers, pytest.approx(epoch_s)), "the same workers hide it"
    text = recommendation_table(serial, "no runs", 0.0, 0.05, [])
    assert "(data.num_workers=0); with data.num_workers=" in text and f"data.num_workers={workers} would" in text

    cpu_rec = Predictor(_hw(), [], loading=lambda j: pytest.fail("CPU targets time the loading in T_seq")).recommend(job, SETUPS[:1])
    assert "bound by data loading" not in cpu_rec.predictions[0].basis


def test_the_one_core_baseline_is_calibrated_even_where_more_threads_are_fastest():
    """On a CPU, sequential threads=2 is no baseline: the calibrate commands run threads=1 and the
    recommended setup, and speedups are over one core."""
    from ddlx.predict.render import calibration_commands, speedup_over

    rec = Predictor(_hw(name="local"), []).recommend(JOB, [STRATEGIES["sequential"].setup(threads=t) for t in (1, 2)])
    assert rec.best.setup.threads == 2 and rec.reference.setup.threads == 1 and speedup_over(rec) == "one device"
    commands = calibration_commands(rec, rec.best, [])
    assert [c.split("strategy=sequential")[1].strip() for c in commands] == ["strategy.threads=1", "strategy.threads=2"]


def test_a_printed_commands_hw_tag_composes_where_the_users_logger_config_sets_it_already():
    """A logger config of the user's own with ``tags: {hw: ...}``: '+logger.tags.hw' would be
    refused (an item is already there); the printed tag overrides it."""
    from types import SimpleNamespace

    from ddlx.config_check import check_config
    from ddlx.predict.render import hw_tag

    (tag,) = hw_tag(SimpleNamespace(hw=SimpleNamespace(name="titanrtx_4x")))
    cfg = compose_config(["+logger.tags.hw=their_own_name", tag])  # the first stands for the user's config
    check_config(cfg)
    assert cfg.logger.tags.hw == "titanrtx_4x"


def test_a_baseline_measured_at_the_jobs_batch_is_not_asked_for_again():
    """The calibrate commands make the runs the answer lacks: with one-core runs of the job's batch
    measured, only the recommended setup's; with runs of another batch only, the baseline too."""
    from ddlx.predict.render import calibration_commands

    one, two = (STRATEGIES["sequential"].setup(threads=t) for t in (1, 2))
    job = Job("resnet18", "firesmall", 3, 3, 64, 32, 320)
    asked = {}
    for batch in ("32", "16"):
        run = _run(f"b{batch}", one, {**_workload_params("resnet18", 64), "data.batch_size": batch}, 10.0)
        rec = Predictor(_hw(name="local", host="test-host"), [run]).recommend(job, [one, two])
        assert rec.best.setup == two and not rec.best.calibrated, rec.best
        asked[batch] = [c.split("strategy=sequential")[1].strip() for c in calibration_commands(rec, rec.best, [])]
    assert asked == {"32": ["strategy.threads=2"], "16": ["strategy.threads=1", "strategy.threads=2"]}
    from ddlx.job import Batches

    measured_32 = _run("b32", one, _workload_params("resnet18", 64), 10.0)
    own = Predictor(_hw(name="local", host="test-host"), [measured_32]).recommend(
        job, [one, two], batches=Batches(own=(("sequential", 48),)))  # the baseline asked at a batch of its own
    assert own.sequential.measured and [p.batch_size for p in own.predictions if p.setup == one] == [48]
    assert [c.split("strategy=sequential")[1].split() for c in calibration_commands(own, own.best, [])] == \
        [["strategy.threads=1"], ["strategy.threads=2"]], "the baseline too: not measured at 48"


@pytest.mark.integration
def test_the_runs_an_estimate_asks_for_count_once_made_however_few_steps_an_epoch_has(tmp_path, data_dir, tracking_uri,
                                                                                        capsys):
    """The user's loop, 'run these there, then ask again', on a job of 5 steps an epoch: the
    calibrate command's run (train.py's 5 epochs, no warm-up left out, 25 steps) was left out as
    'not steady state', and the next answer asked for the same run again."""
    import shlex

    from ddlx.run import train

    store = [f"paths.root={tmp_path}", f"paths.data_dir={data_dir}", f"logger.tracking_uri={tracking_uri}"]
    job = ["model=resnet18", "data.image_size=32", "data.synthetic_size=[40,64]", "data.num_images=48",
           "data.batch_size=8", "data.num_workers=0", "cpu_allocator=system"]

    def ask() -> dict:
        capsys.readouterr()
        run_recommend(_compose_recommend("hw=local", "output=json", "log=false", "probe=false", "strategies=[sequential]",
                                         *store, *job), tmp_path / "answer", CONF_DIR / "hw", job)
        return json.loads(capsys.readouterr().out)

    (baseline,) = [c for c in ask()["calibrate_with"] if "strategy.threads=1" in c]
    train(compose_config([*store, *shlex.split(baseline)[2:], "checkpoint.save=none"]), tmp_path / "run")
    again = ask()
    assert again["sequential_basis"].startswith("measured (1 run, same batch)"), again["runs"]
    assert not any("strategy.threads=1" in c for c in again["calibrate_with"]), "the baseline is not asked for again"


def test_the_runs_asked_for_are_the_shortest_that_count():
    """A calibrate command is a measurement: on an epoch of 100 steps or more one epoch counts (not
    train.py's five: ResNet-152 on Highres is 720 s an epoch on 4 GPUs); on a smaller one a warm-up
    epoch is left out and two are timed."""
    from ddlx.predict.render import calibration_commands

    one, two = (STRATEGIES["sequential"].setup(threads=t) for t in (1, 2))
    tails = {}
    for images in (60000, 320):
        rec = Predictor(_hw(name="local", host="test-host"), []).recommend(Job("resnet18", "firesmall", 3, 3, 64, 32, images),
                                                                          [one, two])
        commands = calibration_commands(rec, rec.best, [])
        assert len(commands) == 2
        (tails[images],) = {c.split("firesmall ")[1].split(" strategy=")[0] for c in commands}
    assert tails == {60000: "trainer.max_epochs=1", 320: "measure.warmup_epochs=1 trainer.max_epochs=3"}


def test_a_gpu_runs_data_wait_is_the_jobs_loading_only_where_it_loaded_as_the_job_does():
    """A GPU baseline run with data.num_workers=0 waited 1.6 of its 2.0 s for data: a job with
    workers predicts the step without that wait (its own loaders bound it apart), and the answer
    for workers=0 gives the workers that hide the wait and the epoch that the job with them is
    predicted to take."""
    gpu = _hw(device_kind="gpu", devices_per_node=4, cores_per_node=64, peak_tflops=100.0, memory_per_device_gb=24,
              memory_bandwidth_gb_s=1000.0, intra_node=LinkSpec(10000.0, 1.0))
    one = STRATEGIES["sequential"].setup(trainer="gpu")
    run = _run("r1", one, {**_workload_params("alexnet", 64), "data.num_workers": "0"}, 2.0)
    run.metrics["data_wait_s"] = 1.6

    def predicted(workers: int):
        job = Job("alexnet", "firesmall", 3, 3, 64, 32, 320, num_workers=workers)
        return Predictor(gpu, [run], loading=lambda j: lambda: 0.005).recommend(job, [one]).predictions[0]

    serial = predicted(0)
    assert serial.epoch_s == pytest.approx(2.0), "as measured, loading between steps"
    workers, epoch_s = serial.loading_fix
    assert epoch_s == pytest.approx(0.4) and predicted(workers).epoch_s == pytest.approx(epoch_s)
    assert predicted(workers).loading_fix is None


def test_a_held_out_workload_is_probed_with_its_own_runs_data(tiny_config):
    from ddlx.predict.cli import _probe_data

    cfg = tiny_config()
    small, large = _workload_params("resnet18", 64), _workload_params("resnet18", 64)
    large.update({"data.num_images": "800", "train": "640"})
    runs = [_run(f"r{n}", SETUPS[0], p, 3.0) for n, p in (("small", small), ("large", large))]
    job = job_of_run(runs[1])
    assert _probe_data(cfg, job, runs).num_images == 800, "the run of this job, not one of the same network and batch"
    assert _probe_data(cfg, job_of_run(runs[0]), runs).num_images == 400


@pytest.mark.integration
def test_recommend_py_validate_reports_errors_and_picks(tmp_path, tracking_uri):
    """mode=validate end to end on a store of runs taken on this host (no probe: FLOPs fallback), with
    the allocator train.py's default resolves to here, as the default of recommend.py does."""
    from mlflow.tracking import MlflowClient

    hw = _hw(host=socket.gethostname())
    uri = tracking_uri
    client = MlflowClient(uri)
    exp = client.create_experiment("ddlx")
    for run in _consistent_runs(hw):
        created = client.create_run(exp, tags=run.tags)
        for key, value in {**run.params, "cpu_allocator": "keep_freed"}.items():
            client.log_param(created.info.run_id, key, value)
        for key, value in run.metrics.items():
            client.log_metric(created.info.run_id, key, value)
        client.set_terminated(created.info.run_id, "FINISHED")
    cmd = [sys.executable, str(PROJECT_DIR / "recommend.py"), "mode=validate", "output=json", "probe=false",
           f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path}/out"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert len(result["rows"]) == 12 and set(result["per_strategy"]) == {"sequential", "threads", "cpu_mp", "pipe"}
    assert set(result["recommendations"]) == {f"{m}/firesmall 64px b32 cpu_allocator=keep_freed" for m in ("alexnet", "resnet18", "vgg11")}
    assert 0 <= result["correct_fraction"] <= 1
    slowdowns = [p["slowdown"] for p in result["recommendations"].values()]
    assert result["mean_slowdown"] == pytest.approx(sum(slowdowns) / 3) and result["max_slowdown"] == max(slowdowns)
    assert all(s == 0 for s, p in zip(slowdowns, result["recommendations"].values()) if p["correct"])
    assert all(r["measured_s"] == statistics.median(r["run_times_s"]) for r in result["rows"])
    # One run per configuration: resampling cannot move a ranking, so it agrees with the strict figure.
    assert result["fastest_reproduced_fraction"] == 1.0
    assert result["recommended_fastest_fraction"] == pytest.approx(result["correct_fraction"])
    assert (tmp_path / "out" / "validation.json").exists() and (tmp_path / "out" / "predicted_vs_measured.png").exists()


@pytest.mark.integration
def test_json_answer_stays_parseable_when_a_probe_logs(tmp_path):
    """hw=local with no runs probes a few batches; its log lines go to stderr, not into the JSON."""
    cmd = [sys.executable, str(PROJECT_DIR / "recommend.py"), "hw=local", "model=alexnet", "output=json",
           "data.image_size=32", "data.synthetic_size=[40,64]", "data.num_images=48", "data.batch_size=8",
           "data.num_workers=0", f"paths.root={tmp_path}", f"hydra.run.dir={tmp_path}/out"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout)
    assert answer["sequential_basis"].startswith("local probe") and "INFO" in proc.stderr


@pytest.mark.integration
def test_the_step_probe_leaves_no_loader_workers_behind(tiny_config):
    """Workers left waiting (persistent, the probe stopping after a few batches) were killed at
    recommend.py's exit, torch printing a traceback for each."""
    import psutil

    from ddlx.config_check import typed_config
    from ddlx.predict.sequential_time import probe_batches

    data = typed_config(tiny_config("data.num_workers=1")).data
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    assert len(probe_batches(data, "resnet18")(2)) == 2
    left = alive(c for c in psutil.Process().children(recursive=True) if c.pid not in before)
    assert not left, left


def test_the_training_process_data_loading_is_split_by_processes_not_by_threads():
    hw = _hw()
    job = Job("resnet18", "firesmall", 3, 3, 64, 32, 320)
    profile = profile_model("resnet18", 3, 3, 64)
    bare, loading = SequentialTime(0.01, 0.02, "t"), SequentialTime(0.01, 0.02, "t", load_per_sample_s=0.002)
    added = {s.label: model_batch_s(s, job, hw, profile, loading) - model_batch_s(s, job, hw, profile, bare)
             for s in [STRATEGIES["sequential"].setup(threads=2), STRATEGIES["threads"].setup(threads=2),
                       STRATEGIES["cpu_mp"].setup(processes=2), STRATEGIES["ddp_gloo"].setup(processes=2)]}
    assert added["sequential threads=2"] == pytest.approx(32 * 0.002), "intra-op threads do not load images"
    assert added["threads threads=2"] == pytest.approx(32 * 0.002), "the main thread loads the whole batch"
    assert added["cpu_mp processes=2"] == pytest.approx(16 * 0.002) and added["ddp_gloo processes=2"] == pytest.approx(16 * 0.002)


def test_resampling_the_runs_says_how_reproducible_the_measured_fastest_is():
    def row(setup, predicted, runs):
        return ValidationRow("", "w", setup, setup, predicted, "", tuple(runs))

    apart = pick([row("a", 1.0, [10.0, 10.1, 10.2]), row("b", 2.0, [12.0, 12.1, 12.2])])
    assert (apart.fastest_reproduced, apart.recommended_fastest) == (1.0, 1.0), "every resample: a faster"
    wrong = pick([row("a", 2.0, [10.0, 10.1, 10.2]), row("b", 1.0, [12.0, 12.1, 12.2])])
    assert (wrong.fastest_reproduced, wrong.recommended_fastest) == (1.0, 0.0)
    # Interleaved runs: a's median 10.0 beats b's 10.05, but resamples often reverse it.
    tie = pick([row("a", 2.0, [9.0, 10.0, 11.0]), row("b", 1.0, [9.5, 10.05, 10.6])])
    assert tie.fastest == "a" and not tie.correct
    assert 0.3 < tie.fastest_reproduced < 0.7 and tie.fastest_reproduced + tie.recommended_fastest == pytest.approx(1.0)
    assert pick([row("a", 2.0, [9.0, 10.0, 11.0]), row("b", 1.0, [9.5, 10.05, 10.6])]) == tie, "seeded: same runs, same figures"
    single = pick([row("a", 1.0, [10.0]), row("b", 2.0, [10.5]), row("c", 3.0, [11.0])])
    assert single.fastest_reproduced == 1.0, "one run each: resamples cannot move it (repeats are what show the noise)"


# ---- precision ------------------------------------------------------------------------------

def test_a_precision_sets_the_units_the_gpu_model_runs_it_on():
    """Uncalibrated T_seq on a GPU: fp16 on the Titan RTX's tensor cores, faster than fp32 but
    not by the 8x of the peaks (the kernels between the products are bound by memory); bf16 on
    the fp32 units there (Turing has none for it, and the basis says so); fp32 convolutions on an
    H100's TF32 units (PyTorch's default); fp64 from counted FLOPs at its own peak; a lower
    tensor peak is slower."""
    titan, h100 = _compose_hw_spec("titanrtx_4x"), _compose_hw_spec("h100_1x")
    job = Job("vgg16", "firesmall", 2, 3, 224, 32, 640)

    def seq(hw, precision):
        return Predictor(hw, []).recommend(replace(job, precision=precision), [STRATEGIES["sequential"].setup()]).sequential

    fp32, fp16, bf16, fp64 = (seq(titan, p) for p in ("32-true", "16-mixed", "bf16-mixed", "64-true"))
    assert 1.5 < fp32.per_sample_s / fp16.per_sample_s < 130.5 / 16.3
    assert "per-layer GPU model" in fp16.basis and "16-mixed" in fp16.basis
    assert bf16.per_sample_s > fp16.per_sample_s and "no bf16 peak" in bf16.basis
    assert fp64.per_sample_s > 10 * fp32.per_sample_s and "fp64 peak" in fp64.basis
    assert fp16.weight_s == pytest.approx(fp32.weight_s), "the optimizer's passes over fp32 master weights under autocast"
    no_tf32 = replace(h100, peak_tflops_by_type={k: v for k, v in h100.peak_tflops_by_type.items() if k != "tf32"})
    assert seq(h100, "32-true").per_sample_s < seq(no_tf32, "32-true").per_sample_s, "convolutions on TF32 by default"
    slow = seq(replace(titan, peak_tflops_by_type={"fp16": 20.0}), "16-mixed")
    assert slow.per_sample_s > fp16.per_sample_s, "no faster than its peak allows"


def test_16_mixed_is_not_predicted_on_cpus():
    """Lightning trains it there as bf16-mixed (tests/test_precision.py): the recommender says so."""
    from ddlx.costmodel.numerics import numerics_on

    assert numerics_on("16-mixed", "gpu").compute == "fp16" and numerics_on("bf16-mixed", "cpu").compute == "bf16"
    with pytest.raises(ConfigError, match=r"trainer.precision=16 on a CPU machine: .*trainer.precision=bf16-mixed"):
        numerics_on("16", "cpu")


def test_an_efficiency_is_calibrated_against_the_peak_of_its_runs_precision():
    from ddlx.predict.sequential_time import efficiency_from_runs, from_flops

    hw = _hw(peak_tflops_by_type={"bf16": 0.4})
    half = [replace(r, workload=replace(r.workload, precision="bf16-mixed")) for r in _consistent_runs(hw)]
    half = [r for r in half if r.tags.get("strategy") == "sequential"]
    profile_of = lambda r: profile_model(r.workload.model, 3, 3, r.workload.image_size)  # noqa: E731
    on_bf16 = efficiency_from_runs(half, lambda r: hw, profile_of, "cpu")
    on_fp32 = efficiency_from_runs(half, lambda r: replace(hw, peak_tflops_by_type={}), profile_of, "cpu")
    assert on_bf16 and on_bf16 == pytest.approx([e * 0.1 / 0.4 for e in on_fp32]), "the same runs, 4x the peak"
    job = replace(job_of_run(half[0]), precision="bf16-mixed")
    est = from_flops(job, hw, profile_model(job.model, 3, 3, job.image_size), on_bf16)
    assert "bf16 peak" in est.basis and "from 3 measured cpu baseline(s)" in est.basis


def test_a_precision_sets_the_bytes_of_weights_gradients_and_activations():
    from ddlx.costmodel.numerics import numerics_of

    fp32 = profile_model("vgg11", 2, 3, 64)
    layers = sum(layer.activation_bytes for layer in fp32.layers)
    mixed, half, double = (fp32.at(numerics_of(p)) for p in ("bf16-mixed", "bf16-true", "64"))
    counted = sum(layer.mixed_activation_bytes for layer in fp32.layers)
    assert sum(layer.activation_bytes for layer in mixed.layers) == counted, "what autograd saves under autocast"
    assert layers // 2 <= counted < layers * 0.7, "the products' outputs in 2 bytes; max-pool indices, masks as they are"
    assert mixed.input_bytes == fp32.input_bytes, "the loader's fp32 images"
    assert mixed.gradient_mb == fp32.gradient_mb and mixed.state_bytes(10) == 10 * (3 * 4 + 2), \
        "autocast: fp32 weights, gradients and momentum, plus a bf16 copy of the weights"
    assert half.gradient_mb == fp32.gradient_mb / 2 and half.input_bytes == fp32.input_bytes // 2
    assert half.activation_bytes_per_sample == mixed.activation_bytes_per_sample, "the same layers in 2 bytes"
    assert half.boundary_bytes([10, len(fp32.layers) - 10]) == [b // 2 for b in fp32.boundary_bytes([10, len(fp32.layers) - 10])]
    assert double.state_bytes(10) == 10 * 3 * 8 and double.activation_bytes_per_sample == 2 * fp32.activation_bytes_per_sample
    hw, job = _compose_hw_spec("titanrtx_4x"), Job("vgg11", "firesmall", 2, 3, 64, 32, 640)
    ddp = STRATEGIES["ddp_nccl"].setup(processes=4)
    from ddlx.costmodel.gpu_measured import gpu_working_memory

    working = gpu_working_memory()[0] / GB  # the libraries' workspaces: the same in every precision
    per_device = {p: memory_need(ddp, replace(job, precision=p), hw, fp32.at(numerics_of(p))).per_device_gb - working
                  for p in ("32-true", "bf16-true", "64-true")}
    assert per_device["32-true"] / 2 <= per_device["bf16-true"] < per_device["32-true"] * 0.6
    assert per_device["64-true"] == pytest.approx(per_device["32-true"] * 2, rel=0.01)


def test_setups_that_refuse_a_precision_are_not_candidates():
    from ddlx.predict.setups import candidates

    hw, job = _compose_hw_spec("titanrtx_4x"), Job("vgg11", "firesmall", 2, 3, 64, 32, 640)

    def refusing(precision):
        return {s.label for s in candidates(hw, replace(job, precision=precision))
                if s.strategy in ("fsdp", "cpu_mp") or getattr(s, "engine", None) == "torch"}

    assert refusing("bf16-mixed") and not refusing("16-mixed"), "16-mixed: loss scaling needs every rank's gradients"


def test_bad_peaks_by_type_are_named():
    with pytest.raises(ConfigError, match=r"hw.peak_tflops_by_type.fp8=200.0 for hw=titanrtx_4x.*fp64, tf32, bf16, fp16"):
        hardware(_compose_hw("hw=titanrtx_4x", "+hw.peak_tflops_by_type.fp8=200"))
    from ddlx.predict.cli import job_from_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="recommend", overrides=["trainer.precision=transformer-engine"])
    with pytest.raises(ConfigError, match=r"trainer.precision=transformer-engine: the recommender models 32-true"):
        job_from_config(cfg)


def test_hybrid_sharding_shards_within_its_groups_and_averages_across_them():
    two_nodes = _hw(device_kind="gpu", nodes=2, devices_per_node=2, memory_per_device_gb=16, memory_bandwidth_gb_s=600.0,
                    inter_node=LinkSpec(1.0, 20.0))
    # ResNet-18: no layer so large that gathering it outweighs the sharding (VGG's classifier is).
    job, profile = Job("resnet18", "firesmall", 3, 3, 224, 64, 633), profile_model("resnet18", 3, 3, 224)
    seq = SequentialTime(0.01, 0.0, "test")
    setups = {level: STRATEGIES["fsdp"].setup(processes=4, sharding=level, shard_size=2 if level == "hybrid" else None)
              for level in ("full", "hybrid", "none")}
    memory = {level: memory_need(s, job, two_nodes, profile).per_device_gb for level, s in setups.items()}
    assert memory["full"] < memory["hybrid"] < memory["none"], "1/2 of the state per rank, between 1/4 and all of it"
    # full inside each node's group (the last unit exposed), then the group's half of the gradients
    # averaged between the two nodes (its last unit's half exposed).
    largest = max(layer.params for layer in profile.layers) * 4 / 1e6
    fixed, intra, inter = 50e-6, pm.Link(20e-6, 5e3), pm.Link(20e-6, 1e3)
    expected = (64 * 0.01 / 4 + pm.ring_allreduce_s(2, largest, [intra] * 2, fixed)
                + pm.ring_allreduce_s(2, largest / 2, [inter] * 2, fixed))
    assert model_batch_s(setups["hybrid"], job, two_nodes, profile, seq) == pytest.approx(expected)


def test_cpu_processes_beyond_the_cores_share_them():
    from ddlx.predict.setups import model_cost

    cpu, profile = _hw(), profile_model("resnet18", 3, 3, 64)  # 2 cores
    seq = SequentialTime(0.01, 0.0, "test")
    for strategy, knobs in (("ddp_gloo", {}), ("fsdp", {"sharding": "full"})):
        two, four = (model_cost(STRATEGIES[strategy].setup(processes=p, **knobs), JOB, cpu, profile, seq) for p in (2, 4))
        assert four.compute_s == pytest.approx(two.compute_s) == pytest.approx(32 * 0.01 / 2), strategy
        assert four.total_s > two.total_s, f"{strategy}: the same compute on the 2 cores, and a longer ring"


@pytest.mark.integration
def test_one_question_compares_machines_and_names_the_cheapest_within_the_time(tmp_path, capsys):
    """compare= answers the same job on other hw files; where a file gives a price per device-hour
    each setup's epoch has a cost (price x its devices x its hours), and the cheapest setup whose
    epoch is predicted within max_epoch_s is named with its command."""
    job = ["model=resnet18", "data=firesmall"]

    def answer(*extra, compare="[a100_sxm4_40gb_8x,h100_1x]"):
        cfg = _compose_recommend("hw=v100_8x", *job, f"compare={compare}", "probe=false", "output=json",
                                 f"paths.root={tmp_path}", "cpu_allocator=system", *extra)
        capsys.readouterr()
        run_recommend(cfg, tmp_path / "out", CONF_DIR / "hw", job)
        return json.loads(capsys.readouterr().out)

    full = answer()
    machines = [full, *full["compared"]]
    assert [m["hw"] for m in machines] == ["v100_8x", "a100_sxm4_40gb_8x", "h100_1x"]
    assert full["price_per_device_hour"] is None and "epoch_cost" not in full["predictions"][0], "v100_8x gives no price"
    a100 = machines[1]
    for p in a100["predictions"]:
        assert p["epoch_cost"] == pytest.approx(1.844 * p["devices"] * p["predicted_epoch_s"] / 3600, rel=1e-3)
    by = {p["setup"]: p for p in a100["predictions"]}
    assert by["ddp_nccl processes=8"]["devices"] == 8 and by["sequential trainer=gpu"]["devices"] == 1
    assert by["hybrid processes=4 local=split"]["devices"] == 8
    fitting = [(m["hw"], p) for m in machines for p in m["predictions"] if p["fits"]]
    fastest = min(fitting, key=lambda hp: hp[1]["predicted_epoch_s"])
    assert (full["comparison"]["fastest"]["hw"], full["comparison"]["fastest"]["setup"]) == (fastest[0], fastest[1]["setup"])
    priced = [(h, p) for h, p in fitting if "epoch_cost" in p]
    cheapest = min(priced, key=lambda hp: hp[1]["epoch_cost"])
    assert full["comparison"]["cheapest"]["epoch_cost"] == pytest.approx(cheapest[1]["epoch_cost"], rel=1e-3)

    # A limit between the cheapest's epoch and the fastest's: the cheapest setup within it instead.
    limit = (fastest[1]["predicted_epoch_s"] + cheapest[1]["predicted_epoch_s"]) / 2
    assert fastest[1]["predicted_epoch_s"] < limit < cheapest[1]["predicted_epoch_s"], "the fixture has a trade-off"
    within = answer(f"max_epoch_s={limit}")["comparison"]
    ok = [p for h, p in priced if p["predicted_epoch_s"] <= limit]
    assert within["cheapest"]["predicted_epoch_s"] <= limit
    assert within["cheapest"]["epoch_cost"] == pytest.approx(min(p["epoch_cost"] for p in ok), rel=1e-3)
    assert within["cheapest"]["command"].startswith("python train.py model=resnet18 data=firesmall")
    none = answer("max_epoch_s=0.0001")["comparison"]
    assert none["cheapest"] is None and none["setups_within"] == 0
    twice = answer(compare="[h100_1x,v100_8x,h100_1x]")
    assert [m["hw"] for m in [twice, *twice["compared"]]] == ["v100_8x", "h100_1x"], "each machine once, hw= first"

    # hw=X changed by an override against X as its file: two machines, told apart by the override.
    cfg = _compose_recommend("hw=v100_8x", "hw.nodes=2", *job, "compare=[v100_8x]", "probe=false", "output=json",
                             f"paths.root={tmp_path}", "cpu_allocator=system")
    capsys.readouterr()
    run_recommend(cfg, tmp_path / "out", CONF_DIR / "hw", job, ["hw.nodes=2"])
    changed = json.loads(capsys.readouterr().out)
    both = [changed, *changed["compared"]]
    assert [(m["hw"], m["hw_overrides"]) for m in both] == [("v100_8x", ["hw.nodes=2"]), ("v100_8x", [])]
    assert max(p["devices"] for p in both[0]["predictions"]) == 16 and max(p["devices"] for p in both[1]["predictions"]) == 8


@pytest.mark.parametrize("override, key", [
    ("compare=[nosuch]", "compare"), ("compare=titanrtx_4x", "compare"), ("max_epoch_s=-3", "max_epoch_s"),
    ("hw.price_per_device_hour=2.0", "hw.price_basis"),
])
def test_comparison_inputs_are_checked_by_name(tmp_path, override, key):
    cfg = _compose_recommend("hw=titanrtx_4x", "probe=false", f"paths.root={tmp_path}", override)
    with pytest.raises(ConfigError, match=re.escape(key)):
        run_recommend(cfg, tmp_path / "out", CONF_DIR / "hw")


def test_compiling_is_recommended_only_where_it_pays_for_the_epochs_asked():
    """Compiled runs beside eager runs of the same setups on the target give compiled/eager (their
    median) and the compile seconds; the recommender compiles the recommended setup only when the
    run's epochs pass the break-even, and a held-out setup's break-even is predicted within an epoch."""
    from ddlx.predict.compile_gain import measured_gain
    from ddlx.predict.render import compile_lines, recommendation_dict

    hw, params = _hw(host="test-host"), _workload_params("resnet18", 64)
    # A network's gain varies little between setups of one machine (its kernels are the same): a
    # break-even of ~40 epochs moves by an epoch for every 0.3 point of compiled/eager.
    measured = {"sequential": (20.0, 0.870, 60.0), "threads": (11.0, 0.868, 62.0), "cpu_mp": (10.5, 0.869, 61.5)}
    runs = []
    for setup in SETUPS[:3]:
        eager_s, factor, compile_s = measured[setup.strategy]
        runs.append(_run(f"e-{setup.strategy}", setup, params, eager_s))
        compiled = _run(f"c-{setup.strategy}", setup, params, eager_s * factor)
        compiled.params["compile.enable"] = "True"
        compiled.metrics["compile_s"] = compile_s
        runs.append(compiled)
    job = job_of_run(runs[0])

    # The cpu_mp pair held out: its break-even from the other two setups' gain.
    held_out = measured_gain([r for r in runs if r.strategy != "cpu_mp"], job, hw)
    assert held_out.factor == pytest.approx(0.869) and held_out.compile_s == pytest.approx(61.0)
    eager_s, factor, compile_s = measured["cpu_mp"]
    assert abs(held_out.break_even_epochs(eager_s) - compile_s / (eager_s * (1 - factor))) < 1.0

    gain = measured_gain(runs, job, hw)
    assert gain.factor == pytest.approx(0.869) and gain.runs == 3 and set(gain.setups) == {s.label for s in SETUPS[:3]}
    own = measured_gain(runs, job, hw, "threads threads=2")
    assert (own.factor, own.compile_s, own.setups) == (pytest.approx(0.868), 62.0, ("threads threads=2",)), "its own pair"
    assert measured_gain(runs, job, _hw(host="another")) is None, "only the target's runs say what compiling gains"
    rec = Predictor(hw, runs).recommend(job)
    best = rec.best
    assert rec.compile_gain == measured_gain(runs, job, hw, best.setup.label), "the recommended setup's, where measured"
    even = rec.compile_gain.break_even_epochs(best.epoch_s)
    for epochs, pays in ((int(even) - 1, False), (int(even) + 1, True), (None, False)):
        rec.epochs = epochs
        assert rec.compile_pays is pays
        command = recommendation_dict(rec, "", 0.0, 0.05, [])["recommended"]["command"]
        assert command.endswith("compile.enable=true") is pays
        assert ("compile.enable=true above" in compile_lines(rec, best, [])[0]) is pays
    rec.compile_gain = replace(rec.compile_gain, factor=1.02)
    rec.epochs = 1000
    assert not rec.compile_pays and "not faster" in compile_lines(rec, best, [])[0]
    rec.compile_gain = None
    assert "no compiled run of resnet18" in compile_lines(rec, best, [])[0]
    from ddlx.config_check import check_config

    for epochs in (1, 5):  # the measuring command: a run of 3 epochs where fewer were asked, one value per key
        rec.epochs = epochs
        measure = compile_lines(rec, best, [f"trainer.max_epochs={epochs}"])[0].split("compile.enable: ")[1]
        assert measure.count("trainer.max_epochs=") == 1 and f"trainer.max_epochs={max(epochs, 3)}" in measure
        assert measure.endswith(" ++logger.tags.hw=test"), "tagged as the described machine's, so the answer counts it"
        check_config(compose_config(measure.split()[2:]))
    split = replace(best, setup=STRATEGIES["hybrid"].setup(processes=2, local="split"))
    assert compile_lines(rec, split, [])[0].endswith("hybrid with these knobs cannot take compile.enable"), \
        "no command train.py would refuse"

    # Loader-bound: compiling pays for the starved epoch, not for the one with the loading hidden.
    rec.compile_gain, rec.epochs = measured_gain(runs, job, hw, best.setup.label), int(even) + 1
    starved = replace(best, loading_fix=(4, best.epoch_s / 10))
    rec.predictions = [starved if p is best else p for p in rec.predictions]
    answer = recommendation_dict(rec, "", 0.0, 0.05, [])["recommended"]
    assert answer["command"].endswith("compile.enable=true")
    assert "data.num_workers=4" in answer["command_with_loading_fix"]
    assert "compile.enable" not in answer["command_with_loading_fix"], "at a tenth of the epoch it would not pay"


def test_the_compile_cost_is_what_runs_that_compiled_their_graphs_paid():
    """A compiled run whose graphs all came from inductor's cache (a sweep's later job) compiles in
    a fraction of a first compile's seconds: the break-even rests on the runs that compiled theirs,
    and where none did, the basis says the figure is a warm cache's."""
    from ddlx.predict.compile_gain import measured_gain
    from ddlx.predict.render import compile_dict

    hw, params = _hw(host="test-host"), _workload_params("resnet18", 64)
    runs = []
    for i, (misses, compile_s) in enumerate(((40, 60.0), (0, 3.0), (0, 2.0))):
        setup = SETUPS[i]
        runs.append(_run(f"e{i}", setup, params, 20.0))
        compiled = _run(f"c{i}", setup, params, 17.0)
        compiled.params["compile.enable"] = "True"
        compiled.metrics.update(compile_s=compile_s, compile_cache_hits=40.0 - misses, compile_cache_misses=float(misses))
        runs.append(compiled)
    job = job_of_run(runs[0])
    gain = measured_gain(runs, job, hw)
    assert (gain.compile_s, gain.compile_runs, gain.runs, gain.warm_only) == (60.0, 1, 3, False), "the cold run's alone"
    warm = measured_gain([r for r in runs if r.run_id not in ("e0", "c0")], job, hw)
    assert (warm.compile_s, warm.warm_only) == (2.5, True) and "a first compile costs more" in warm.basis
    # A run that compiled one graph of forty is a warm cache's; one whose cache was off counts nothing and compiled.
    runs[3].metrics.update(compile_cache_hits=39.0, compile_cache_misses=1.0)
    runs[5].metrics.update(compile_cache_hits=0.0, compile_cache_misses=0.0)
    assert measured_gain(runs, job, hw).compile_s == statistics.median([60.0, 2.0])
    rec = Predictor(hw, runs).recommend(job)
    rec.compile_gain = warm
    assert compile_dict(rec)["compile_s_warm_cache_only"] is True
    # Runs logged before the counts are taken to have compiled their graphs.
    for r in runs:
        r.metrics.pop("compile_cache_misses", None), r.metrics.pop("compile_cache_hits", None)
    assert measured_gain(runs, job, hw).compile_s == 3.0


def test_a_gpu_pipeline_of_more_than_two_stages_is_predicted_on_the_cut_balance_auto_finds():
    """A pipe run of more than two stages balances by profiled layer time (``balance=auto``); its
    prediction cuts the layers' predicted times the same way (the contiguous split whose slowest
    stage is fastest), so ResNet-18's slow stem gets a stage of fewer layers than even FLOPs give it.
    Without per-layer times (CPU) the FLOPs cut stands in; two stages keep the split point."""
    from ddlx.parallel.cuts import contiguous_balance
    from ddlx.predict.sequential_time import from_gpu_model
    from ddlx.strategies.parts.pipelines import default_balance

    hw = hardware(load_hw_file(CONF_DIR / "hw" / "titanrtx_4x.yaml"))
    job = Job("resnet18", "imagenet", 1000, 3, 224, 32, 1000)
    profile, seq = profile_model("resnet18", 1000, 3, 224), from_gpu_model(job, hw)
    times = [f + b for f, b in seq.layers_s(32)]
    cut = default_balance(profile, 4, seq, 32)
    assert cut == contiguous_balance(times, 4) and cut != profile.even_balance(4)
    slowest = lambda balance: max(seq.stage_s(balance, 32))  # noqa: E731
    assert slowest(cut) < slowest(profile.even_balance(4))
    assert default_balance(profile, 4, SequentialTime(0.01, 0.001, "cpu"), 32) == profile.even_balance(4)
    assert default_balance(profile, 2, seq, 32) == [profile.split_index, len(profile.layers) - profile.split_index]


def test_the_images_behind_a_training_split_are_found_as_train_py_splits_them():
    """recommend.py sizes the decoded-image cache by the whole set: the fewest images whose
    training split (at least one held out where data.val_fraction > 0) is the job's."""
    from ddlx.job import images_of_training_split, validation_images

    for images in range(1, 400):
        for fraction in (0.0, 0.05, 0.2, 0.5, 0.9):
            train = images - validation_images(images, fraction)
            if train < 1:
                continue
            found = images_of_training_split(train, fraction)
            assert found <= images and found - validation_images(found, fraction) == train, (images, fraction)
    assert images_of_training_split(8, 0.05) == 9, "8 / 0.95 rounds to 8, which holds one out and trains 7"


def test_processes_past_a_machines_devices_share_its_nodes_links():
    """A CPU job of more processes than cores (hybrid processes=2 on 2 cores: 4 'devices') was
    priced as spanning a second node, and one such run in the store stopped every answer on
    hw=local ('has 1 nodes but no inter_node link')."""
    one_node = hardware(_compose_hw("hw=cpu_2core_cluster", "hw.nodes=1", "hw.inter_node=null"))
    assert one_node.link(2, 3) == one_node.intra_node and one_node.link(0, 3) == one_node.intra_node
    two_nodes = hardware(_compose_hw("hw=cpu_2core_cluster", "hw.nodes=2"))
    assert two_nodes.link(1, 2) == two_nodes.inter_node and two_nodes.link(0, 4) == two_nodes.intra_node


def test_printed_commands_record_into_the_store_the_answer_reads_where_they_run_beside_it():
    """recommend.py paths.root=X read X's runs but printed commands that recorded into the
    project's store, so 'run these, then ask again' never counted them."""
    from dataclasses import replace as changed

    from ddlx.predict.cli import store_overrides_for

    given = ["paths.root=/tmp/mine", "logger.tracking_uri=http://tracking:5000", "logger.experiment_name=study"]
    here = changed(hardware(_compose_hw("hw=h100_1x")), detect=True)
    assert store_overrides_for(here, "http://tracking:5000", given) == given
    elsewhere = hardware(_compose_hw("hw=h100_1x"))
    assert store_overrides_for(elsewhere, "http://tracking:5000", given) == given[1:], "a server is reached from anywhere"
    assert store_overrides_for(elsewhere, "sqlite:////tmp/mine/mlflow.db", given[:1]) == [], "a path here names nothing there"
