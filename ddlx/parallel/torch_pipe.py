"""PyTorch's own pipelining (``torch.distributed.pipelining``): one process per device, each
running its stages of the network under one of PyTorch's schedules.

Every process trains the whole batch in ``chunks`` micro-batches: the first stage reads the
images, the last computes the loss of each micro-batch and the schedule sends activations and
their gradients between neighbouring stages (gloo on CPU, NCCL on GPUs). Each micro-batch's
loss is divided by the micro-batch count (and Lightning's gradient accumulation), so the summed
gradients are the batch mean's: one step is the sequential step. The
network's ``forward`` is replaced on every rank (as for the other network strategies): it runs
the schedule, forward and backward, and returns the last stage's logits to every rank, so the
LightningModule computes the same loss and metrics everywhere and never learns it was
pipelined. Lightning zeroes gradients between a training step and its backward, so the
forward holds the schedule's gradients back and the strategy's ``backward`` hands them over. Each rank steps the
parameters of its own stages (the others get no gradient); a checkpoint gathers every stage's
weights and optimizer state on rank 0, under the sequential model's names.

Under the schedules with one backward pass per micro-batch, the stages' ``Linear`` weight
gradients are computed once for the whole batch after the schedule (:mod:`.deferred_weight_grads`),
not once per micro-batch.

Several pipelines train data-parallel (``hybrid``, ``mpi``): ranks form a (replica, stage) mesh
as torchtitan's ``pp`` and ``dp`` dimensions, a pipeline's ranks consecutive (one node: its
activations never cross the network, only the gradient average does, as in the Lerat et al. entry's
Figure 1). Each pipeline trains its share of the batch; after the schedule, every rank averages
its stages' gradients with the same stages of the other pipelines.

Clipping by norm (``trainer.gradient_clip_val``) clips by the whole network's gradient norm, as
sequential does: each rank's norm of its own stages' gradients, squared and summed over its
pipeline (torchtitan's ``clip_grad_norm_`` over its ``pp`` mesh). Lightning's own clip would
scale each stage by its own norm.

Schedules (PyTorch's classes): ``gpipe`` (all forwards, then all backwards), ``1f1b`` (one
forward, one backward: PipeDream-flush, at most one micro-batch per stage in flight per
stage ahead), ``interleaved_1f1b`` (two stages per process, looped: smaller bubble) and
``zero_bubble`` (ZB-V: two stages per process in a V, weight gradients deferred into the
bubble).
"""
from __future__ import annotations

import functools
import itertools
import logging
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..models import LayeredModel
from ..models.layered import blocks_between, out_of_place
from .balance import balance_by_time
from .deferred_weight_grads import DeferredWeightGrads
from .launch import RelaunchingDDPStrategy, plain_optimizer
from .network import InstalledForward, install, uninstall
from .pinning import Restore, pin_rank, unpin
from .recompute import recompute_blocks
from .schedules import SCHEDULES, micro_batches, stage_owners, stages_of

log = logging.getLogger(__name__)


def batches_weight_grads(schedule: str) -> bool:
    """Whether the stages' Linear weight gradients wait for the whole batch
    (:mod:`.deferred_weight_grads`): not under zero-bubble schedules, which split weight
    gradients from input gradients themselves (two backward passes)."""
    return SCHEDULES[schedule].backward_passes == 1


