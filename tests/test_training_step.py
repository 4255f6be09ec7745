"""A training step never makes the host wait for the device.

On a GPU, an operation whose result the host must read (an ``.item()``, the length of a
``torch.unique``, a boolean mask's selection) stops the host until every kernel queued before it
has run: the next kernels are issued only then, and the GPU idles for the host's share of every
step. That share grows as the GPU's shrinks (a compiled step on an H200 took 23 ms, docs/compile.md),
so a read added to the loss, the metrics or a callback costs most where ddlx should be fastest.
The check runs on CPU tensors: it records the operations that cannot know their result's size or
value without the device, from each batch's start to its end.
"""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddlx import run as run_module
from ddlx.run import train

aten = torch.ops.aten
# Operations whose output's size or value the host needs before it can go on (on a GPU: a sync).
HOST_READS = {aten._local_scalar_dense.default, aten._unique2.default, aten.unique_dim.default,
              aten.unique_consecutive.default, aten.nonzero.default, aten.masked_select.default,
              aten.bincount.default, aten.is_nonzero.default, aten.equal.default}


class HostReads(TorchDispatchMode):
    """The operations of :data:`HOST_READS` called while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if func in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class Recording(pl.Callback):
    def __init__(self, mode: HostReads) -> None:
        self.mode = mode


class Start(Recording):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.mode.__enter__()


class End(Recording):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.mode.__exit__(None, None, None)


def around(callbacks: list[pl.Callback], mode: HostReads) -> list[pl.Callback]:
    """``callbacks`` with the recording on from after the first (ddlx's timer, which run.train
    reads as the first) to after the last."""
    return [callbacks[0], Start(mode), *callbacks[1:], End(mode)]


@pytest.mark.integration
def test_a_training_step_reads_nothing_back_from_the_device(tiny_config, tmp_path, monkeypatch):
    """ddlx's own training path: its module (loss, accuracy, logging), Lightning's loop, the
    optimizer step and ddlx's measuring callbacks, between the first one's batch start and the last
    one's batch end."""
    mode = HostReads()
    measured = run_module.measurement_callbacks
    monkeypatch.setattr(run_module, "measurement_callbacks", lambda cfg: around(measured(cfg), mode))
    train(tiny_config("trainer.max_epochs=2", "measure.monitor=true"), tmp_path / "run")
    assert mode.calls > 0
    assert mode.seen == []


class Losses(pl.Callback):
    """Each training step's loss and batch size, as the step returned it."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.seen.append((float(outputs["loss"]), len(batch[1])))


@pytest.mark.integration
def test_the_epoch_s_loss_is_its_steps_mean_weighted_by_batch_size(tmp_path):
    """What the module logs once an epoch is what Lightning's per-step logging gave: the mean of
    the steps' losses weighted by their batch sizes (the last batch is smaller), and the accuracy
    over every sample of the epoch."""
    from torch.utils.data import DataLoader, TensorDataset

    from ddlx.models import build_model
    from ddlx.module import ClassifierModule

    torch.manual_seed(0)
    images, labels = torch.randn(10, 3, 32, 32), torch.randint(0, 3, (10,))
    losses = Losses()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
                         default_root_dir=tmp_path)
    module = ClassifierModule(build_model("alexnet", 3, 3, 32, 0.0), 3, lr=0.0)  # lr 0: the weights stay as they are
    trainer.fit(module, DataLoader(TensorDataset(images, labels), batch_size=4))
    assert [n for _, n in losses.seen] == [4, 4, 2]
    want = sum(loss * n for loss, n in losses.seen) / 10
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(want, rel=1e-5)
    with torch.no_grad():
        correct = (module(images).argmax(1) == labels).float().mean()
    assert float(trainer.callback_metrics["train_acc"]) == pytest.approx(float(correct), rel=1e-5)
