"""What a ddlx run is, as training, the report and the recommender read it: the names of the
contract (the params, tags and metrics every run logs) and the record types built from them.
Nothing here talks to MLflow (:mod:`ddlx.tracking` does) or imports torch."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from .allocator import SYSTEM
from .command_line import hydra_string, shell_words
from .job import BASELINE, CPU_BASELINE_SETUP, FP32, Job, precision_of

if TYPE_CHECKING:  # a type only: the record layer does not import the predictor's
    from .costmodel.hardware import HardwareSpec
    from .strategies.spec import Setup

# The workload: runs that differ in any of these are not comparable.
WORKLOAD_PARAMS = (
    "model.name", "data.name", "data.image_size", "data.batch_size", "data.num_images",
    "data.num_workers", "data.root", "trainer.limit_train_batches",
)
BASELINE_LABEL = {"cpu": f"{CPU_BASELINE_SETUP} (one core)", "gpu": f"{BASELINE} (one GPU)"}


@dataclass(frozen=True)
class Workload:
    host: str
    model: str
    data: str
    image_size: str
    batch_size: str
    num_images: str
    num_workers: str
    root: str
    limit_train_batches: str
    use_case: str = ""
    cpu_allocator: str = SYSTEM
    precision: str = FP32  # Lightning's trainer.precision, by its full name (precision_of)
    data_cache: str = "none"  # memory: the decoded images kept in memory (ddlx.data.cache); runs before it: none

    @property
    def label(self) -> str:
        name = self.use_case or f"{self.model}/{self.data}"
        allocator = f" cpu_allocator={self.cpu_allocator}" if self.cpu_allocator != SYSTEM else ""
        precision = f" precision={self.precision}" if self.precision != FP32 else ""
        cache = " decoded in memory" if self.data_cache == "memory" else ""
        return f"{name} {self.image_size}px b{self.batch_size}{allocator}{precision}{cache}"

    def baseline_command(self, device: str) -> str:
        over = [f"model={self.model}", f"data={self.data}", f"data.image_size={self.image_size}",
                f"data.batch_size={self.batch_size}", f"data.num_images={self.num_images}",
                f"data.num_workers={self.num_workers}", f"trainer.limit_train_batches={self.limit_train_batches}"]
        if self.root not in ("None", ""):
            over.append(f"data.root={hydra_string(self.root)}")
        if self.cpu_allocator != SYSTEM:
            over.append(f"cpu_allocator={self.cpu_allocator}")
        if self.precision != FP32:
            over.append(f"trainer.precision={self.precision}")
        over.append("data.cache=auto" if self.data_cache == "memory" else "data.cache=none")
        over += ["strategy=sequential", "strategy.threads=1"] if device == "cpu" else ["strategy=sequential", "trainer=gpu"]
        return "python train.py " + shell_words(*over, *measurement_overrides())


@dataclass
class MeasuredRun:
    run_id: str
    status: str
    workload: Workload
    device: str
    strategy: str
    setup: str
    mean_epoch_time_s: float | None
    sweep_id: str = ""
    error: str = ""
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def is_baseline(self) -> bool:
        """A run of what speedups are over: sequential on one core or one GPU, eager (a compiled
        one is a setup of its own, faster or slower by what compiling gives)."""
        return (self.strategy == BASELINE and (self.device != "cpu" or self.setup == CPU_BASELINE_SETUP)
                and not speed_knobs_of(self.params))

    @property
    def setup_as_run(self) -> str:
        """Its setup with the speed knobs it set (``sequential threads=1 compile.enable=True``): the
        report's row, so a compiled run is not taken for an eager one of the same setup."""
        return " ".join([self.setup, *_knob_words(self.params)])

    @cached_property
    def strategy_setup(self) -> Setup:
        """The setup it ran, in the recommender's terms (its spec's :meth:`setup_of_run`), read from
        its params and tags once."""
        from .strategies import STRATEGIES, Setup

        name = self.strategy if self.strategy != "?" else self.params.get("strategy.name", "?")
        return STRATEGIES[name].setup_of_run(self.params, self.tags) if name in STRATEGIES else Setup(name)


