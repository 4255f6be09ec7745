"""PyTorch 2's own speed knobs: torch.compile, the channels_last memory format and the optimizer
step's implementation; and the clock that keeps compiling out of the epoch times.

torch is imported inside the functions: the config schema imports the choices below before torch
loads (a config error is answered in about a second)."""
from __future__ import annotations

import threading
import time
import types

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MEMORY_FORMATS = ("contiguous", "channels_last")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "for_loop", "foreach", "fused")  # auto: torch.optim's own choice

# What a strategy compiles: the whole model, or each top-level layer (strategies that shard or
# stage the model by layers: a compiled region must not span what they cut or wrap apart).
WHOLE_MODEL, EACH_LAYER = "model", "layer"


def compile_model(model, unit: str, mode: str = "default") -> None:
    """Compile ``model``'s forward in place (``unit``: :data:`WHOLE_MODEL` or :data:`EACH_LAYER`).

    The forward method is compiled, not the module's call: the hooks strategies put on a module
    (FSDP2's gathers, DDP's) stay outside the compiled graph, and the state dict keeps its keys,
    so a checkpoint of a compiled run resumes an eager one and the other way round. torch compiles
    at the first call; its caches (inductor's FX graph and AOTAutograd caches, under
    ``TORCHINDUCTOR_CACHE_DIR``, by default one folder per user of the machine) are shared by the
    ranks of a machine and by the next run of the same job. Dynamo's in-memory cache is cleared
    first: a job after another in one process (a sweep's, Hydra runs them in turn) would otherwise
    reuse the graphs of the same network, compile nothing and log no ``compile_s``; each job pays
    what a fresh process pays, from the same on-disk caches."""
    import torch

    torch._dynamo.reset()
    modules = [model] if unit == WHOLE_MODEL else list(model.children())
    # Layers of one class share their forward's code, which is one frame to dynamo, cached per
    # layer, mode (training, validation) and batch shape: past its limit of entries (8), the
    # remaining layers would run eager, with only a warning to say so.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6: its old name
    setattr(config, limit, max(getattr(config, limit), 8 * len(modules)))
    if hasattr(config, "accumulated_recompile_limit"):  # torch >= 2.5: a limit over all frames too
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * len(modules))
    # Layer by layer, static shapes: a frame that met a second shape would otherwise be recompiled
    # for symbolic ones, and layers of one class but other widths (a ResNet's blocks) do that at
    # once. A whole model keeps torch's default, where a new shape is a new batch size.
    dynamic = False if unit == EACH_LAYER else None
    for module in modules:
        # The compiled function bound to the module, not a compiled bound method: a copy of the
        # module (copy.deepcopy) then runs its own weights and settings, not the original's.
        module.forward = types.MethodType(torch.compile(module.forward.__func__, mode=mode, dynamic=dynamic), module)


def drop_compiled(model) -> None:
    """Have ``model``'s compiled forwards (:func:`compile_model`'s) run eager again, in place."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if getattr(getattr(forward, "__func__", None), "_torchdynamo_orig_callable", None) is not None:
            del module.forward


def to_memory_format(model, memory_format: str):
    """``model`` with its weights in ``memory_format`` (convolutions then run NHWC kernels)."""
    import torch

    return model.to(memory_format=torch.channels_last) if memory_format == "channels_last" else model


def optimizer_flags(implementation: str) -> dict:
    """torch.optim.SGD's keyword arguments for ``implementation``."""
    return {"auto": {}, "for_loop": {"foreach": False}, "foreach": {"foreach": True},
            "fused": {"fused": True}}[implementation]


def inductor_cache_counts(since: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """Graphs inductor has, in this process (since an earlier reading ``since``), taken from its
    FX graph cache (hits) and compiled (misses, and graphs the cache could not take: bypasses).
    With the cache switched off (TORCHINDUCTOR_FX_GRAPH_CACHE=0) neither is counted."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    now = inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"]
    return now[0] - since[0], now[1] - since[1]


def compiled_most(hits: float, misses: float) -> bool:
    """Whether a run compiled at least as many graphs as it took from inductor's cache (nothing
    from the cache included: a cache switched off, a backend without one): its compile seconds
    are what compiling costs, not what loading cached graphs does."""
    return misses >= hits


class CompileClock:
    """Seconds spent compiling (dynamo tracing, inductor, the backward compiled at its first call),
    from torch's compile start and end callbacks: nested or overlapping compiles count once. And
    how many graphs inductor took from its on-disk cache or compiled: a run whose graphs were all
    cached (a sweep's later job of the same network, a rerun) compiles in a fraction of the seconds
    a run that compiled them pays."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth, self._since = 0, 0.0
        self._lock = threading.Lock()
        self._cache_at_install = (0, 0)

    def cache_counts(self) -> tuple[int, int]:
        """(hits, misses) of inductor's FX graph cache since :meth:`install`."""
        return inductor_cache_counts(since=self._cache_at_install)

    def _start(self, _args=None) -> None:
        with self._lock:
            if self._depth == 0:
                self._since = time.perf_counter()
            self._depth += 1

    def _end(self, _args=None) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self.seconds += time.perf_counter() - self._since

    def now(self) -> float:
        """Compile seconds so far, the one under way included."""
        with self._lock:
            return self.seconds + (time.perf_counter() - self._since if self._depth else 0.0)

    def install(self) -> None:
        from torch._dynamo.callback import callback_handler

        self._cache_at_install = inductor_cache_counts()

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def remove(self) -> None:
        from torch._dynamo.callback import callback_handler

        for remove, callback in ((callback_handler.remove_start_callback, self._start),
                                 (callback_handler.remove_end_callback, self._end)):
            try:
                remove(callback)
            except ValueError:
                pass
