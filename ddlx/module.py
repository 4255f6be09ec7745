"""The LightningModule: loss, optimizer, metrics. No strategy logic lives here."""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from .compiling import optimizer_flags


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
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.model(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = self.loss(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val_loss", self.loss(logits, labels), on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                               **optimizer_flags(self.implementation))
