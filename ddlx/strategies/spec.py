"""What ddlx knows about a strategy, in one object: :class:`StrategySpec`.

Each ``ddlx/strategies/<name>.py`` defines the spec of its strategy (``SPECS``): its knobs (a
dataclass: the schema of the ``strategy`` option of that name), how it builds the Trainer's
arguments, how its setup is read back from a run, its candidate setups on a described machine,
and its time and memory models (built from :mod:`ddlx.costmodel.costs` and
:mod:`ddlx.costmodel.perf_models`). Nothing outside a spec switches on a strategy's name.

Nothing here imports torch at import time: the specs are read when the config is composed.
"""
from __future__ import annotations

import functools
import logging
import os
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..compiling import WHOLE_MODEL
from ..errors import ConfigError
from ..process import launch_rank

if TYPE_CHECKING:
    from ..job import Job
    from ..models import LayeredModel
    from ..costmodel.costs import Cost, MemoryNeed, SequentialTime
    from ..costmodel.hardware import HardwareSpec
    from ..costmodel.profile import ModelProfile

log = logging.getLogger(__name__)

# A rank that waits longer than this for the others fails instead of hanging (every multi-process spec's default).
TIMEOUT_S = 300.0


@dataclass
class StrategyPlan:
    """What the Trainer needs to run a strategy, and what the run is tagged with."""

    trainer_kwargs: dict[str, Any]
    tags: dict[str, str] = field(default_factory=dict)
    data_parallel: int = 1  # processes sharing the global batch (data.batch_size)
    replicas_per_machine: int = 1  # model copies in this machine's memory, for the memory check
    # Trainer arguments the strategy cannot honour, with why and what to use instead: refused when set.
    refused_trainer_args: dict[str, str] = field(default_factory=dict)
    # trainer.precision values (full names) it cannot train in, with why and what to use instead.
    refused_precisions: dict[str, str] = field(default_factory=dict)
    recompute: bool = False  # activation checkpointing at the cut points (the memory check counts it)


