"""Lightning DDP: ``processes`` ranks (one per CPU share over gloo, one per GPU over NCCL),
gradients allreduced in buckets while the backward pass goes on."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ..errors import ConfigError
from ..knobs import ALWAYS, MISSING, UNLESS_DEFAULT, knob
from ..costmodel.costs import DEFAULT_BUCKET_MB, RECOMPUTE, recomputes
from .parts.replicas import RanksOverNodes, data_parallel_cost, data_parallel_memory
from .spec import TIMEOUT_S, Setup, StrategyPlan, StrategySpec, warn_oversubscription

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass
class DdpConfig:
    """Lightning DDP: ``processes`` ranks, gradients allreduced (gloo over sockets on CPU, NCCL on GPUs)."""

    name: str = MISSING
    processes: int = knob(2, low=1, setup=ALWAYS)
    bucket_cap_mb: float = knob(DEFAULT_BUCKET_MB, low=0, low_open=True, setup=UNLESS_DEFAULT, quiet=False)  # DDP's fusion threshold (Jansen's thesis Eq. 5.1's th)
    comm_hook: str = knob("none", choices=COMM_HOOKS, quiet=True)  # gradient compression (the training-systems survey, section 4)
    checkpoint: str = knob("never", choices=RECOMPUTE, setup=UNLESS_DEFAULT)  # always: recompute each block between cut points in backward
    timeout_s: float = knob(TIMEOUT_S, low=0, low_open=True)


@dataclass
class DdpGlooConfig(DdpConfig):
    name: str = "ddp_gloo"


@dataclass
class DdpNcclConfig(DdpConfig):
    name: str = "ddp_nccl"
    processes: int = knob(1, low=1, setup=ALWAYS)


def comm_hook(name: str) -> dict:
    """DDP's communication hook (the training-systems survey, section 4: gradient compression)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        return {"ddp_comm_hook": default_hooks.fp16_compress_hook}
    if name == "bf16":
        return {"ddp_comm_hook": default_hooks.bf16_compress_hook}
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        return {"ddp_comm_state": state, "ddp_comm_hook": powerSGD_hook.powerSGD_hook}
    return {}


class Ddp(RanksOverNodes, StrategySpec):
    splits_batch = True
    backend: str

    def needs_gpu(self, cfg, accelerator: str) -> bool:
        return self.backend == "nccl" or super().needs_gpu(cfg, accelerator)

    def no_gpu_problem(self, cfg, accelerator: str) -> str:
        if self.backend != "nccl":
            return super().no_gpu_problem(cfg, accelerator)
        return (f"strategy=ddp_nccl needs CUDA GPUs (NCCL runs only on GPUs), but this machine has none; "
                f"use strategy=ddp_gloo strategy.processes={cfg.processes}")

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        from ..parallel.devices import gpu_count
        from ..parallel.launch import RelaunchingDDPStrategy, ranks_per_node

        processes = cfg.processes
        per_node, nodes = ranks_per_node(processes, self.name)  # srun or torchrun may spread them over nodes
        if self.backend == "nccl":
            gpus = gpu_count()
            if gpus < per_node:
                raise ConfigError(
                    f"strategy=ddp_nccl asks for {per_node} CUDA GPU(s) per node (NCCL runs only on GPUs), but this "
                    f"machine has {gpus}; use strategy=ddp_gloo (CPU) or strategy.processes={gpus * nodes}" if gpus else
                    f"strategy=ddp_nccl needs CUDA GPUs (NCCL runs only on GPUs), but this machine has none "
                    f"(devices: cpu); use strategy=ddp_gloo strategy.processes={processes}"
                )
            device_accelerator = "gpu"
        else:
            device_accelerator = "cpu" if accelerator in ("cpu", "auto") else accelerator
            if device_accelerator == "cpu":
                warn_oversubscription(self.name, per_node, "processes")
        strategy = RelaunchingDDPStrategy(process_group_backend=self.backend, bucket_cap_mb=cfg.bucket_cap_mb,
                                          timeout=timedelta(seconds=cfg.timeout_s), **comm_hook(cfg.comm_hook))
        strategy.recompute = recomputes(cfg)
        return StrategyPlan(
            trainer_kwargs={"strategy": strategy, "devices": per_node, "num_nodes": nodes, "accelerator": device_accelerator},
            tags={"processes": str(processes), "nodes": str(nodes), "backend": self.backend,
                  "bucket_cap_mb": f"{cfg.bucket_cap_mb:g}", "comm_hook": cfg.comm_hook, "checkpoint": cfg.checkpoint},
            data_parallel=self.data_parallel(cfg),
            replicas_per_machine=per_node,
            recompute=strategy.recompute,
        )

    def candidates(self, hw, job) -> list[Setup]:
        """Every device of a node; with several nodes, every device of the cluster too (srun
        starting the ranks); each also recomputing its activations."""
        n, total = hw.devices_per_node, hw.total_devices
        if (hw.device_kind == "cpu") != (self.backend == "gloo"):
            return []
        plain = [self.setup(processes=p) for p in dict.fromkeys((n, total)) if p > 1]
        return [*plain, *(self.with_knobs(s, checkpoint="always") for s in plain)]

    def cost(self, setup, job, hw, profile, seq):
        return data_parallel_cost(setup, setup.processes, job, hw, profile, seq)

    def memory(self, setup, job, hw, profile, seq=None):
        return data_parallel_memory(setup, setup.processes, job, hw, profile)


class DdpGloo(Ddp):
    name, config, order, backend = "ddp_gloo", DdpGlooConfig, 3, "gloo"


class DdpNccl(Ddp):
    name, config, order, backend = "ddp_nccl", DdpNcclConfig, 4, "nccl"


SPECS = (DdpGloo(), DdpNccl())
