"""Mixed and low precision (Lightning's trainer.precision) under every strategy: layers that run
in a strategy's own threads compute in the training thread's autocast, and the combinations
that cannot train correctly are refused by name before any work starts."""
from __future__ import annotations

import threading

import pytest
import torch

from ddlx.errors import ConfigError
from ddlx.models import build_model
from ddlx.parallel.pipe import PipeForward
from ddlx.parallel.threads import ThreadedForward


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


@pytest.mark.parametrize("strategy", [["strategy=cpu_mp"], ["strategy=fsdp"], ["strategy=pipe", "strategy.engine=torch"]])
def test_loss_scaling_is_refused_where_ranks_see_part_of_the_gradients(strategy, tiny_config):
    from ddlx.run import train

    cfg = tiny_config(*strategy, "trainer.precision=16-mixed")
    with pytest.raises(ConfigError, match=rf"trainer.precision=16-mixed with {strategy[0]}.*bf16-mixed"):
        train(cfg, output_dir=cfg.paths.root)
