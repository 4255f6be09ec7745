"""The hand-written PyTorch training loop ddlx is judged against (shared by the benchmarks)."""
from __future__ import annotations

import time

import torch
from torch import nn


def hand_written_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer) -> tuple[float, int]:
    """One training epoch as a user writes it by hand (loss and accuracy tracked, as anyone
    does): returns (seconds from the first batch request to the last step done, steps)."""
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    loss_sum, correct, seen, steps = 0.0, 0, 0, 0
    start = time.perf_counter()
    for images, labels in loader:
        optimizer.zero_grad()  # set_to_none=True, torch's default and Lightning's
        logits = model(images)
        loss = loss_fn(logits, labels)
        loss.backward()
        optimizer.step()
        loss_sum += loss.item() * len(labels)
        correct += int((logits.argmax(1) == labels).sum())
        seen += len(labels)
        steps += 1
    return time.perf_counter() - start, steps


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """Source 000 section 3.2's optimizer, as ddlx's module builds it."""
    return torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