@dataclass(frozen=True)
class Setup:
    """A strategy with the knob values a prediction or a measured run used. Each spec's setups are
    instances of its own frozen dataclass (:attr:`StrategySpec.setup_type`): a typed field for each
    knob that names a setup, built from its config's fields, so a model reads ``setup.chunks`` and a
    misspelt knob is an error, not a silent default. This base alone stands for a strategy the
    registry lacks (a run logged by a strategy since removed)."""

    strategy: str

    @property
    def knobs(self) -> tuple[tuple[str, object], ...]:
        """The knobs that name it, in its spec's order: what its label, its JSON and its train.py
        overrides show (a knob its role leaves out at this value is not among them)."""
        spec = getattr(type(self), "_spec", None)
        return spec.naming(self) if spec is not None else ()

    def values(self) -> dict[str, object]:
        """Every knob field with its value (what :meth:`StrategySpec.setup` takes back)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "strategy"}

    @property
    def label(self) -> str:
        return " ".join([self.strategy, *(f"{k}={_render(v)}" for k, v in self.knobs)])

    def __reduce__(self):
        # A spec's setup type is made at run time, not importable by name: rebuilt through its spec.
        if getattr(type(self), "_spec", None) is None:
            return Setup, (self.strategy,)
        return _setup_of, (self.strategy, self.values())


def _setup_of(strategy: str, values: dict[str, object]) -> Setup:
    from . import STRATEGIES

    return STRATEGIES[strategy].setup(**values)


def _render(value) -> str:
    """A knob's value as train.py's command line takes it (null, true, [cpu,cpu])."""
    if isinstance(value, (list, tuple)):
        return f"[{','.join(map(str, value))}]"
    return {None: "null", True: "true", False: "false"}.get(value, str(value)) if isinstance(value, (bool, type(None))) \
        else str(value)


class StrategySpec:
    """One strategy. A subclass sets the class attributes and implements the methods below."""

    name: ClassVar[str]
    config: ClassVar[type]  # its knobs: a dataclass with :func:`ddlx.knobs.knob` fields
    order: ClassVar[int]  # its place in lists of setups (candidates, tables)
    splits_batch: ClassVar[bool] = False  # its workers each train a share of every batch (one calibration)
    # Counts the launcher sets, not train.py (mpirun -np: ranks): a setup's first knobs, read from the run's tags.
    launcher_knobs: ClassVar[tuple[str, ...]] = ()
    # What its plan resolves beyond its knobs, tagged and shown first in a run's label (mpi: the nodes mpirun spread over).
    resolved_tags: ClassVar[tuple[str, ...]] = ()

    def plan(self, cfg, accelerator: str, model: LayeredModel, data) -> StrategyPlan:
        """The Trainer's arguments for ``cfg`` (its knobs, checked), on ``model`` (the meta device is enough)."""
        raise NotImplementedError

    def refused_precisions(self, knobs) -> dict[str, str]:
        """The trainer.precision values (full names) it cannot train in with ``knobs`` (its config,
        or a :class:`Setup`: both have its knobs as attributes), each with why and what to use instead."""
        return {}

    def compile_unit(self, knobs) -> str:
        """What ``compile.enable`` compiles under ``knobs``: :data:`~ddlx.compiling.WHOLE_MODEL`, or
        :data:`~ddlx.compiling.EACH_LAYER` where the strategy shards or stages the model by layers;
        a :class:`ConfigError` with the reason where it cannot take it."""
        return WHOLE_MODEL

    # Knobs naming its setups beyond its config's and its launcher's: (name, type, default), shown
    # away from their default (sequential's trainer=gpu: one GPU).
    extra_setup_knobs: ClassVar[tuple[tuple[str, Any, Any], ...]] = ()

    @functools.cached_property
    def setup_type(self) -> type[Setup]:
        """Its setups' frozen dataclass: its launcher knobs (counts), then its config's setup knobs
        (:class:`~ddlx.knobs.SetupRole`) with their types (resolved in the config's module) and
        defaults, then :attr:`extra_setup_knobs`."""
        hints = typing.get_type_hints(self.config)
        knobs = [(key, int, field(default=1)) for key in self.launcher_knobs]
        for f in self.setup_fields().values():
            if f.default is MISSING:  # a list or dict default (a factory): unhashable, and a setup is a key
                raise TypeError(f"strategy={self.name}: setup knob {f.name} needs a hashable default (a tuple, not a list)")
            knobs.append((f.name, hints[f.name], field(default=f.default)))
        knobs += [(name, kind, field(default=default)) for name, kind, default in self.extra_setup_knobs]
        title = "".join(part.title() for part in self.name.split("_"))
        return make_dataclass(f"{title}Setup", knobs, bases=(Setup,), frozen=True, kw_only=True,
                              namespace={"_spec": self, "__module__": type(self).__module__})

    def setup(self, **knobs) -> Setup:
        """The setup of these knob values, as a candidate or a measured run names it. A knob not
        given takes its default, and so does one whose role's condition does not hold (``schedule``
        without ``engine=torch``): setups that run alike compare equal."""
        values = {f.name: f.default for f in fields(self.setup_type) if f.name != "strategy"}
        unknown = set(knobs) - set(values)
        if unknown:
            raise ValueError(f"strategy={self.name} has no setup knob {', '.join(sorted(unknown))}; "
                             f"its setup knobs are {', '.join(values)}")
        values.update({key: tuple(v) if isinstance(v, list) else v for key, v in knobs.items()})
        roles, reset = self.setup_fields(), True
        while reset:  # until none is left to reset: a condition may name a knob reset after it
            reset = False
            for name, f in roles.items():
                if values[name] != f.default and not f.metadata["setup"].holds(values.get):
                    values[name], reset = f.default, True
        return self.setup_type(strategy=self.name, **values)

    def naming(self, setup: Setup) -> tuple[tuple[str, object], ...]:
        """The knobs that name ``setup`` (:attr:`Setup.knobs`): its launcher knobs, then each setup
        knob its role shows at this value, in field order, then the extra knobs away from their default."""
        out = [(key, getattr(setup, key)) for key in self.launcher_knobs]
        for name, f in self.setup_fields().items():
            role, value = f.metadata["setup"], getattr(setup, name)
            if role.holds(lambda key: getattr(setup, key)) and not (role.unless_default and value == f.default):
                out.append((name, value))
        return (*out, *((name, getattr(setup, name)) for name, _, default in self.extra_setup_knobs
                        if getattr(setup, name) != default))

    def with_knobs(self, setup: Setup, **changes) -> Setup:
        """``setup`` with some knobs changed (``checkpoint="always"``: what fits when it does not)."""
        return self.setup(**{**setup.values(), **changes})

    def setup_of_run(self, params: dict[str, str], tags: dict[str, str]) -> Setup:
        """The setup a measured run of this strategy used, in the terms of :meth:`candidates`: each
        setup knob as its plan tagged it (the resolved value), else as its params give it (not for
        a knob only its plan resolves), else what a run from before the knob used."""
        knobs = {key: int(tags.get(key, 1)) for key in self.launcher_knobs}
        for name, f in self.setup_fields().items():
            role = f.metadata["setup"]
            text = tags.get(name, None if role.resolved else params.get(f"strategy.{name}"))
            knobs[name] = parsed(f, text) if text is not None else (f.default if role.absent is None else parsed(f, role.absent))
        return self.setup(**knobs)

    def label_knobs(self, tags: dict[str, str], params: dict[str, str]) -> list[str]:
        """``key=value`` of a run's label: what its plan resolved (:attr:`resolved_tags`), then each
        knob as its field's ``label`` says (:func:`ddlx.knobs.knob`), in field order."""
        shown = [f"{key}={tags[key]}" for key in self.resolved_tags if tags.get(key) not in (None, "", "None")]
        for f in fields(self.config):
            how, value = f.metadata.get("label", "tag"), None
            if f.name == "name" or how == "never":
                continue
            if how == "when_set":
                value = params.get(f"strategy.{f.name}")
            elif not (f.metadata.get("quiet") and tags.get(f.name) == str(f.default)):
                value = tags.get(f.name)
            if value not in (None, "", "None"):
                shown.append(f"{f.name}={value}")
        return shown

    def setup_fields(self) -> dict[str, Field]:
        """Its config's knobs that name a setup (those with a :class:`~ddlx.knobs.SetupRole`): what
        the recommender varies and its models read."""
        return {f.name: f for f in fields(self.config) if f.metadata.get("setup") is not None}

    def candidates(self, hw: HardwareSpec, job: Job) -> list[Setup]:
        """The setups of it worth predicting on ``hw``, with the knobs a user would try."""
        return []

    def accepts(self, setup: Setup, job: Job) -> bool:
        """Whether ``setup`` can train ``job`` (its global batch) at all."""
        return True

    def cost(self, setup: Setup, job: Job, hw: HardwareSpec, profile: ModelProfile, seq: SequentialTime) -> Cost:
        """Modelled seconds of one global batch, before calibration."""
        raise NotImplementedError(f"no performance model for strategy {self.name!r}")

    def memory(self, setup: Setup, job: Job, hw: HardwareSpec, profile: ModelProfile,
               seq: SequentialTime | None = None) -> MemoryNeed:
        """Memory per device (per node's RAM on CPU, where its processes share it). ``seq``, where
        known, finds a pipeline's cut as :meth:`cost` does; without it, the cut of the FLOPs."""
        raise NotImplementedError(f"no memory model for strategy {self.name!r}")

    def overrides(self, setup: Setup) -> str:
        """The train.py overrides that run ``setup`` (what its launcher sets is not one of them)."""
        parts = [f"strategy={self.name}"]
        for key, value in setup.knobs:
            if key in self.launcher_knobs or value is None:  # unset: the knob's default resolves it
                continue
            parts.append(f"trainer={value}" if key == "trainer" else f"strategy.{key}={_render(value)}")
        return " ".join(parts)

    def launcher(self, setup: Setup, hw: HardwareSpec) -> str:
        """What starts ``python train.py`` for ``setup`` on ``hw`` ('': train.py itself, ddlx
        starting any other ranks on the machine)."""
        return ""

    def places(self, setup: Setup, hw: HardwareSpec) -> bool:
        """Whether ``setup``'s ranks have a place on ``hw`` as its launcher would start them (a
        candidate tried with ``candidates.<strategy>.<knob>`` may not)."""
        return True

    def starts_ranks(self, cfg) -> bool:
        """Whether a run of its config ``cfg`` has ddlx's launcher start ranks beside train.py's
        process (what the rank fork server is for)."""
        return (getattr(cfg, "processes", None) or 1) > 1

    def data_parallel(self, cfg) -> int | None:
        """Processes sharing the global batch in a run of its config ``cfg`` (None: known only
        once launched); read before torch loads (:mod:`ddlx.preflight`) and by :meth:`plan`."""
        return getattr(cfg, "processes", None) or 1

    def needs_gpu(self, cfg, accelerator: str) -> bool:
        """Whether a run of its config ``cfg`` on ``accelerator`` (trainer.accelerator) needs a GPU."""
        devices = getattr(cfg, "devices", None)
        listed = [] if devices is None or isinstance(devices, str) else [str(d) for d in devices]
        return accelerator in ("gpu", "cuda") or any(d.startswith("cuda") for d in listed)

    def no_gpu_problem(self, cfg, accelerator: str) -> str:
        """Why a run of ``cfg`` cannot run on a machine without a GPU, and what runs instead."""
        if accelerator in ("gpu", "cuda"):
            return (f"trainer.accelerator={accelerator}, but this machine has no GPU (no NVIDIA or AMD device, or "
                    f"CUDA_VISIBLE_DEVICES hides them); train on the CPU with trainer=default")
        return (f"strategy.devices={_render(list(cfg.devices))} names CUDA devices, but this machine has no GPU; "
                f"use strategy.devices=auto (its stages on the CPU)")

    def processes(self, setup: Setup) -> int:
        """Training processes (each with its own data loader)."""
        return getattr(setup, "processes", None) or 1

    def devices(self, setup: Setup) -> int:
        """Devices the setup trains on (what renting it costs): its listed devices where it names
        them (a pipeline's stages, a split's halves), else one per process."""
        listed = getattr(setup, "devices", None)
        return len(listed) if isinstance(listed, tuple) else self.processes(setup)

    def smallest_piece(self, cfg, batch: int) -> int:
        """The fewest samples a layer trains on at once where a process of a run of its config
        ``cfg`` trains a batch of ``batch`` (a micro-batch, a thread's share)."""
        return batch

    def knob_problems(self, cfg) -> list[str]:
        """Knobs of its config ``cfg`` set where they do nothing (a composite's knob of another
        ``local``), each with the fix; read before torch loads."""
        return []

    def channels_last_problem(self, cfg) -> str | None:
        """Why a run of its config ``cfg`` cannot keep its weights in channels_last
        (model.memory_format), with what to use instead; None where it can."""
        return None

    def batch_problem(self, cfg, batch: int, batch_size: int, replicas: int, per_worker: bool = False) -> str | None:
        """Why each of ``replicas`` data-parallel processes of a run of its config ``cfg`` cannot
        train a batch of ``batch``, its share of the user's ``data.batch_size`` (``per_worker``:
        ``data.batch_per=worker``, the batch itself), with the fix (a pipeline's micro-batches need
        a sample each, PyTorch's equal ones); None where it can. Nothing it reads needs torch."""
        return None

    def takes_batch(self, cfg, batch: int) -> bool:
        """Whether a process of a run of its config ``cfg`` can train a batch of ``batch``."""
        return self.batch_problem(cfg, batch, batch, 1) is None

    def worker_batch(self, setup: Setup, job: Job) -> int:
        """Samples one worker allocates activations for in a step."""
        return job.batch_size // self.processes(setup)

    def calibration_group(self, setup: Setup) -> str:
        """Setups whose measured/modelled ratios are pooled for calibration (one group per
        strategy, unless it has setups that work otherwise)."""
        return self.name


