"""The training loader with workers reads the next epoch ahead (ddlx.data.spanning) and still
gives every epoch's batches as the loader without workers does: same samples, order and flips,
whether an epoch is taken whole, cut short, asked for again, or resumed from a checkpoint."""
from __future__ import annotations

import pytest
import torch
from test_data import fire_module

from ddlx.data.datamodule import ImageFolderDataModule
from ddlx.data.spanning import SpanningBatches


def module(tmp_path, workers: int) -> ImageFolderDataModule:
    dm = fire_module(tmp_path, num_images=45, val_fraction=0.2, batch_size=8, num_workers=workers,
                     shuffle=True)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def epoch(loader, number: int, take: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What Lightning's fit loop does: set the sampler's epoch, ``iter()``, take the batches."""
    loader.batch_sampler.sampler.set_epoch(number)
    batches = []
    for batch in iter(loader):
        batches.append(batch)
        if take is not None and len(batches) == take:
            break
    return batches


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b))


@pytest.fixture
def reference(tmp_path):
    """Epochs 0-3 of the loader without workers (no reading ahead)."""
    loader = module(tmp_path, workers=0).train_dataloader()
    assert not isinstance(loader.batch_sampler, SpanningBatches)
    return [epoch(loader, n) for n in range(4)]


@pytest.fixture
def reading_ahead(tmp_path):
    """The training loader with two workers, ended after the test."""
    dm = module(tmp_path, workers=2)
    yield dm.train_dataloader()
    dm.end_workers()


def test_workers_read_the_next_epoch_ahead_and_give_the_same_batches(reading_ahead, reference):
    loader = reading_ahead
    assert isinstance(loader.batch_sampler, SpanningBatches) and len(loader) == len(reference[0]) == 5
    first = epoch(loader, 0)
    handed = loader.batch_sampler.handed
    assert handed and handed[0] == (1, 0), "after an epoch's last batch, the workers hold the next epoch's first"
    second = epoch(loader, 1)
    assert loader.batch_sampler.handed is handed, "the workers' iteration went on (a restart starts a new one)"
    assert same(first, reference[0]) and same(second, reference[1])
    assert not same(first, second), "shuffled: each epoch its own order"


def test_an_epoch_cut_short_or_asked_again_starts_where_a_plain_loader_would(reading_ahead, reference):
    loader = reading_ahead
    assert same(epoch(loader, 0, take=2), reference[0][:2])  # limit_train_batches=2
    assert same(epoch(loader, 1), reference[1]), "the next epoch from its first batch"
    assert same(epoch(loader, 1, take=1), reference[1][:1]), "the same epoch again: from its start"
    assert same(epoch(loader, 3), reference[3]), "an epoch further on"


def test_a_resumed_loader_goes_on_after_the_batches_trained(reading_ahead, reference):
    loader = reading_ahead
    loader.load_state_dict({"epoch": 2, "batches_done": 3})
    assert same(list(iter(loader)), reference[2][3:]), "the rest of the stopped epoch"
    handed = loader.batch_sampler.handed
    assert same(epoch(loader, 3), reference[3]) and loader.batch_sampler.handed is handed, "then the next, read ahead"
    assert same(epoch(loader, 1), reference[1])
    loader.load_state_dict({"epoch": 2, "batches_done": 3})  # after a whole epoch 1: epoch 2 was read ahead
    assert same(epoch(loader, 2), reference[2][3:]), "the checkpoint's position, not the epoch read ahead"


def test_each_rank_reads_ahead_its_share_of_the_global_batches(tmp_path):
    from types import SimpleNamespace

    shares = {}
    for workers in (0, 2):
        dm = module(tmp_path, workers)
        dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1}))
        loader = dm.train_dataloader()
        shares[workers] = [epoch(loader, n) for n in range(3)]
        dm.end_workers()
    assert isinstance(loader.batch_sampler, SpanningBatches)
    assert all(same(a, b) for a, b in zip(*shares.values())) and len(shares[0][0]) == 3, "rank 1 of 2: 18 of 36 images"


def test_loaders_that_do_not_read_ahead_and_one_replaced(tmp_path):
    from types import SimpleNamespace

    from pytorch_lightning.trainer.connectors.data_connector import _resolve_overfit_batches
    from pytorch_lightning.trainer.states import RunningStage
    from pytorch_lightning.utilities.combined_loader import CombinedLoader

    dm = module(tmp_path, workers=2)
    dm.trainer = SimpleNamespace(overfit_batches=2, strategy=None)
    overfit = dm.train_dataloader()
    assert not isinstance(overfit.batch_sampler, SpanningBatches), "overfit_batches: each epoch stops after its batches"
    for made, stage in ((overfit, RunningStage.TRAINING), (dm.val_dataloader(), RunningStage.VALIDATING)):
        combined = CombinedLoader([made])
        _resolve_overfit_batches(combined, stage)
        assert combined.flattened == [made], f"Lightning swapped the {stage.value} loader's sampler (its own cannot resume or shard)"
    drawn = []
    for number in (0, 1):
        overfit.batch_sampler.sampler.set_epoch(number)
        drawn.append([[index for index, _ in batch] for batch in overfit.batch_sampler])
    assert drawn[0] == drawn[1] == [list(range(8 * b, min(8 * b + 8, 36))) for b in range(5)], \
        "overfit_batches: the same images every epoch, in order (their flips by epoch, as configured)"
    dm.trainer = None
    first = dm.train_dataloader()
    epoch(first, 0)
    assert first._iterator is not None
    second = dm.train_dataloader()  # reload_dataloaders_every_n_epochs
    assert first._iterator is None, "the replaced loader's workers ended, with what they had read ahead"
    assert len(epoch(second, 0)) == 5
    dm.end_workers()


@pytest.mark.integration
def test_a_run_whose_workers_read_ahead_ends_with_the_weights_of_one_without_workers(tiny_config, tmp_path, monkeypatch):
    """Whole epochs through Lightning's loop (its first iter() before set_epoch, validation
    between epochs): the workers' iteration is never restarted after the first epoch, and the
    weights after three epochs are those of a run without workers."""
    from test_runs import FULL, _weights
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    from ddlx.run import train

    restarts, reset = [], _MultiProcessingDataLoaderIter._reset

    def counted(self, loader, first_iter=False):
        restarts.append((type(loader).__name__, first_iter))
        return reset(self, loader, first_iter)

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_reset", counted)
    job = ["model=alexnet", "trainer.max_epochs=3", "trainer.limit_train_batches=1.0", "data.shuffle=true", *FULL]
    for workers in (0, 2):
        train(tiny_config(*job, f"data.num_workers={workers}"), tmp_path / f"workers{workers}")
    training = [first for name, first in restarts if name == "ResumableLoader"]
    assert training == [True], "the training loader's workers started once and were never restarted"
    plain, ahead = (_weights(tmp_path / f"workers{w}" / "checkpoints" / "last.ckpt") for w in (0, 2))
    for name, value in plain.items():
        assert torch.equal(value, ahead[name]), name
