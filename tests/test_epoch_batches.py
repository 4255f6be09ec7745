"""The trainer.* values Lightning refuses only once training starts (a share of an epoch under one
batch, a validation interval past the epoch's end) are named before a run opens: each case is
refused exactly where Lightning's own fit refuses it."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddlx.config import TrainerConfig
from ddlx.epoch_batches import process_batches, trainer_batch_problems
from ddlx.errors import ConfigError
from conftest import runs

TRAIN, VAL = 4, 1  # batches an epoch


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch, _):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, _):
        self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def lightning_refuses(**kwargs) -> bool:
    def loader(batches):
        return DataLoader(TensorDataset(torch.randn(batches * 2, 2)), batch_size=2)

    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **kwargs)
    try:
        trainer.fit(Tiny(), loader(TRAIN), loader(VAL))
    except (ValueError, pl.utilities.exceptions.MisconfigurationException):
        return True
    return False


@pytest.mark.parametrize("kwargs", [
    {"limit_train_batches": 0.1}, {"limit_train_batches": 0.25}, {"limit_train_batches": 2},
    {"limit_val_batches": 0.5}, {"limit_val_batches": 1.0}, {"overfit_batches": 0.1}, {"overfit_batches": 1},
    {"val_check_interval": 5}, {"val_check_interval": 4}, {"val_check_interval": 3, "limit_train_batches": 2},
    {"val_check_interval": 5, "check_val_every_n_epoch": None}, {"val_check_interval": 5, "limit_val_batches": 0},
    {"val_check_interval": 0.1}, {"fast_dev_run": True, "limit_train_batches": 0.1},
], ids=str)
def test_refused_before_the_run_exactly_where_lightning_refuses_at_its_start(kwargs):
    trainer = TrainerConfig(**kwargs)
    assert bool(trainer_batch_problems(trainer, TRAIN, VAL)) == lightning_refuses(**kwargs)


def test_each_problem_names_its_key_and_a_value_that_works():
    (share,) = trainer_batch_problems(TrainerConfig(limit_train_batches=0.1), TRAIN, VAL)
    assert "trainer.limit_train_batches=0.1 of the 4 train batch(es)" in share and "at least trainer.limit_train_batches=0.25" in share
    (interval,) = trainer_batch_problems(TrainerConfig(val_check_interval=10), TRAIN, VAL)
    assert "trainer.val_check_interval=10 batches, but an epoch trains 4" in interval and "use at most 4" in interval
    assert process_batches(10, 2, 2) == 3 and process_batches(9, 1, 4) == 3


@pytest.mark.integration
def test_train_refuses_it_before_a_run_is_opened(tiny_config, tracking_uri, tmp_path):
    from ddlx.run import train

    with pytest.raises(ConfigError, match=r"trainer.val_check_interval=10 batches, but an epoch trains 2"):
        train(tiny_config("trainer.val_check_interval=10"), output_dir=tmp_path / "run")
    assert runs(tracking_uri) == [], "refused before a run was opened"
