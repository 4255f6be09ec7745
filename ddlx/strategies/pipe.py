"""A pipeline: the batch in ``chunks`` micro-batches flowing through stages on several devices
(Jansen's thesis, chapter 6). Two engines: fairscale's ``Pipe`` (GPipe in one process, the design's
original; fairscale is unmaintained upstream) and PyTorch's ``torch.distributed.pipelining``
(one process per device, under GPipe, 1F1B, interleaved 1F1B or zero-bubble schedules). The
pipeline parts strategy=mpi and strategy=hybrid share are in :mod:`.pipelines`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..knobs import ALWAYS, UNLESS_DEFAULT, SetupRole, knob
from ..costmodel.costs import (FORWARD_SHARE, RECOMPUTE, REPLICA_SHARE, cost, gpu_index, link, memory_need, recomputed_share,
                               stage_bytes, weight_traffic_s)
from ..parallel.schedules import SCHEDULES
from ..costmodel.perf_models import Link, gpipe_comm_s, gpipe_compute_s, pipeline_schedule_s
from .parts.pipelines import (ENGINES, PIPE_CHECKPOINT, chunk_counts, compile_by_layers_or_refuse, default_balance, engine_group,
                        TORCH_PIPELINE_CHANNELS_LAST, TorchPipeline, engine_refused_precisions, pipe_knobs, pipeline_batch_problem, smallest_micro_batch, torch_batch_s,
                        torch_pipeline, torch_rank_bytes)
from .spec import TIMEOUT_S, Setup, StrategyPlan, StrategySpec, accelerator_of


@dataclass
class PipeConfig:
    """The batch in ``chunks`` micro-batches through the stages. balance: null = two stages at the
    split point, auto = by profiled layer time, or layer counts per stage. engine=torch: one
    process per device (pinned to its share of the cores on CPU), running ``schedule``."""

    name: str = "pipe"
    chunks: int = knob(4, low=1, setup=ALWAYS)
    devices: Any = knob("auto", setup=SetupRole(resolved=True, absent="cpu,cpu"))  # runs from before the tag: the CPU's
    balance: Any = knob(None, label="when_set")  # the resolved default differs per model: shown only when set
    checkpoint: str = knob("never", choices=PIPE_CHECKPOINT, setup=UNLESS_DEFAULT)  # recompute activations in backward
    engine: str = knob("fairscale", choices=ENGINES, setup=UNLESS_DEFAULT)
    schedule: str = knob("gpipe", choices=tuple(SCHEDULES), setup=SetupRole(when=(("engine", "torch"),)), quiet=True)
    pin_cores: bool = True  # engine=torch on CPU
    timeout_s: float = knob(TIMEOUT_S, low=0, low_open=True)  # engine=torch


def stages_of_devices(devices) -> int:
    """The stages ``strategy.devices`` gives a pipeline: one per device listed, else two."""
    return 2 if devices in (None, "auto") or isinstance(devices, str) else len(devices)


def pipe_balance(setup: Setup, profile, seq=None, micro: int = 1) -> list[int]:
    return default_balance(profile, len(setup.devices), seq, micro)


class Pipe(StrategySpec):
    name, config, order = "pipe", PipeConfig, 6

    def plan(self, cfg, accelerator, model, data) -> StrategyPlan:
        from ..parallel.devices import resolve_devices
        from ..parallel.network import NetworkStrategy
        from ..parallel.fairscale_pipe import pipe_parallelizer

        devices = resolve_devices(cfg.devices, stages_of_devices(cfg.devices), self.name)
        if cfg.engine == "torch":
            return self._plan_torch(cfg, devices, model, data)
        if cfg.schedule != "gpipe":
            raise ConfigError(f"strategy.schedule={cfg.schedule} needs strategy.engine=torch: fairscale's Pipe runs GPipe "
                              f"only; use strategy.engine=torch strategy.schedule={cfg.schedule}")
        chunks, balance, checkpoint, sample = pipe_knobs(cfg, model, data, data.batch_size, len(devices))
        strategy = NetworkStrategy(devices[0], pipe_parallelizer(lambda rank: devices, chunks, balance, checkpoint, sample))
        return StrategyPlan(
            trainer_kwargs={"strategy": strategy, "devices": 1, "accelerator": accelerator_of(devices[0])},
            tags={"devices": ",".join(map(str, devices)), "chunks": str(chunks), "balance": str(balance), "checkpoint": checkpoint},
        )

    def smallest_piece(self, cfg, batch: int) -> int:
        return smallest_micro_batch(cfg, batch)

    def batch_problem(self, cfg, batch: int, batch_size: int, replicas: int, per_worker: bool = False) -> str | None:
        return pipeline_batch_problem(cfg, batch, batch_size, replicas, stages_of_devices(cfg.devices), per_worker)

    def channels_last_problem(self, cfg) -> str | None:
        return TORCH_PIPELINE_CHANNELS_LAST if cfg.engine == "torch" else None

    def _plan_torch(self, cfg, devices, model, data) -> StrategyPlan:
        """One process per device, each running its stages under PyTorch's ``cfg.schedule``."""
        strategy, tags = torch_pipeline(cfg, devices, model, data, self.name)
        return StrategyPlan(
            trainer_kwargs={"strategy": strategy, "devices": len(devices), "accelerator": accelerator_of(devices[0])},
            tags={"devices": ",".join(map(str, devices)), **tags},
            refused_precisions=self.refused_precisions(cfg), recompute=strategy.recompute,
        )

    def starts_ranks(self, cfg) -> bool:
        return cfg.engine == "torch"  # one process per stage

    def refused_precisions(self, knobs) -> dict[str, str]:
        return engine_refused_precisions(knobs)

    def compile_unit(self, knobs) -> str:
        return compile_by_layers_or_refuse(self.name, knobs)

    def candidates(self, hw, job) -> list[Setup]:
        n, chunks = hw.devices_per_node, chunk_counts(job)
        if n < 2:
            return []
        if hw.device_kind == "cpu":
            return ([self.setup(chunks=c, devices=("cpu", "cpu")) for c in chunks]
                    + self._torch_candidates(("cpu", "cpu"), job))
        out = self._torch_candidates(tuple(f"cuda:{i}" for i in range(n)), job)
        for stages in sorted({2, n}):
            devices = tuple(f"cuda:{i}" for i in range(stages))
            for c in (c for c in chunks if c >= stages):
                # Keeping every activation, and torchgpipe's default: recomputing all micro-batches' but the last's.
                out += [self.setup(chunks=c, devices=devices), self.setup(chunks=c, devices=devices, checkpoint="except_last")]
        if chunks:  # the least memory: recompute every micro-batch
            out.append(self.setup(chunks=chunks[-1], devices=devices, checkpoint="always"))
        return out

    def _torch_candidates(self, devices: tuple[str, ...], job) -> list[Setup]:
        """PyTorch's schedules, one process per device, with the micro-batch counts they accept."""
        out = []
        for schedule in SCHEDULES:
            for c in chunk_counts(job):
                if job.batch_size % c == 0 and c >= len(devices):  # a micro-batch per stage at least
                    out.append(self.setup(chunks=c, devices=devices, engine="torch", schedule=schedule))
        return out

    def accepts(self, setup, job) -> bool:
        if setup.engine == "torch" and (job.batch_size % setup.chunks or setup.checkpoint not in RECOMPUTE):
            return False  # PyTorch's schedules need equal micro-batches; it recomputes all blocks or none
        return setup.chunks <= job.batch_size  # every micro-batch needs a sample

    def cost(self, setup, job, hw, profile, seq):
        b, load = job.batch_size, job.batch_size * seq.load_per_sample_s
        if setup.engine == "torch":
            compute, total = torch_batch_s(TorchPipeline.of(setup), hw, profile, seq, b)
            return cost(compute + load, total + load)
        w, m = len(setup.devices), setup.chunks
        return cost(gpipe_compute_s(m * max(1, b // m) * seq.per_sample_at(b // m), w, m) + load,
                    self._batch_s(setup, hw, profile, seq, b) + load)

    def _batch_s(self, setup, hw, profile, seq, b: int) -> float:
        """Eq. 6.1 + Eq. 6.2, plus the weight traffic: every micro-batch reads its stage's weights
        again; on GPUs each stage has its own memory, on CPU stages share the bus."""
        devices = setup.devices
        w, m = len(devices), setup.chunks
        micro = max(1, b // m)
        traffic = 1 + (m - 1) * REPLICA_SHARE
        weights = weight_traffic_s(seq, hw, traffic, w) if hw.device_kind == "cpu" else seq.weight_s * traffic / w
        recomputed = recomputed_share(setup.checkpoint, m)
        again = 1 + recomputed * FORWARD_SHARE  # their forward again in backward
        balance = pipe_balance(setup, profile, seq, micro)
        stages = seq.stage_s(balance, micro)
        if stages is not None:  # each stage as slow as its layers: the slowest paces the pipeline (W + #mb - 1 steps)
            compute = pipeline_schedule_s([t * again for t in stages], m, w - 1) + weights
        else:
            compute = gpipe_compute_s(m * micro * seq.per_sample_at(micro) * again, w, m) + weights
        boundaries = [x / 1e6 for x in profile.boundary_bytes(balance)]
        if all(d == "cpu" for d in devices):  # CPU stages: one memory, no link to cross
            links = [Link(hw.intra_node.latency_us * 1e-6, hw.memory_bandwidth_gb_s * 1e3)] * (w - 1)
        else:
            links = [link(hw.link(gpu_index(devices[j]), gpu_index(devices[j + 1]))) for j in range(w - 1)]
        return compute + gpipe_comm_s(micro, m, boundaries, links)

    def _torch_memory(self, setup, job, hw, profile, seq):
        ranks = torch_rank_bytes(TorchPipeline.of(setup), job.batch_size, hw, profile, seq)
        return memory_need(hw, sum(ranks) if hw.device_kind == "cpu" else max(ranks))

    def memory(self, setup, job, hw, profile, seq=None):
        if setup.engine == "torch":
            return self._torch_memory(setup, job, hw, profile, seq)
        chunks = setup.chunks
        stages = stage_bytes(profile, pipe_balance(setup, profile, seq, max(1, job.batch_size // chunks)), job.batch_size,
                             chunks, setup.checkpoint)
        return memory_need(hw, sum(stages) if hw.device_kind == "cpu" else max(stages))

    def calibration_group(self, setup) -> str:
        return engine_group(self.name, setup)

    def worker_batch(self, setup, job) -> int:
        return max(1, job.batch_size // setup.chunks)


SPECS = (Pipe(),)
