"""The paper's single-process multi-threaded data parallelism on CPU (the Lerat et al. entry, section 2.5).

A batch of n is split into k sub-batches of n/k; k threads each run forward and backward of
the network on their sub-batch. The replicas share one set of weights in memory, so they are
identical by construction, and each thread's backward adds its share of the gradient into the
shared ``.grad`` under autograd's per-parameter accumulation lock: the sum over sub-batches of
the gradient of the full-batch mean loss, i.e. the sequential step's gradient (up to float
summation order). PyTorch releases the GIL inside its kernels, so the threads run in
parallel; intra-op threads are set to cores // k so they do not oversubscribe.

Forward outputs are joined by an autograd function whose backward starts the k sub-batch
backward passes in the same k threads, so the loss and metrics stay in the main thread.
Inside DDP (``strategy=mpi local=threads``) each parameter's gradient must arrive once per
step, as DDP's reducer counts arrivals: there the threads compute their gradients apart and the
join hands back their sum, the parameters being its inputs (k gradient copies for a moment).
BatchNorm layers see sub-batch statistics, as under any data parallelism without SyncBatchNorm.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..models import LayeredModel
from .autocast import AutocastState, autocast_as, autocast_state

log = logging.getLogger(__name__)


class _JoinSubBatches(torch.autograd.Function):
    """Concatenate sub-batch outputs; on backward, run each sub-batch's backward in its thread.
    With ``params`` (inside DDP), the threads' gradients are summed and returned for them."""

    @staticmethod
    def forward(ctx, pool: ThreadPoolExecutor, graphs: list[torch.Tensor], params: tuple, *inputs: torch.Tensor) -> torch.Tensor:
        outputs = inputs[len(params):]
        ctx.pool, ctx.graphs, ctx.params = pool, graphs, params
        ctx.sizes = [o.shape[0] for o in outputs]
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grads, params = grad.split(ctx.sizes), ctx.params
        if params:
            futures = [ctx.pool.submit(torch.autograd.grad, g, params, gr, allow_unused=True)
                       for g, gr in zip(ctx.graphs, grads)]
            per_param = zip(*(future.result() for future in futures))  # each parameter's gradient from each thread
            summed = tuple(sum(present) if (present := [g for g in grads if g is not None]) else None for grads in per_param)
        else:
            for future in [ctx.pool.submit(torch.autograd.backward, g, gr) for g, gr in zip(ctx.graphs, grads)]:
                future.result()
            summed = ()
        ctx.graphs = ctx.params = None
        return (None, None, None, *summed, *[None] * len(grads))


class ThreadedForward:
    """``forward`` of a LayeredModel that trains k sub-batches in k threads."""

    def __init__(self, model: LayeredModel, threads: int, accumulate_once: bool = False) -> None:
        self.model = model
        self.threads = threads
        self.accumulate_once = accumulate_once  # inside DDP: each gradient arrives once per step
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="ddlx-dp")

    def _run(self, x: torch.Tensor, autocast: AutocastState) -> torch.Tensor:
        with torch.enable_grad(), autocast_as(autocast):
            return self.model.sequential_forward(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or x.shape[0] < 2:
            return self.model.sequential_forward(x)  # validation: no gradients to share out
        chunks = x.tensor_split(min(self.threads, x.shape[0]))
        autocast = autocast_state()  # per thread: the sub-batch threads run in the training thread's
        graphs = list(self.pool.map(self._run, chunks, [autocast] * len(chunks)))
        leaves = [g.detach().requires_grad_() for g in graphs]
        params = tuple(p for p in self.model.parameters() if p.requires_grad) if self.accumulate_once else ()
        return _JoinSubBatches.apply(self.pool, graphs, params, *params, *leaves)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def threads_parallelizer(threads: int, accumulate_once: bool = False):
    def parallelize(model: LayeredModel, local_rank: int) -> ThreadedForward:
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // threads))
        log.info("threads: %d sub-batch threads x %d intra-op threads", threads, torch.get_num_threads())
        return ThreadedForward(model, threads, accumulate_once)

    return parallelize
