"""Multi-process data parallelism on one CPU machine, gradients averaged through shared memory
(Lerat et al. 2022, section 4.1): the paper's fastest CPU setup."""
from __future__ import annotations

from dataclasses import dataclass

from ..knobs import ALWAYS, SetupRole, knob
from ..costmodel.costs import (
    REPLICA_SHARE,
    cost,
    link,
    memory_need,
    node_copy_gb_s,
    replica_bytes,
    weight_traffic_s,
)
from ..costmodel.perf_models import cpu_mp_s, split_exchange_s
from .spec import TIMEOUT_S, Setup, StrategyPlan, StrategySpec, no_loss_scaling, require_cpu, warn_oversubscription

SPLIT_LINEAR = ("auto", "never")


@dataclass
class CpuMpConfig:
    """``processes`` ranks on one machine, each pinned to cores/processes cores with as many
    threads, its own data shard and loader workers; gradients averaged through shared memory
    (Lerat et al. 2022, section 4.1)."""

    name: str = "cpu_mp"
    processes: int = knob(2, low=1, setup=ALWAYS)
    pin_cores: bool = True
    # auto: the fully connected layers that move fewer bytes split by rows between the ranks (model
    # parallel) than run whole by each; never: every layer data parallel, as every rank runs it.
    # Runs from before the knob split no layer.
    split_linear: str = knob("auto", choices=SPLIT_LINEAR, setup=SetupRole(unless_default=True, absent="never"))
    timeout_s: float = knob(TIMEOUT_S, low=0, low_open=True)


class CpuMp(StrategySpec):
    name, config, order = "cpu_mp", CpuMpConfig, 2
    splits_batch = True

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        from ..parallel.shared_weight_ranks import CpuMultiProcessStrategy

        require_cpu(self.name, accelerator)
        warn_oversubscription(self.name, cfg.processes, "processes")
        strategy = CpuMultiProcessStrategy(cfg.processes, pin_cores=cfg.pin_cores, timeout_s=cfg.timeout_s,
                                           split_linear_batch=data.batch_size if cfg.split_linear == "auto" else None)
        # Lightning would clip each rank's own gradient after the reduce has averaged the slices.
        clipping = ("each rank steps its slice of the averaged gradient, which Lightning's clipping does not see; "
                    "use strategy=ddp_gloo to clip")
        return StrategyPlan(trainer_kwargs={"strategy": strategy, "devices": cfg.processes, "accelerator": "cpu"},
                            tags={"processes": str(cfg.processes), "split_linear": cfg.split_linear}, data_parallel=self.data_parallel(cfg),
                            replicas_per_machine=cfg.processes, refused_trainer_args={"gradient_clip_val": clipping},
                            refused_precisions=self.refused_precisions(cfg))

    def refused_precisions(self, knobs) -> dict[str, str]:
        return no_loss_scaling("each rank checks only its slice of the gradient")

    def candidates(self, hw, job) -> list[Setup]:
        n = hw.devices_per_node
        return [self.setup(processes=n)] if hw.device_kind == "cpu" and n > 1 else []

    def cost(self, setup, job, hw, profile, seq):
        """One copy of the weights: the optimizer's passes over them are made once in all (each
        rank steps its slice), each extra rank repeats only its forward and backward passes, and
        of those not the split layers' (each rank computes its rows, exchanging activations)."""
        p = setup.processes
        work = job.batch_size * (seq.per_sample_at(job.batch_size / p) + seq.load_per_sample_s)
        barrier = hw.intra_node.latency_us * 1e-6
        split, split_params = split_layers(setup, job, profile)
        averaged_mb = (profile.params - split_params) * profile.param_bytes / 1e6
        copy_mb_s = node_copy_gb_s(hw, p) * 1e3
        repeated = 1 + (p - 1) * REPLICA_SHARE * (1 - split_params / profile.params)
        total = (cpu_mp_s(work, p, averaged_mb, copy_mb_s, barrier)
                 + 2 * split_params * profile.param_bytes / 1e6 / copy_mb_s  # the split rows' gradients, divided by P
                 + split_exchange_s([(i, o) for i, o, _ in split], job.batch_size, p, _activation_bytes(split),
                                    link(hw.intra_node))
                 + weight_traffic_s(seq, hw, repeated, p))
        return cost(work / p, total)

    def memory(self, setup, job, hw, profile, seq=None):
        """Each rank's activations (the split layers' inputs for the whole batch) and gradient
        (of the split layers only its rows), one shared copy of the weights, the optimizer state
        once over the slices, and the shared gradient slots (one per rank, of the layers not split)."""
        p = setup.processes
        split, split_params = split_layers(setup, job, profile)
        averaged = profile.params - split_params
        shared = (2 * profile.params + p * averaged) * profile.param_bytes  # weights, momentum (split), slots
        ranks = min(p, hw.devices_per_node)
        gathered = sum((job.batch_size - job.batch_size // p) * i * width for i, _, width in split)
        per_rank = (replica_bytes(job, job.batch_size // p) - profile.state_bytes(profile.params) + gathered
                    + (averaged + split_params / p) * profile.param_bytes  # its gradient
                    + profile.params * profile.cast_bytes)  # its autocast copies
        return memory_need(hw, per_rank + shared / ranks, ranks)


def split_layers(setup, job, profile) -> tuple[list[tuple[int, int, int]], int]:
    """The fully connected layers a run of ``setup`` splits by rows, each (in, out, bytes per
    activation value), and their parameters."""
    from ..parallel.split_linear import worth_splitting

    p = setup.processes
    if setup.split_linear == "never":
        return [], 0
    split = [(i, o, layer.output_bytes // o) for layer in profile.layers for i, o in layer.linears
             if worth_splitting(i, o, job.batch_size, p)]
    return split, sum(i * o + o for i, o, _ in split)


def _activation_bytes(split) -> int:
    return split[0][2] if split else 0


SPECS = (CpuMp(),)
