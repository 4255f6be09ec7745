"""cpu_mp's one copy of the weights (ddlx.parallel.shared_memory): ranks as threads of this process,
each with its own model object on the same shared buffer, against one optimizer on the whole batch."""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from ddlx.parallel.shared_memory import SharedWeights


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _groups(net, optimizer_class):
    """Two parameter groups with their own hyperparameters: the slices must follow them."""
    first, second = list(net[0].parameters()), list(net[2].parameters())
    if optimizer_class is torch.optim.SGD:
        return torch.optim.SGD([{"params": first, "weight_decay": 0.01}, {"params": second, "lr": 0.05}], lr=0.1, momentum=0.9)
    return optimizer_class([{"params": first}, {"params": second, "lr": 0.002}], lr=0.01)


def _batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(steps)]


def _loss(net, x, y):
    return torch.nn.functional.cross_entropy(net(x), y)


def _ranks(world: int, work):
    """Run ``work(rank, barrier, broadcast)`` on ``world`` threads; the shared file's name is rank 0's."""
    barrier, names, errors = threading.Barrier(world), [None], []

    def broadcast(name):
        if name is not None:
            names[0] = name
        barrier.wait()
        return names[0]

    def run(rank):
        try:
            work(rank, barrier.wait, broadcast)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_slices_step_as_one_optimizer_on_the_whole_batch_and_resume(optimizer_class, world):
    steps = 3
    reference = _net()
    ref_opt = _groups(reference, optimizer_class)
    for x, y in _batches(steps + 1):
        ref_opt.zero_grad()
        _loss(reference, x, y).backward()
        ref_opt.step()

    saved, after = {}, {}
    nets = [_net() for _ in range(world)]  # here: seeding in the threads would race

    def work(rank, barrier, broadcast):
        net = nets[rank]
        opt = _groups(net, optimizer_class)
        shared = SharedWeights(list(net.parameters()), rank, world, barrier, broadcast)
        batches = _batches(steps + 1)
        for x, y in batches[:steps]:
            opt.zero_grad()
            _loss(net, x[rank::world], y[rank::world]).backward()
            shared.reduce()
            shared.step(opt)
        slices = saved.setdefault("slices", [None] * world)
        slices[rank] = shared.slice_state()
        barrier()
        if rank == 0:
            saved["doc"] = shared.full_state(opt, slices)
        barrier()
        # Resume from the gathered state into fresh optimizers over the same shared weights.
        again = _groups(net, optimizer_class)
        resumed = SharedWeights.__new__(SharedWeights)
        resumed.__dict__.update(shared.__dict__ | {"_optimizer": None, "_pieces": [], "_views": []})  # a fresh process
        resumed.load_state(again, copy.deepcopy(saved["doc"]))
        x, y = batches[steps]
        again.zero_grad()
        _loss(net, x[rank::world], y[rank::world]).backward()
        resumed.reduce()
        resumed.step(again)
        if rank == 0:
            after.update({k: v.detach().clone() for k, v in net.state_dict().items()})

    _ranks(world, work)
    for key, want in reference.state_dict().items():
        torch.testing.assert_close(after[key], want, rtol=1e-5, atol=1e-6, msg=key)
    # The checkpoint holds the state the whole-model optimizer would hold (before its last step).
    doc = saved["doc"]
    assert len(doc["param_groups"]) == 2 and len(doc["state"]) == 4
    assert doc["param_groups"][0].get("weight_decay", 0) == (0.01 if optimizer_class is torch.optim.SGD else doc["param_groups"][0]["weight_decay"])
    for state in doc["state"].values():
        assert all(not torch.is_tensor(v) or v.dim() == 0 or v.shape[0] in (5, 3) for v in state.values())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_one_buffer_in_the_models_format(dtype):
    """Lightning's 64-true and bf16-true convert the model before the ranks share it: the shared
    buffer takes the model's format, and the slices step as one optimizer in it."""
    steps, world = 2, 2
    reference = _net().to(dtype)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(steps):
        ref_opt.zero_grad()
        _loss(reference, x.to(dtype), y).backward()
        ref_opt.step()
    nets, after = [_net().to(dtype) for _ in range(world)], {}

    def work(rank, barrier, broadcast):
        net = nets[rank]
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        shared = SharedWeights(list(net.parameters()), rank, world, barrier, broadcast)
        for x, y in _batches(steps):
            opt.zero_grad()
            _loss(net, x[rank::world].to(dtype), y[rank::world]).backward()
            shared.reduce()
            shared.step(opt)
        if rank == 0:
            after.update({k: v.detach().clone() for k, v in net.state_dict().items()})

    _ranks(world, work)
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 2e-2}
    for key, want in reference.state_dict().items():
        assert after[key].dtype == dtype, key
        torch.testing.assert_close(after[key], want, **tolerance, msg=key)