# What tells apart workloads whose short labels (model/data, size, batch) coincide.
DISTINGUISHING_FIELDS = ("num_images", "num_workers", "limit_train_batches", "root", "host")


def distinct_labels(workloads: Iterable[Workload]) -> dict[Workload, str]:
    """Each workload's short label, followed by the fields whose values differ among the
    workloads sharing it (``alexnet/firesmall 64px b32 num_images=400``), so no two coincide."""
    by_label: dict[str, set[Workload]] = defaultdict(set)
    for workload in workloads:
        by_label[workload.label].add(workload)
    labels = {}
    for label, group in by_label.items():
        differing = [f for f in DISTINGUISHING_FIELDS if len({getattr(w, f) for w in group}) > 1]
        for workload in group:
            labels[workload] = label + "".join(f" {f}={getattr(workload, f)}" for f in differing)
    return labels


def setup_label(tags: dict[str, str], params: dict[str, str] | None = None) -> str:
    """Strategy and knobs, as its spec names them (:meth:`~ddlx.strategies.spec.StrategySpec.label_knobs`:
    what its plan tagged, but the knobs left out at their defaults, and the params shown only
    when the user set them)."""
    from .strategies import STRATEGIES

    name = tags.get("strategy", "?")
    spec = STRATEGIES.get(name)
    if spec is None:
        return name
    return " ".join([name, *spec.label_knobs(tags, params or {})])


def run_name(params: dict[str, str], tags: dict[str, str]) -> str:
    """What MLflow's runs table shows a run as: its strategy with its knobs and the speed knobs it
    set, model, data, image size, global batch and, unless fp32, its precision (``cpu_mp
    processes=2 alexnet/firesmall 224px b32``), then what else its sweep varies (tag ``swept``),
    so the runs of a sweep are told apart at a glance; the setup first, as the table's narrow
    column shows a name's start."""
    precision = precision_of(tags.get("precision", params.get("trainer.precision")))
    words = [setup_label(tags, params), *_knob_words(params), f"{params.get('model.name')}/{params.get('data.name')}",
             f"{params.get('data.image_size')}px", f"b{params.get('data.batch_size')}", *([precision] if precision != FP32 else [])]
    name = " ".join(words)
    return " ".join([name, *(o.lstrip("+") for o in tags.get("swept", "").split() if not _named(o, name))])


def _named(override: str, name: str) -> bool:
    """Whether the run name ``name`` shows the value ``override`` sets (a sweep's varied setting
    it does not show is added to it: ``optim.lr=0.1``)."""
    key, _, value = override.lstrip("+~").lower().partition("=")
    words = name.lower().split()
    if key in ("model", "data", "model.name", "data.name"):
        return any(value in word.split("/") for word in words)
    if key in ("strategy", "trainer.precision"):  # the setup's first word; the precision unless fp32
        return True
    return bool({f"{key}={value}", f"{key.rsplit('.', 1)[-1]}={value}",
                 *({"data.image_size": [f"{value}px"], "data.batch_size": [f"b{value}"]}.get(key, []))} & set(words))


def _knob_words(params: dict[str, str]) -> list[str]:
    return [f"{key}={value}" for key, value in speed_knobs_of(params).items()]


# Values of a param that mean the same (every batch: Lightning's default, written out or not).
SAME_VALUES = {"trainer.limit_train_batches": {"None": "1.0", "1": "1.0", "": "1.0"}}


def workload_of(params: dict[str, str], tags: dict[str, str]) -> Workload:
    values = (str(params.get(k, "")) for k in WORKLOAD_PARAMS)
    return Workload(tags.get("host", "?"), *(SAME_VALUES.get(k, {}).get(v, v) for k, v in zip(WORKLOAD_PARAMS, values)),
                    use_case=tags.get("use_case", ""), cpu_allocator=params.get("cpu_allocator", SYSTEM),
                    precision=precision_of(tags.get("precision", params.get("trainer.precision"))),
                    data_cache=tags.get("data_cache", "none"))


def to_measured_run(run) -> MeasuredRun:
    """One MLflow run (``mlflow.entities.Run``) as the report and the recommender see it."""
    return measured_run(run.info.run_id, run.info.status, run.data.params, run.data.tags, run.data.metrics)


