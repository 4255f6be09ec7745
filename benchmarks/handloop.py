"""The hand-written PyTorch training loop ddlx is judged against (shared by the benchmarks)."""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

# Lightning's mixed precisions as a hand-written loop's autocast dtype (None: fp32).
AUTOCAST = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def hand_written_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer, device: torch.device | None = None,
                       autocast: torch.dtype | None = None) -> tuple[float, int]:
    """One training epoch as a user writes it by hand (loss and accuracy tracked, as anyone
    does): returns (seconds from the first batch request to the last step done, steps).
    ``device``: where the model is (each batch is copied there); ``autocast``: bf16 or fp16 mixed
    precision (a gradient scaler with fp16, as Lightning's ``16-mixed``)."""
    model.train()
    device = device or torch.device("cpu")
    scaler = torch.amp.GradScaler(device.type) if autocast == torch.float16 else None
    loss_fn = nn.CrossEntropyLoss()
    # Kept on the device and read once at the end: reading them every step would make the
    # host wait for the GPU each step, and the next batch's copy and launches would not overlap.
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    seen, steps = 0, 0
    start = time.perf_counter()
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad()  # set_to_none=True, torch's default and Lightning's
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = model(images)
            loss = loss_fn(logits, labels)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        loss_sum += loss.detach() * len(labels)
        correct += (logits.argmax(1) == labels).sum()
        seen += len(labels)
        steps += 1
    float(loss_sum), int(correct)  # the last step done
    return time.perf_counter() - start, steps


def second_of_two(epoch: Callable[[], tuple[float, int]],
                  timed_within: contextlib.AbstractContextManager | None = None) -> tuple[float, int]:
    """An untimed epoch, then ``epoch`` timed (inside ``timed_within``, a profiler say): what
    ddlx's runner (benchmarks/overhead.py) times, the second epoch of a two-epoch fit. Both sides
    then time an epoch that follows one of their own: on a GPU, Lightning empties the CUDA
    allocator's cache at each fit's start and end, in the process the hand loop shares, so an
    epoch that came first would allocate its activations again, on whichever side ran after a fit."""
    epoch()
    with timed_within or contextlib.nullcontext():
        return epoch()


def premade_batches(steps: int, batch_size: int, image_size: int, device: torch.device):
    """``steps`` batches of random images made once, for both loops to read alike: a loader
    over whole batches (no collation, which on one host thread would take a GPU step's time:
    stacking 128 images at 224 px copies 77 MB), in pinned memory on a GPU run so that each
    batch's copy is asynchronous."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    pin = device.type == "cuda"
    batches = []
    for _ in range(steps):
        images = torch.randn(batch_size, 3, image_size, image_size)
        labels = torch.randint(0, 3, (batch_size,))
        batches.append((images.pin_memory(), labels.pin_memory()) if pin else (images, labels))
    return DataLoader(batches, batch_size=None, shuffle=False)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of Lerat et al. 2022, section 3.2, as ddlx's module builds it."""
    return torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)


def interleaved_rounds(runners: dict[str, Callable[[], tuple[float, int]]], rounds: int, label: str,
                       threads: int | None = None) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each runner (an epoch: its seconds and steps) once a round, a warm-up round then ``rounds``,
    in an order rotated every round so that none always runs first or after the same one (a
    shared machine's drift falls on all alike). Returns each runner's seconds a step per timed
    round, and its warm-up round's wall seconds (compiling included)."""
    order = list(runners)
    per_step: dict[str, list[float]] = {key: [] for key in order}
    first: dict[str, float] = {}
    for round_ in range(rounds + 1):
        for key in order[round_ % len(order):] + order[: round_ % len(order)]:
            if threads is not None:
                torch.set_num_threads(threads)
            started = time.perf_counter()
            seconds, steps = runners[key]()
            if round_ == 0:
                first[key] = time.perf_counter() - started
            else:
                per_step[key].append(seconds / steps)
        print(f"  {label} round {round_}: " + ", ".join(f"{k} {1000 * v[-1]:.1f} ms" for k, v in per_step.items() if v),
              file=sys.stderr)
    return per_step, first
