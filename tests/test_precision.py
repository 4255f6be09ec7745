"""Mixed and low precision (Lightning's trainer.precision) under every strategy: layers that run
in a strategy's own threads compute in the training thread's autocast, and the combinations
that cannot train correctly are refused by name before any work starts."""
from __future__ import annotations

import threading

import pytest
import torch

from ddlx.errors import ConfigError
from ddlx.models import build_model
from ddlx.parallel.fairscale_pipe import PipeForward
from ddlx.parallel.sub_batch_threads import ThreadedForward


def _forward(kind: str, model):
    model.sequential_forward = torch.nn.Sequential.forward.__get__(model)
    if kind == "threads":
        return ThreadedForward(model, 2)
    half = len(model) // 2
    return PipeForward(model, [half, len(model) - half], [torch.device("cpu")] * 2, chunks=2, checkpoint="always")


@pytest.mark.parametrize("kind", ["threads", "pipe"])
def test_layers_in_a_strategys_threads_compute_in_the_training_threads_autocast(kind):
    """Autocast is per thread: without carrying it, sub-batch threads and fairscale's workers
    would train a bf16-mixed run in fp32 (and the run would say bf16-mixed)."""
    torch.manual_seed(0)
    model = build_model("alexnet", 3, 3, 32)
    conv = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)][-1]
    seen = []
    conv.register_forward_hook(lambda m, i, out: seen.append((threading.current_thread().name, out.dtype)))
    forward = _forward(kind, model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(torch.randn(4, 3, 32, 32))
        out.float().sum().backward()  # fairscale's checkpoint recomputes the forward in its worker
        assert seen and all(dtype == torch.bfloat16 for _, dtype in seen), seen
        assert any(name != threading.current_thread().name for name, _ in seen), "ran in the strategy's threads"
        assert len(seen) == (2 if kind == "threads" else 4), seen  # 2 sub-batches; 2 micro-batches, each recomputed
        seen.clear()
        forward(torch.randn(4, 3, 32, 32))
        assert {dtype for _, dtype in seen} == {torch.float32}, "outside autocast: the model's own format"
    finally:
        forward.close()


@pytest.mark.integration
def test_16_mixed_on_cpu_is_refused_as_lightning_would_train_bf16(tiny_config):
    """Lightning trains 16-mixed on CPU as bf16-mixed, with a warning: the run would be recorded as
    16-mixed and calibrate the recommender's fp16 figures. Refused before any work, naming the fix."""
    from ddlx.run import train

    cfg = tiny_config("strategy=sequential", "trainer.precision=16")
    with pytest.raises(ConfigError, match=r"trainer.precision=16 with strategy=sequential: on CPU Lightning trains "
                                          r"16-mixed as bf16-mixed.*trainer.precision=bf16-mixed"):
        train(cfg, output_dir=cfg.paths.root)


@pytest.mark.integration
def test_sync_batchnorm_on_cpu_is_refused_before_any_work(tiny_config):
    """torch's SyncBatchNorm raises a ValueError at the first step on CPU (a traceback, after the
    data was prepared and the run opened): refused up front, naming the fix."""
    from ddlx.run import train

    cfg = tiny_config("strategy=ddp_gloo", "strategy.processes=2", "model=resnet18", "trainer.sync_batchnorm=true")
    with pytest.raises(ConfigError, match=r"trainer.sync_batchnorm=true: .*CUDA.*trainer.sync_batchnorm=false"):
        train(cfg, output_dir=cfg.paths.root)


@pytest.mark.parametrize("overrides,said", [
    (["trainer.precision=16"], r"^trainer.precision=16 with strategy=sequential: on CPU Lightning trains 16-mixed as bf16-mixed"),
    (["strategy=ddp_gloo", "trainer.sync_batchnorm=true"], r"^trainer.sync_batchnorm=true: [^;]*; set trainer.sync_batchnorm=false$"),
])
def test_what_a_cpu_cannot_train_in_is_refused_before_torch_loads(monkeypatch, overrides, said):
    """Said 6 s in, after torch, Lightning and the model, where the machine already tells it."""
    from conftest import compose_config

    from ddlx.config_check import typed_config
    from ddlx.preflight import check_before_torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a machine without a GPU, whichever runs the test
    with pytest.raises(ConfigError, match=said):
        check_before_torch(typed_config(compose_config(overrides)))


@pytest.mark.parametrize("overrides,refused", [
    (["strategy=split", "trainer.precision=16-mixed"], False),  # trainer=default, but split takes the GPUs it finds
    (["strategy=pipe", "trainer.precision=16-mixed"], False),
    (["strategy=hybrid", "trainer.sync_batchnorm=true"], False),
    (["strategy=fsdp", "trainer=gpu", "trainer.precision=16-mixed"], True),  # the strategy's own, on any device
])
def test_a_machine_with_gpus_is_not_taken_for_a_cpu_before_the_plan_says_where_the_job_runs(monkeypatch, overrides, refused):
    """The check before torch refused jobs whose plan puts them on the GPUs (16-mixed 'on CPU')."""
    from conftest import compose_config

    from ddlx import preflight
    from ddlx.config_check import typed_config

    monkeypatch.setattr(preflight, "gpu_may_be_present", lambda: True)
    problems = preflight.machine_problems(typed_config(compose_config(overrides)))
    assert bool(problems) == refused, problems
    assert not any("CPU" in problem for problem in problems)


@pytest.mark.parametrize("strategy, refuses", [(["strategy=cpu_mp"], True), (["strategy=fsdp"], True),
                                               (["strategy=pipe", "strategy.engine=torch"], True),
                                               (["strategy=pipe"], False), (["strategy=ddp_gloo"], False)])
def test_loss_scaling_is_refused_where_ranks_see_part_of_the_gradients(strategy, refuses):
    """(On GPUs: on CPU every strategy refuses 16-mixed, above.)"""
    from conftest import compose_config

    from ddlx.run import layered_model_meta
    from ddlx.strategies import build_strategy

    cfg = compose_config([*strategy, "data.image_size=32"])
    plan = build_strategy(cfg.strategy, cfg.trainer.accelerator, layered_model_meta(cfg), cfg.data)
    why = plan.refused_precisions.get("16-mixed")
    assert (why is not None) == refuses
    assert why is None or "use trainer.precision=bf16-mixed" in why
