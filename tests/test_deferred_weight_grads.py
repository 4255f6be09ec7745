"""A pipeline stage's Linear weight gradients computed once after its micro-batches: the same
gradients as autograd's per micro-batch, with recomputation and under bf16 autocast too, and
the layers' own forward back after close."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ddlx.models import build_model
from ddlx.parallel.deferred_weight_grads import DeferredWeightGrads
from ddlx.parallel.recompute import recompute_at_cut_points


def _micro_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int, precision: str) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            (nn.functional.cross_entropy(model(xs), ys) / chunks).backward()


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deferred_weight_grads_equal_autograds_per_micro_batch(recompute, precision):
    torch.manual_seed(0)
    plain = build_model("alexnet", 3, 3, 64).eval()  # eval: no dropout draws to replay
    deferred_model = copy.deepcopy(plain)
    if recompute:  # after the copy: it replaces forwards with closures over the modules
        recompute_at_cut_points(plain)
        recompute_at_cut_points(deferred_model)
    x, y = torch.randn(8, 3, 64, 64), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    _micro_steps(plain, x, y, 4, precision)
    deferred = DeferredWeightGrads([deferred_model])
    assert len(deferred.layers) == 3  # AlexNet's classifier
    _micro_steps(deferred_model, x, y, 4, precision)
    assert all(layer.weight.grad is None for layer in deferred.layers), "weight gradients wait for flush"
    deferred.flush()
    tol = dict(rtol=1e-4, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=1e-3)
    for (name, a), b in zip(plain.named_parameters(), deferred_model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name, **tol)

    deferred.close()
    assert all("forward" not in layer.__dict__ for layer in deferred.layers)
    with torch.no_grad():
        assert torch.equal(deferred_model(x), plain(x))


def test_a_second_flush_adds_nothing_and_gradients_accumulate_as_autograds():
    torch.manual_seed(0)
    layer = nn.Linear(5, 4)
    reference = copy.deepcopy(layer)
    deferred = DeferredWeightGrads([layer])
    x = torch.randn(6, 5)
    for _ in range(2):  # two batches into one .grad (gradient accumulation)
        layer(x).sum().backward()
        deferred.flush()
        deferred.flush()
        reference(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)


def test_profiling_for_a_balance_with_deferred_weight_grads_times_every_layer_and_leaves_the_model_alone():
    from ddlx.parallel.balance import layer_times

    model = build_model("alexnet", 3, 3, 32)
    times = layer_times(model, torch.randn(2, 3, 32, 32), rounds=1, deferred_of=4)
    assert len(times) == len(model) and all(t > 0 for t in times)
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))
    assert all(p.grad is None for p in model.parameters()), "the profile runs on a copy"


def test_a_frozen_bias_gets_no_gradient():
    layer = nn.Linear(5, 4)
    layer.bias.requires_grad_(False)
    deferred = DeferredWeightGrads([layer])
    layer(torch.randn(3, 5)).sum().backward()
    deferred.flush()
    assert layer.weight.grad is not None and layer.bias.grad is None


class _UsedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


def test_a_flush_drops_only_the_passes_before_the_micro_batches_a_layer_used_twice_keeps_both_uses():
    torch.manual_seed(0)
    model = nn.Sequential(_UsedTwice(), nn.Linear(6, 3))
    reference = copy.deepcopy(model)
    deferred = DeferredWeightGrads([model])
    model(torch.randn(5, 6)).sum().backward()  # made-up inputs before the step, as PyTorch's stage runs them
    with torch.no_grad():  # a validation forward between: not a pass of the step
        model(torch.randn(5, 6))
    x = torch.randn(8, 6)
    for xs in x.chunk(4):
        model(xs).sum().backward()
        reference(xs).sum().backward()
    deferred.flush(micro_batches=4)
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
