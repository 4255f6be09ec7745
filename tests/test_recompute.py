"""Activation checkpointing at the model's cut points (strategy.checkpoint=always): the same
gradients and BatchNorm statistics as keeping every activation, fewer bytes kept for backward,
and the recommender's time and memory models of it."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import CONF_DIR

from ddlx.job import Job
from ddlx.models import build_model
from ddlx.parallel.recompute import recompute_at_cut_points
from ddlx.predict.cli import hardware, load_hw_file
from ddlx.costmodel.profile import profile_model
from ddlx.predict.setups import SequentialTime, candidates, memory_need, model_cost
from ddlx.strategies import STRATEGIES


def _step(model, x, y) -> int:
    """One forward and backward; the activation bytes autograd kept for it (weights left out)."""
    weights = {p.data_ptr() for p in model.parameters()}
    kept = [0]

    def pack(t):
        if t.data_ptr() not in weights:
            kept[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return kept[0]


@pytest.mark.parametrize("arch", ["alexnet", "resnet18", "mobilenet_v2"])
def test_recomputed_blocks_give_the_same_gradients_and_statistics_from_fewer_kept_bytes(arch):
    torch.manual_seed(0)
    plain = build_model(arch, 3, 3, 64)
    recomputed = copy.deepcopy(plain)
    recompute_at_cut_points(recomputed)
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([0, 1, 2, 0])
    torch.manual_seed(1)  # dropout: the recomputation replays the forward's draws
    kept_plain = _step(plain, x, y)
    torch.manual_seed(1)
    kept_recomputed = _step(recomputed, x, y)
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    for (name, a), b in zip(plain.named_buffers(), recomputed.buffers()):
        assert torch.equal(a, b), f"{name}: BatchNorm statistics updated once, not again by the recomputation"
    assert kept_recomputed < kept_plain / 3, (kept_recomputed, kept_plain)
    with torch.no_grad():
        assert torch.equal(recomputed.eval()(x), plain.eval()(x)), "evaluation runs the layers as they are"


def test_the_memory_model_keeps_block_inputs_and_one_block():
    profile = profile_model("vgg11", 2, 3, 64)
    cuts = sorted(index for _, index in profile.cut_points)
    edges = [0, *cuts, len(profile.layers)]
    blocks = list(zip(edges[:-1], edges[1:]))
    inputs = profile.input_bytes + sum(profile.layers[a - 1].output_bytes for a, _ in blocks[1:])
    largest = max(sum(layer.activation_bytes for layer in profile.layers[a:b]) for a, b in blocks)
    assert profile.kept_bytes(recompute=True) == inputs + largest < profile.kept_bytes()
    assert profile.kept_bytes() == profile.activation_bytes_per_sample


def _hw(name: str):
    return hardware(load_hw_file(CONF_DIR / "hw" / f"{name}.yaml"))


GPUS = ("cuda:0", "cuda:1", "cuda:2", "cuda:3")


@pytest.mark.parametrize("setup, forwards", [
    (STRATEGIES["ddp_nccl"].setup(processes=4), 1), (STRATEGIES["fsdp"].setup(processes=4, sharding="full"), 1),
    (STRATEGIES["pipe"].setup(chunks=8, devices=GPUS, engine="torch", schedule="1f1b"), 1),
    # ZB-V's input and weight gradients are two backward passes, each recomputing the block.
    (STRATEGIES["pipe"].setup(chunks=8, devices=GPUS, engine="torch", schedule="zero_bubble"), 2)])
def test_recomputing_costs_a_forward_and_saves_activation_memory(setup, forwards):
    hw, job = _hw("titanrtx_4x"), Job("resnet152", "highres", 1000, 3, 512, 128, 60000)
    profile = profile_model("resnet152", 1000, 3, 512)
    seq = SequentialTime(per_sample_s=0.01, weight_s=0.0, basis="given")
    again = STRATEGIES[setup.strategy].with_knobs(setup, checkpoint="always")
    plain_cost, again_cost = model_cost(setup, job, hw, profile, seq), model_cost(again, job, hw, profile, seq)
    assert again_cost.compute_s == pytest.approx(plain_cost.compute_s * (1 + forwards / 3), rel=0.02), "a forward: +1/3"
    assert memory_need(again, job, hw, profile).per_device_gb < 0.6 * memory_need(setup, job, hw, profile).per_device_gb


def test_data_parallel_candidates_include_recomputation_and_the_thesis_case_fits_with_it():
    """ResNet-152 on Highres, 32 per GPU on the Titan RTX (Jansen's thesis): DDP keeping every
    activation does not fit; recomputing at the cut points it does, a forward slower."""
    from ddlx.predict.prediction import Predictor

    hw, job = _hw("titanrtx_4x"), Job("resnet152", "highres", 1000, 3, 512, 128, 60000)
    labels = {s.label for s in candidates(hw, job)}
    assert {"ddp_nccl processes=4 checkpoint=always", "fsdp processes=4 sharding=full checkpoint=always"} <= labels
    rec = Predictor(hw, []).recommend(job, [STRATEGIES["ddp_nccl"].setup(processes=4),
                                            STRATEGIES["ddp_nccl"].setup(processes=4, checkpoint="always")])
    by_label = {p.setup.label: p for p in rec.predictions}
    plain, again = by_label["ddp_nccl processes=4"], by_label["ddp_nccl processes=4 checkpoint=always"]
    assert not plain.memory.fits and again.memory.fits and rec.best is again