def measured_run(run_id: str, status: str, params: dict[str, str], tags: dict[str, str],
                 metrics: dict[str, float]) -> MeasuredRun:
    """A run from its id, status, params, tags and (last) metrics: as MLflow holds it, or as
    :func:`export_run` wrote it."""
    p, t, m = params, tags, metrics
    return MeasuredRun(
        run_id=run_id,
        status=status,
        workload=workload_of(p, t),
        device=t.get("accelerator", p.get("trainer.accelerator", "cpu")),
        strategy=t.get("strategy", "?"),
        setup=setup_label(t, p),
        mean_epoch_time_s=m.get("mean_epoch_time_s"),
        sweep_id=t.get("sweep_id", ""),
        error=t.get("error", ""),
        params=dict(p),
        tags=dict(t),
        metrics=dict(m),
    )


def export_run(run: MeasuredRun) -> dict:
    """A run as plain data (JSON), for :func:`measured_run` to read back: a fixture of real runs."""
    return {"run_id": run.run_id, "status": run.status, "params": run.params,
            "tags": {k: v for k, v in run.tags.items() if not k.startswith("mlflow.")}, "metrics": run.metrics}


def job_of_run(run: MeasuredRun) -> Job:
    """The training job a finished run trained (its global batch, its epoch's samples)."""
    p, m = run.params, run.metrics
    return Job(
        model=p["model.name"], data=p["data.name"], num_classes=int(p["data.num_classes"]),
        channels=int(p["data.channels"]), image_size=int(p["data.image_size"]),
        batch_size=int(p["data.batch_size"]),
        train_samples=round(m["mean_samples_per_s"] * m["mean_epoch_time_s"]),
        num_workers=int(p.get("data.num_workers", 0)), cpu_allocator=run.workload.cpu_allocator,
        precision=run.workload.precision, data_cache=run.workload.data_cache,
    )


def measured_per_batch_s(run: MeasuredRun) -> float:
    """Seconds per global batch of a finished run: its mean epoch time over its steps."""
    job = job_of_run(run)
    return run.metrics["mean_epoch_time_s"] / job.steps


# A run whose first epoch is in its mean measured steady state only over this many steps: start-up
# (thread pools, allocator, loader workers, first-touch of the weights) then weighs a few percent.
MIN_STEADY_STEPS = 100


def not_measured(run: MeasuredRun) -> tuple[str, str] | None:
    """Why a run's times are not a steady-state measurement, as (kind, the reason in full); None
    when they are: :func:`not_counted` on what its record holds."""
    unmeasured = run.tags.get("not_measured_because", "no reason recorded") if run.tags.get("measured") == "false" else None
    return not_counted(run.status, unmeasured, run.metrics, int(run.params.get("measure.warmup_epochs", "0") or 0),
                       int(run.params.get("data.batch_size", "0") or 0), diverged="diverged" in run.tags)


def not_counted(status: str, unmeasured: str | None, measured: Mapping[str, float], warmup_epochs: int,
                batch_size: int, diverged: bool = False) -> tuple[str, str] | None:
    """The one rule of the report and the recommender, as (kind, the reason in full), None for a run
    they count: a finished run, measured the ddlx way (``unmeasured``: why not), whose loss stayed
    finite (``diverged``: it did not), whose mean either leaves out a warm-up epoch or spans at least
    :data:`MIN_STEADY_STEPS` steps. ``measured``: its timer's summary. Read from a run's record
    (:func:`not_measured`) and said at a run's end."""
    if status != "FINISHED":
        return f"status {status}", f"status {status}"
    if unmeasured is not None:
        return "not a measurement", f"not a measurement ({unmeasured})"
    if diverged:  # near a blow-up, values run into denormals, which CPUs compute several times slower
        return "diverged", "diverged: its train_loss went to NaN or inf, and the epochs before may be slowed by denormal values"
    if not {"mean_epoch_time_s", "mean_samples_per_s"} <= set(measured):
        return "no mean_epoch_time_s", "no mean_epoch_time_s"
    why = short_of_steady_state(warmup_epochs, measured, batch_size)
    return None if why is None else ("not steady state", why)