# ---- helpers the specs' plans share -----------------------------------------------------------


def parsed(f: Field, text: str):
    """A knob's value from its run tag or param (text), by its field's type: a device list is
    tagged as ``cpu,cpu``."""
    if text in ("None", ""):
        return None
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if "int" in kind:
        return int(text)
    if "float" in kind:
        return float(text)
    if "bool" in kind:
        return text == "True"
    return tuple(text.split(",")) if kind == "Any" and "," in text else text


def no_loss_scaling(why: str) -> dict[str, str]:
    """``refused_precisions`` of a strategy whose ranks each see only part of the gradients
    (``why``): Lightning's 16-mixed loss scaler would skip steps and change its scale on some
    ranks and not others."""
    return {"16-mixed": f"16-mixed scales the loss and skips the steps whose gradients overflow, but {why}, so its ranks "
                        f"would disagree on the skip and the scale; use trainer.precision=bf16-mixed (no loss scaling), "
                        f"or strategy=ddp_gloo / ddp_nccl for 16-mixed"}


def cores() -> int:
    return len(os.sched_getaffinity(0))


def require_cpu(name: str, accelerator: str) -> None:
    if accelerator not in ("cpu", "auto"):
        raise ConfigError(f"strategy={name} runs on CPU, but trainer.accelerator={accelerator}; use trainer.accelerator=cpu")


def warn_oversubscription(name: str, workers: int, what: str) -> None:
    if workers > cores() and launch_rank() == 0:  # every rank plans the job: said once
        log.warning(
            "strategy=%s asks for %d %s but only %d cores are available: they will oversubscribe and run slower",
            name, workers, what, cores(),
        )


def accelerator_of(device) -> str:
    return "gpu" if device.type == "cuda" else "cpu"


def refuse_compile(strategy: str, why: str, instead: str) -> None:
    """The one-line refusal of ``compile.enable=true`` under a strategy that cannot take it."""
    raise ConfigError(f"compile.enable=true with strategy={strategy}: {why}; {instead}, or compile.enable=false")
