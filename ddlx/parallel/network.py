"""Strategies whose parallelism lives in how the network runs, not in what it computes.

A *parallelizer* takes the :class:`LayeredModel` (and the process's local rank, for strategies
that give each process its own devices) and installs a new ``forward`` on it instead of
wrapping it in another module. Parameter names stay those of the sequential model, so a
checkpoint written under any strategy loads under any other, and the LightningModule never
learns which strategy ran. The same parallelizers run in one process (:class:`NetworkStrategy`)
or inside every rank of a data-parallel job (:class:`DataParallelNetworkStrategy`: the
paper's hybrid "data and model" setup, and the MPI setup with a local strategy).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import SingleDeviceStrategy

from ..models import LayeredModel
from ..models.layered import find_layered_model
from .launch import RelaunchingDDPStrategy


class InstalledForward(Protocol):
    """A network's forward as a strategy runs it. A pipeline's also has ``stage_layers``: the
    layers of each stage, as cut (``strategy.balance=auto`` resolved)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


Parallelizer = Callable[[LayeredModel, int], InstalledForward]


def install(module: torch.nn.Module, parallelize: Parallelizer, local_rank: int) -> InstalledForward:
    """Route the network's ``forward`` through ``parallelize``'s; ``sequential_forward`` keeps the
    original, and ``stage_layers`` a pipeline's cut, for the run's record (:func:`stages_run`)."""
    model = find_layered_model(module)
    model.sequential_forward = torch.nn.Sequential.forward.__get__(model)
    forward = parallelize(model, local_rank)
    model.forward = forward
    model.stage_layers = getattr(forward, "stage_layers", None)
    return forward


def stages_run(module: torch.nn.Module) -> list[int] | None:
    """The layers of each pipeline stage the network of ``module`` last ran in (None: no pipeline).
    Read as a run ends, however it ends: it never raises."""
    try:
        return getattr(find_layered_model(module), "stage_layers", None)
    except TypeError:  # not one LayeredModel: no pipeline of ddlx's either
        return None


def uninstall(module: torch.nn.Module | None, forward: InstalledForward | None) -> None:
    if module is not None:
        model = find_layered_model(module)
        model.__dict__.pop("forward", None)
        model.__dict__.pop("sequential_forward", None)
    close = getattr(forward, "close", None)
    if close is not None:
        close()


class NetworkStrategy(SingleDeviceStrategy):
    """One process; ``parallelize`` spreads the network over threads or devices."""

    def __init__(self, device: torch.device, parallelize: Parallelizer) -> None:
        super().__init__(device=device)
        self.parallelize = parallelize
        self._forward: InstalledForward | None = None

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._forward = install(self.lightning_module, self.parallelize, 0)

    def teardown(self) -> None:
        uninstall(self.lightning_module, self._forward)
        self._forward = None
        super().teardown()


class DataParallelNetworkStrategy(RelaunchingDDPStrategy):
    """DDP across processes, each running its network through ``parallelize`` on its own devices.

    The network may span several devices, so DDP gets no ``device_ids`` (its multi-device mode).
    """

    def __init__(self, parallelize: Parallelizer | None, root_devices: list[torch.device], **ddp_kwargs) -> None:
        super().__init__(parallel_devices=root_devices, **ddp_kwargs)
        self.parallelize = parallelize
        self._forward: InstalledForward | None = None

    def configure_ddp(self) -> None:
        if self.parallelize is not None:
            self._forward = install(self.model, self.parallelize, self.local_rank)
        super().configure_ddp()

    def determine_ddp_device_ids(self) -> None:
        return None

    def teardown(self) -> None:
        super().teardown()
        if self.parallelize is not None:
            uninstall(self.lightning_module, self._forward)
        self._forward = None