def short_of_steady_state(warmup_epochs: int, measured: Mapping[str, float], batch_size: int) -> str | None:
    """Why a run's mean is not steady state (None: it is): ``measured`` is its timer's summary
    (mean_epoch_time_s, mean_samples_per_s, measured_epochs), ``batch_size`` its data.batch_size."""
    if warmup_epochs >= 1 and measured.get("measured_epochs", 0) >= 1:
        return None
    epochs = measured.get("measured_epochs", 1)
    # An epoch's steps: its samples over the batch, its last batch short (the loaders keep it), so
    # that train.py's default, 5 epochs of 633 images in batches of 32, is its 100 steps, not 98.9.
    samples = round(measured["mean_samples_per_s"] * measured["mean_epoch_time_s"])
    steps = epochs * math.ceil(samples / batch_size) if batch_size else 0
    if steps >= MIN_STEADY_STEPS:
        return None
    return (f"not steady state: no warm-up epoch left out (measure.warmup_epochs=0) and {steps:.0f} "
            f"measured steps < {MIN_STEADY_STEPS}; measure with {' and '.join(measurement_overrides())}")


def measurement_overrides(steps_per_epoch: float | None = None) -> list[str]:
    """The shortest train.py run that counts as a steady-state measurement (:func:`not_measured`):
    one epoch where an epoch has :data:`MIN_STEADY_STEPS` steps or more, else a warm-up epoch left
    out and two timed (``None``: the epoch's steps unknown)."""
    if steps_per_epoch is not None and steps_per_epoch >= MIN_STEADY_STEPS:
        return ["trainer.max_epochs=1"]
    return ["measure.warmup_epochs=1", "trainer.max_epochs=3"]


def not_measured_because(run: MeasuredRun) -> str | None:
    """The reason in full of :func:`not_measured` (None: a steady-state measurement)."""
    why = not_measured(run)
    return why[1] if why else None


# PyTorch 2's speed knobs at their defaults: the recommender's models are of eager, NCHW runs with
# torch's own optimizer step; a run with another is not evidence of those.
EAGER_DEFAULTS = {"compile.enable": "False", "model.memory_format": "contiguous", "optim.implementation": "auto"}


def speed_knobs_of(params: dict[str, str]) -> dict[str, str]:
    """The speed knobs a run's ``params`` set off their defaults (runs from before a knob existed
    count as its default)."""
    return {key: params[key] for key, default in EAGER_DEFAULTS.items() if params.get(key, default) != default}


def unmodelled(run: MeasuredRun) -> str | None:
    """The speed knob of ``run`` the recommender does not model yet (None: all at their defaults)."""
    return next((f"{key}={value}" for key, value in speed_knobs_of(run.params).items()), None)


def usable(run: MeasuredRun) -> bool:
    """A steady-state measurement (:func:`not_measured`) with the params a prediction needs, of an
    eager run (:func:`unmodelled`)."""
    need = ("model.name", "data.num_classes", "data.channels", "data.image_size", "data.batch_size")
    return not_measured(run) is None and unmodelled(run) is None and all(k in run.params for k in need)


def left_out(runs: Iterable[MeasuredRun]) -> dict[str, list[MeasuredRun]]:
    """The runs the recommender leaves out (:func:`not_measured`, :func:`unmodelled`), by the kind of reason."""
    out: dict[str, list[MeasuredRun]] = defaultdict(list)
    for run in runs:
        why = not_measured(run)
        if why is not None:
            out[why[0]].append(run)
        elif unmodelled(run) is not None:
            out["with a speed knob the recommender does not model yet (compile, channels_last, optimizer implementation)"].append(run)
    return dict(out)


def on_hardware(run: MeasuredRun, hw: HardwareSpec) -> bool:
    """A run measured on ``hw``: tagged with its name, or taken on its host (hw=local)."""
    return run.tags.get("hw") == hw.name or (bool(hw.host) and run.tags.get("host") == hw.host)


def same_network(run: MeasuredRun, job: Job) -> bool:
    p = run.params
    return (p.get("model.name") == job.model and p.get("data.image_size") == str(job.image_size)
            and p.get("data.num_classes") == str(job.num_classes) and p.get("data.channels") == str(job.channels))
