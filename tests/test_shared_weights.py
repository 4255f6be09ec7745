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


# ---- layers split by rows between the ranks (ddlx.parallel.split_linear), in real processes -------


def _split_net() -> torch.nn.Module:
    """Output widths that do not divide by 3 ranks: the last rank's block is short; in-place ReLUs
    after the split layers, as AlexNet's."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(inplace=True), torch.nn.Linear(10, 5),
                               torch.nn.ReLU(inplace=True), torch.nn.Linear(5, 3))


def _split_rank(rank: int, world: int, port: int, folder: str, halves: tuple[slice, slice]) -> None:
    import os

    import torch.distributed as dist

    from ddlx.parallel.split_linear import RowSplitLinear

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    net = _split_net()
    opt = torch.optim.Adam([{"params": list(net[0].parameters()) + list(net[4].parameters())},
                            {"params": list(net[2].parameters()), "lr": 0.002}], lr=0.01)
    split = [RowSplitLinear(net[i], rank, world) for i in (0, 2)]
    net[0], net[2] = split
    owned = {p: rows for layer in split for p, rows in layer.owned_rows().items()}
    shared = SharedWeights(list(net.parameters()), rank, world, dist.barrier, _broadcast, owned_rows=owned)
    for layer in split:
        layer.rows = [shared.rows(p) for p in layer.owned_rows()]
    for x, y in _batches(3):
        opt.zero_grad()
        for half in halves:  # two backward passes, one step: accumulated gradients
            _loss(net, x[half][rank::world], y[half][rank::world]).div(2).backward()
        assert all(p.grad is None for layer in split for p in layer.owned_rows()), "the split rows' leaves take the gradient"
        shared.reduce()
        shared.step(opt)
    slices = [None] * world
    dist.all_gather_object(slices, shared.slice_state())
    if rank == 0:
        torch.save({"weights": net.state_dict(), "optimizer": shared.full_state(opt, slices)}, f"{folder}/rank0.pt")
    dist.destroy_process_group()
    # As ddlx's own ranks end (ddlx.rank_worker): the interpreter's exit raced gloo's threads now and
    # then ("terminate called without an active exception", SIGABRT; 2 of about 60 cases here).
    os._exit(0)


def _broadcast(name):
    import torch.distributed as dist

    holder = [name]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


@pytest.mark.integration
@pytest.mark.parametrize("world,per_rank", [(2, 3), (3, 2), (2, 1)])
def test_split_rows_step_as_one_optimizer_on_the_whole_batch(world, per_rank, tmp_path):
    """Each rank computes its block of rows of the split layers for the whole batch and steps
    them, the rest data parallel: the weights and the gathered optimizer state are those of one
    optimizer on the whole batch, with uneven blocks (10 and 5 rows over 3 ranks), two parameter
    groups, gradients accumulated over two backward passes, and one sample a rank."""
    import socket

    import torch.multiprocessing as mp

    reference = _split_net()
    ref_opt = torch.optim.Adam([{"params": list(reference[0].parameters()) + list(reference[4].parameters())},
                                {"params": list(reference[2].parameters()), "lr": 0.002}], lr=0.01)
    batch = world * per_rank
    halves = (slice(0, batch), slice(batch, 2 * batch))
    for x, y in _batches(3):
        ref_opt.zero_grad()
        for half in halves:
            _loss(reference, x[half], y[half]).div(2).backward()
        ref_opt.step()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_split_rank, args=(world, port, str(tmp_path), halves), nprocs=world)
    saved = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for key, want in reference.state_dict().items():
        torch.testing.assert_close(saved["weights"][key], want, rtol=1e-5, atol=1e-6, msg=key)
    want_state = ref_opt.state_dict()["state"]
    for index, state in saved["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[name], want_state[index][name], rtol=1e-5, atol=1e-7, msg=f"{index} {name}")


def test_which_fully_connected_layers_are_split():
    """AlexNet's and VGG's two wide classifier layers, ResNet's 2048x1000 head; never a narrow
    output layer (3 classes), and nothing for one rank."""
    from ddlx.models import build_model
    from ddlx.parallel.split_linear import worth_splitting

    def split(arch, size=224, batch=32, world=2, classes=3):
        net = build_model(arch, classes, 3, size)
        return [(m.in_features, m.out_features) for m in net.modules()
                if isinstance(m, torch.nn.Linear) and worth_splitting(m.in_features, m.out_features, batch, world)]

    assert split("alexnet") == [(9216, 4096), (4096, 4096)]
    assert split("vgg11") == [(25088, 4096), (4096, 4096)]
    assert split("resnet50", 128, classes=1000) == [(2048, 1000)]
    assert split("alexnet", world=1) == []
    assert split("alexnet", batch=2048) == [(9216, 4096)], "a batch half as wide as a layer: its activations outweigh it"
