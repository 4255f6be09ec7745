"""The LightningModule: loss, optimizer, metrics. No strategy logic lives here."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from .compiling import optimizer_flags


def _summed_states(metric) -> dict:
    """``metric``'s states summed over every rank, as its compute() adds them (this rank's alone
    outside torch.distributed), and whether any rank added anything (``_updates``: its counts and
    weights are sums, all 0 until then)."""
    with metric.sync_context(should_sync=True, should_unsync=True):
        states = {state: getattr(metric, state).detach().cpu().clone() for state in metric._defaults}
    states["_updates"] = any(bool(value.any()) for value in states.values())
    return states


class ClassifierModule(pl.LightningModule):
    """Cross-entropy classification with SGD (Lerat et al. 2022, section 3.2: lr 0.001, momentum 0.9)."""

    def __init__(self, model: nn.Module, num_classes: int, lr: float = 0.001, momentum: float = 0.9, weight_decay: float = 0.0,
                 implementation: str = "auto", channels_last: bool = False) -> None:
        super().__init__()
        self.model = model
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.implementation = implementation  # the optimizer step's (ddlx.compiling.optimizer_flags)
        self.channels_last = channels_last  # images handed to the model NHWC, as its weights are
        self.loss = nn.CrossEntropyLoss()
        # The epoch's loss and accuracy build up on the device and are logged once, at the epoch's
        # end: a self.log a step cost the host more than the rest of Lightning's step, which shows
        # once a GPU step is short (docs/compile.md). No NaN check: it reads a value back each step.
        self.train_loss, self.val_loss = MeanMetric(nan_strategy="disable"), MeanMetric(nan_strategy="disable")
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.diverged: tuple[int, float] | None = None  # (the first epoch whose train_loss was not finite, that loss)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.model(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = self.loss(logits, labels)
        self._add(self.train_loss, self.train_acc, loss.detach(), logits, labels)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self._add(self.val_loss, self.val_acc, self.loss(logits, labels), logits, labels)

    def on_train_epoch_end(self) -> None:
        loss = self._log_epoch("train", self.train_loss, self.train_acc)
        if loss is not None and not torch.isfinite(loss) and self.diverged is None:
            # The weights diverged (their logits overflow): every further epoch would train nothing.
            # The loss is the same on every rank (gathered), so all of them stop at this epoch's end.
            self.diverged = (self.current_epoch + 1, float(loss))
            self.trainer.should_stop = True

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val", self.val_loss, self.val_acc)

    @staticmethod
    def _add(loss_mean: MeanMetric, accuracy: MulticlassAccuracy, loss: torch.Tensor, logits: torch.Tensor,
             labels: torch.Tensor) -> None:
        # The batch's loss once per sample, so that the epoch's mean weighs each batch by its size
        # as Lightning's did (torchmetrics ignores a weight when its NaN check is off; a number
        # from the host would be copied to the device, and that copy waits for the device).
        # On the metrics' device: a pipeline's last stage may hold the logits on another one.
        loss_mean.update(loss.to(loss_mean.mean_value.device).expand(len(labels)))
        accuracy.update(logits.to(accuracy.tp.device), labels.to(accuracy.tp.device))

    def _log_epoch(self, stage: str, loss_mean: MeanMetric, accuracy: MulticlassAccuracy) -> torch.Tensor | None:
        """The epoch's mean loss and accuracy over every rank (torchmetrics gathers them: every rank
        calls this at the same point), then a fresh start for the next epoch; the mean loss (None:
        no batch)."""
        loss = None
        if loss_mean.update_count:  # sync_dist: the same value on every rank, and no warning that it is not synced
            loss = loss_mean.compute()
            self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)
            self.log(f"{stage}_acc", accuracy.compute(), prog_bar=True, sync_dist=True)
        loss_mean.reset()
        accuracy.reset()
        return loss

    # A checkpoint written within an epoch holds the epoch's running sums so far, every rank's
    # added up, so that a run resumed from it logs the whole epoch's train_loss and train_acc, not
    # only the batches after the resume. Every rank writes the checkpoint (Lightning's
    # save_checkpoint), so every rank takes part in adding them up. At an epoch's end they are
    # already reset (the checkpoint callbacks run after on_train_epoch_end).
    EPOCH_SUMS = "ddlx_epoch_sums"

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        sums = {name: _summed_states(getattr(self, name)) for name in ("train_loss", "train_acc")}
        trainer = self._trainer
        if trainer is not None and not trainer.validating and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            # Written after the epoch's last batch, before its validation: resumed from here,
            # Lightning counts the epoch done and skips its end, so its sums would go to the next.
            sums = {name: {**states, "_updates": False} for name, states in sums.items()}
        checkpoint[self.EPOCH_SUMS] = sums

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        for name, states in (checkpoint.get(self.EPOCH_SUMS) or {}).items():
            metric = getattr(self, name)
            metric.reset()
            if not states["_updates"]:
                continue
            if self.global_rank == 0:  # the sums once: compute() adds every rank's
                for state in metric._defaults:
                    getattr(metric, state).copy_(states[state])
            # Every rank: whether the epoch's end computes (a collective) must not differ by rank.
            metric._update_count = 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                               **optimizer_flags(self.implementation))