class _NotAView(nn.Module):
    """A stage's output as a tensor of its own: the zero-bubble schedules detach it in place,
    which a view (a flatten's) refuses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone() if x._is_view() else x


class PipelineForward:
    """The network's forward on one rank: the batch through the schedule (with backward when
    gradients are on), the last stage's logits returned on every rank."""

    def __init__(self, model: LayeredModel, balance: list[int], schedule: str, chunks: int, rank: int, ranks: int,
                 device: torch.device, loss_fn: nn.Module, recompute: bool = False, group=None) -> None:
        """``rank`` of ``ranks``: this process's place in its pipeline, whose processes form ``group``
        (None: every process of the job)."""
        bounds = [0, *itertools.accumulate(balance)]
        self.num_stages, self.schedule, self.chunks, self.ranks = len(balance), schedule, chunks, ranks
        self.stage_layers = list(balance)
        self.mine = stages_of(schedule, rank, ranks)
        self.parts = [model[bounds[i] : bounds[i + 1]].to(device) for i in self.mine]
        for part in self.parts:
            out_of_place(part[0])  # a stage's input arrives as a leaf that requires grad
            part.append(_NotAView())
        if recompute:  # each stage's blocks between the model's cut points
            for part, i in zip(self.parts, self.mine):
                cuts = [c - bounds[i] for c in model.cut_points.values()]
                recompute_blocks(part, blocks_between(cuts, 0, len(part)))
        self.parameters = [p for part in self.parts for p in part.parameters()]  # the ones this rank trains
        self.deferred = DeferredWeightGrads(self.parts) if batches_weight_grads(schedule) else None
        self.device, self.loss_fn = device, loss_fn
        self.target: torch.Tensor | None = None  # the batch's labels, set before each training step
        self.accumulate = 1  # Lightning's accumulate_grad_batches: each loss's share of an optimizer step
        self.held: list[tuple[nn.Parameter, torch.Tensor | None]] = []  # this step's gradients, until the backward
        self._schedules: dict[int, object] = {}  # one per batch size: stages keep the shapes they first saw
        self.rank, self.owner = rank, stage_owners(schedule, ranks)
        self.group = group
        self.peers = dist.get_process_group_ranks(group) if group is not None else list(range(ranks))  # global ranks

    def _schedule_for(self, batch: int):
        if batch not in self._schedules:
            from torch.distributed import pipelining

            spec = SCHEDULES[self.schedule]
            micro = micro_batches(batch, self.chunks)
            if spec.micro_at_least_ranks and micro < self.ranks:
                spec = SCHEDULES["gpipe"]  # a last batch too small for 1F1B: the same step in GPipe's order
            stages = [pipelining.PipelineStage(part, i, self.num_stages, self.device, group=self.group)
                      for part, i in zip(self.parts, self.mine)]
            share = micro * self.accumulate

            def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                return self.loss_fn(output, target) / share

            self._schedules[batch] = getattr(pipelining, spec.torch_class)(
                stages if spec.stages_per_rank > 1 else stages[0], n_microbatches=micro, loss_fn=loss_fn,
                scale_grads=False)
            log.debug("pipeline: batch of %d in %d micro-batches", batch, micro)
        return self._schedules[batch]

    def _evaluate(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Forward only (validation), the whole batch stage after stage: PyTorch's zero-bubble
        schedule cannot run forward-only, and one way serves every schedule."""
        h = x
        for i, owner in enumerate(self.owner):
            if owner != self.rank:
                continue
            if i > 0 and self.owner[i - 1] != self.rank:
                holder = [None]
                dist.recv_object_list(holder, src=self.peers[self.owner[i - 1]], group=self.group)
                h = holder[0].to(self.device)
            h = self.parts[self.mine.index(i)](h)
            if i + 1 < self.num_stages and self.owner[i + 1] != self.rank:
                dist.send_object_list([h.cpu()], dst=self.peers[self.owner[i + 1]], group=self.group)
        return h

    def close(self) -> None:
        if self.deferred is not None:
            self.deferred.close()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        first, last = 0 in self.mine, self.num_stages - 1 in self.mine
        inputs = (x.to(self.device),) if first else ()
        if torch.is_grad_enabled():
            target = self.target.to(self.device) if last else None
            before = [p.grad for p in self.parameters]  # what Lightning may zero before the backward
            for p in self.parameters:
                p.grad = None
            out = self._schedule_for(x.shape[0]).step(*inputs, target=target, losses=[] if last else None)
            if self.deferred is not None:
                self.deferred.flush(micro_batches(x.shape[0], self.chunks))
            self.held = [(p, p.grad) for p in self.parameters]
            for p, grad in zip(self.parameters, before):
                p.grad = grad
        else:
            out = self._evaluate(inputs[0] if first else None)
        self.target = None
        holder = [out.detach().cpu() if last else None]
        dist.broadcast_object_list(holder, src=self.peers[self.owner[-1]], group=self.group)
        return holder[0].to(x.device)


class TorchPipelineStrategy(RelaunchingDDPStrategy):
    """One process per device of ``devices`` (this node's), each running its stages under
    ``schedule``; ``replicas`` pipelines of ``width`` consecutive processes (default: one of all
    of them) average their gradients (data parallelism)."""

    strategy_name = "ddlx_torch_pipe"

    def __init__(self, devices: list[torch.device], schedule: str, chunks: int, balance: list[int] | str,
                 sample_shape: tuple[int, ...], pin_cores: bool = True, timeout_s: float = 300.0,
                 width: int | None = None, replicas: int = 1, process_group_backend: str | None = None,
                 **ddp_kwargs) -> None:
        super().__init__(accelerator=None, parallel_devices=list(devices),
                         process_group_backend=process_group_backend or ("nccl" if devices[0].type == "cuda" else "gloo"),
                         timeout=timedelta(seconds=timeout_s), **ddp_kwargs)
        self.schedule, self.chunks, self.balance, self.pin_cores = schedule, chunks, balance, pin_cores
        self.sample_shape, self.width, self.replicas = sample_shape, width or len(devices), replicas
        self._forward: PipelineForward | None = None
        self._restore: Restore | None = None
        self._mesh = None

    @property
    def stage_rank(self) -> int:
        """This process's place in its pipeline."""
        return self.global_rank % self.width

    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":  # one core share per stage, like cpu_mp's ranks
            self._restore = pin_rank(self.num_processes, self.local_rank, self.pin_cores, "pipe")
        super().setup_environment()
        if self.world_size != self.replicas * self.width or self.num_processes % self.width:
            raise RuntimeError(f"{self.world_size} processes ({self.num_processes} per machine) for {self.replicas} pipeline(s) "
                               f"of {self.width} stages, each on one machine: strategy=pipe engine=torch runs one "
                               f"pipeline; use strategy=hybrid or strategy=mpi for several")
        if self.replicas > 1:  # torchtitan's layout: (dp, pp), a pipeline's ranks consecutive
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.root_device.type, (self.replicas, self.width), mesh_dim_names=("dp", "pp"))

    def configure_ddp(self) -> None:
        # No DDP wrapper: the stages' schedule moves activations and gradients between the ranks.
        loss_fn = getattr(self.lightning_module, "loss", None) or nn.CrossEntropyLoss()
        group = self._mesh["pp"].get_group() if self._mesh is not None else None

        def parallelize(model: LayeredModel, rank: int) -> InstalledForward:
            balance = self.balance
            if balance == "auto":  # profiled once, on rank 0: every rank must cut the model alike
                stages = self.width * SCHEDULES[self.schedule].stages_per_rank
                deferred_of = self.chunks if batches_weight_grads(self.schedule) else 0
                holder = [balance_by_time(model, stages, self.sample_shape, self.root_device, deferred_of) if rank == 0 else None]
                dist.broadcast_object_list(holder, src=0)
                balance = holder[0]
            return PipelineForward(model, balance, self.schedule, self.chunks, self.stage_rank, self.width,
                                   self.root_device, loss_fn, self.recompute, group)

        self._forward = install(self.model, parallelize, self.global_rank)
        # On the precision plugin, after its unscaling (16-mixed), as Lightning's own clip by norm.
        self.precision_plugin.clip_grad_by_norm = functools.partial(clip_grad_norm_over_stages, group=group,
                                                                   device=self.root_device)
        if self.root_device.type == "cuda":  # only this rank's stages stay on its GPU
            owned = {id(p) for p in self._forward.parameters}
            for layer in self.lightning_module.modules():
                if any(id(p) not in owned for p in layer.parameters(recurse=False)):
                    layer.to("cpu")

    @property
    def distributed_sampler_kwargs(self) -> dict:
        # Every stage of a pipeline sees its whole share of the batch (images first, labels last).
        return {"num_replicas": self.replicas, "rank": self.global_rank // self.width}

    @property
    def needs_inputs(self) -> bool:
        """Whether this rank reads the images (it runs the first stage); the others load labels only."""
        return 0 in stages_of(self.schedule, self.stage_rank, self.width)

    def training_step(self, *args, **kwargs):
        if self._forward is not None:
            self._forward.target = args[0][1]  # the labels, for the last stage's loss
            self._forward.accumulate = self.lightning_module.trainer.accumulate_grad_batches
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args, **kwargs) -> torch.Tensor:
        # The schedule ran every micro-batch's backward inside the forward; its gradients come back now.
        if self._forward is not None:
            if self._mesh is not None:
                average_gradients([grad for _, grad in self._forward.held if grad is not None],
                                  self._mesh["dp"].get_group(), self.replicas)
            for p, grad in self._forward.held:
                p.grad = grad if p.grad is None or grad is None else p.grad + grad  # accumulating, as autograd would
            self._forward.held = []
        return closure_loss

    def _owned(self) -> set[int]:
        return {id(t) for part in self._forward.parts for t in itertools.chain(part.parameters(), part.buffers())}

    def lightning_module_state_dict(self) -> dict:
        """The sequential model's state dict, each stage's tensors from the rank that trains it (collective)."""
        module = self.lightning_module
        if self._forward is None:
            return module.state_dict()
        owned = self._owned()
        mine = {name: t.detach().cpu() for name, t in itertools.chain(module.named_parameters(), module.named_buffers())
                if id(t) in owned}
        parts = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        state = module.state_dict()
        for part in parts:
            state.update(part)
        return state

    def optimizer_state(self, optimizer) -> dict:
        """The optimizer's state dict with each parameter's state from the rank that steps it (collective)."""
        optimizer = plain_optimizer(optimizer)
        doc = optimizer.state_dict()
        if self._forward is None:
            return doc
        owned = self._owned()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mine = {n: doc["state"][n] for n, p in enumerate(params) if id(p) in owned and n in doc["state"]}
        parts = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        doc["state"] = {n: s for part in parts for n, s in part.items()}
        return doc

    def teardown(self) -> None:
        uninstall(self.lightning_module, self._forward)
        self._forward = None
        unpin(self._restore, self.pin_cores)
        self._restore, self._mesh = None, None
        super().teardown()


def clip_grad_norm_over_stages(optimizer, clip_val: float, group=None, device: torch.device | None = None) -> None:
    """``torch.nn.utils.clip_grad_norm_`` of the whole pipeline: this rank holds the gradients of
    its stages only, so their squared norm is summed over ``group`` (the pipeline's ranks) first."""
    grads = [p.grad for g in plain_optimizer(optimizer).param_groups for p in g["params"] if p.grad is not None]
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        squared += torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
    dist.all_reduce(squared, group=group)
    scale = (clip_val / (squared.sqrt() + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_, to the same epsilon
    for grad in grads:
        grad.mul_(scale.to(grad.dtype))


def average_gradients(grads: list[torch.Tensor], group, replicas: int, bucket_mb: float = 25.0) -> None:
    """Each gradient replaced, in place, by its mean over ``group``'s ``replicas`` (the same
    stages of every pipeline), a bucket of about ``bucket_mb`` per all-reduce as DDP's."""
    bucket: list[torch.Tensor] = []
    size = 0
    for i, grad in enumerate(grads):
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= bucket_mb * 2**20 or i == len(grads) - 1:
            flat = torch.cat([g.reshape(-1) for g in bucket]).div_(replicas)
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, size = [], 0
