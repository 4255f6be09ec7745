"""Autocast (Lightning's ``*-mixed`` precision) is a per-thread state: strategies that run the
network's layers in threads of their own (``threads``' sub-batch threads, fairscale ``Pipe``'s
device workers) would run them in full precision while the run says mixed. They carry the
training thread's state into theirs with these."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

AutocastState = tuple[tuple[str, torch.dtype, bool], ...]


def autocast_state() -> AutocastState:
    """The calling thread's autocast: the device types it is on for, their formats, and whether
    it caches cast weights (Lightning's does not)."""
    cache = torch.is_autocast_cache_enabled()
    return tuple((device, torch.get_autocast_dtype(device), cache) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


@contextmanager
def autocast_as(state: AutocastState) -> Iterator[None]:
    """Run the block under ``state`` (another thread's autocast)."""
    with ExitStack() as stack:
        for device, dtype, cache in state:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
        yield


class CarriedAutocast:
    """Modules that run in other threads, each entering the autocast :meth:`capture` last saw in
    the training thread for the length of its forward (a recomputation in backward included)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.state: AutocastState = ()
        self._open: dict[int, ExitStack] = {}
        self._hooks = [h for m in modules for h in (m.register_forward_pre_hook(self._enter),  # left even when it raises
                                                      m.register_forward_hook(self._leave, always_call=True))]

    def capture(self) -> None:
        self.state = autocast_state()

    def _enter(self, module, _inputs) -> None:
        if self.state and autocast_state() != self.state:
            stack = ExitStack()
            stack.enter_context(autocast_as(self.state))
            self._open[id(module)] = stack

    def _leave(self, module, _inputs, _output) -> None:
        stack = self._open.pop(id(module), None)
        if stack is not None:
            stack.close()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
