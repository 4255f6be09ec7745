"""The speedup report: source 000 Tables 1-3 for whatever was measured, read from MLflow runs.

Runs are grouped by *workload* (host, model, dataset, image size, global batch, dataset size,
loader workers, batches per epoch) and device kind (cpu / gpu). In each group the baseline is
``sequential`` on one device: one CPU core (``threads=1``) or one GPU. Speedup is the
baseline's mean epoch time over the setup's (source 003, section 2); with several runs of one
setup the median of their ``mean_epoch_time_s`` is used. Only these names are read: the
params (flattened config), tags and metrics every ddlx run logs.
"""
from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from ..allocator import SYSTEM

# The workload: runs that differ in any of these are not comparable.
WORKLOAD_PARAMS = (
    "model.name", "data.name", "data.image_size", "data.batch_size", "data.num_images",
    "data.num_workers", "data.root", "trainer.limit_train_batches",
)
# Tags that name a setup's knobs, in the order they are printed.
KNOB_TAGS = (
    "threads", "processes", "ranks", "nodes", "backend", "comm_hook", "bucket_cap_mb",
    "local", "devices", "cut_point", "chunks", "checkpoint",
)
DEFAULT_KNOBS = {"comm_hook": "none", "checkpoint": "never"}
BASELINE_LABEL = {"cpu": "sequential threads=1 (one core)", "gpu": "sequential (one GPU)"}


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

    @property
    def label(self) -> str:
        name = self.use_case or f"{self.model}/{self.data}"
        allocator = f" cpu_allocator={self.cpu_allocator}" if self.cpu_allocator != SYSTEM else ""
        return f"{name} {self.image_size}px b{self.batch_size}{allocator}"

    def baseline_command(self, device: str) -> str:
        over = [f"model={self.model}", f"data={self.data}", f"data.image_size={self.image_size}",
                f"data.batch_size={self.batch_size}", f"data.num_images={self.num_images}",
                f"data.num_workers={self.num_workers}", f"trainer.limit_train_batches={self.limit_train_batches}"]
        if self.root not in ("None", ""):
            over.append(f"data.root={self.root}")
        if self.cpu_allocator != SYSTEM:
            over.append(f"cpu_allocator={self.cpu_allocator}")
        over += ["strategy=sequential", "strategy.threads=1"] if device == "cpu" else ["strategy=sequential", "trainer=gpu"]
        return "python train.py " + " ".join(over)


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
        return self.strategy == "sequential" and (self.device != "cpu" or self.setup == "sequential threads=1")


@dataclass
class Row:
    workload: Workload
    device: str
    setup: str
    runs: int
    mean_epoch_time_s: float
    speedup: float | None


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    missing_baselines: list[str] = field(default_factory=list)
    failed: list[MeasuredRun] = field(default_factory=list)
    unmeasured: list[MeasuredRun] = field(default_factory=list)
    labels: dict[Workload, str] = field(default_factory=dict)

    def label(self, workload: Workload) -> str:
        return self.labels.get(workload, workload.label)


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
    """Strategy and knobs; a pipeline's balance only when the user chose one (the resolved
    default differs per model and would make every model's pipe a different setup)."""
    knobs = [f"{k}={tags[k]}" for k in KNOB_TAGS if tags.get(k) not in (None, "", "None", DEFAULT_KNOBS.get(k))]
    balance = (params or {}).get("strategy.balance")
    if tags.get("strategy") == "pipe" and balance not in (None, "None"):
        knobs.append(f"balance={balance}")
    return " ".join([tags.get("strategy", "?"), *knobs])


def workload_of(params: dict[str, str], tags: dict[str, str]) -> Workload:
    return Workload(tags.get("host", "?"), *(str(params.get(k, "")) for k in WORKLOAD_PARAMS),
                    use_case=tags.get("use_case", ""), cpu_allocator=params.get("cpu_allocator", SYSTEM))


def to_measured_run(run) -> MeasuredRun:
    """One MLflow run (``mlflow.entities.Run``) as the report sees it."""
    p, t, m = run.data.params, run.data.tags, run.data.metrics
    return MeasuredRun(
        run_id=run.info.run_id,
        status=run.info.status,
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


def store_exists(tracking_uri: str) -> bool:
    """False for an SQLite store whose file is not there (opening it would create an empty one)."""
    return not tracking_uri.startswith("sqlite:///") or Path(tracking_uri[len("sqlite:///"):]).is_file()


def load_runs(tracking_uri: str, experiments: list[str], sweep_id: str | None = None) -> list[MeasuredRun]:
    """Every run of ``experiments`` (or only those of ``sweep_id``; ``latest`` = the newest sweep)."""
    from mlflow.tracking import MlflowClient

    if not store_exists(tracking_uri):
        raise ValueError(f"no MLflow store at {tracking_uri}: train first (python train.py ...) or pass --tracking-uri")
    from ..tracking import close_vanished_runs

    client = MlflowClient(tracking_uri)
    ids = []
    for name in experiments:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise ValueError(f"no MLflow experiment named {name!r} at {tracking_uri}")
        ids.append(exp.experiment_id)
    close_vanished_runs(client, ids)  # a run whose process is gone is FAILED, not still running
    found = client.search_runs(ids, max_results=50000, order_by=["attributes.start_time DESC"])
    if sweep_id == "latest":
        sweep_id = next((r.data.tags["sweep_id"] for r in found if r.data.tags.get("sweep_id")), None)
        if sweep_id is None:
            raise ValueError("sweep_id=latest: none of these runs belongs to a sweep (python train.py -m ...)")
    runs = [to_measured_run(r) for r in found]
    if sweep_id is not None:
        runs = [r for r in runs if r.sweep_id == sweep_id]
        if not runs:
            raise ValueError(f"no runs tagged sweep_id={sweep_id!r} in experiments {experiments}")
    return runs


def build_report(runs: list[MeasuredRun]) -> Report:
    report = Report(labels=distinct_labels(run.workload for run in runs))
    groups: dict[tuple[Workload, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    baselines: dict[tuple[Workload, str], list[float]] = defaultdict(list)
    for run in runs:
        if run.status == "FAILED":
            report.failed.append(run)
        elif run.status != "FINISHED" or run.mean_epoch_time_s is None or run.tags.get("measured") == "false":
            report.unmeasured.append(run)
        else:
            groups[run.workload, run.device][run.setup].append(run.mean_epoch_time_s)
            if run.is_baseline:
                baselines[run.workload, run.device].append(run.mean_epoch_time_s)
    for (workload, device), setups in sorted(groups.items(), key=lambda kv: (report.label(kv[0][0]), kv[0][1])):
        base = median(baselines[workload, device]) if baselines[workload, device] else None
        if base is None:
            report.missing_baselines.append(
                f"{report.label(workload)} on {device} ({workload.host}): no finished {BASELINE_LABEL.get(device, 'sequential')} "
                f"run, so no speedups; measure it with: {workload.baseline_command(device)}"
            )
        for setup, times in sorted(setups.items(), key=lambda kv: median(kv[1]), reverse=True):
            t = median(times)
            report.rows.append(Row(workload, device, setup, len(times), t, base / t if base else None))
    return report


# ---- rendering ---------------------------------------------------------------------------

COLUMNS = ("use case", "device", "setup", "runs", "mean epoch s", "speedup")


def _cells(report: Report, row: Row) -> list[str]:
    speedup = f"{row.speedup:.2f}x" if row.speedup is not None else "n/a"
    return [report.label(row.workload), row.device, row.setup, str(row.runs), f"{row.mean_epoch_time_s:.2f}", speedup]


def to_text(report: Report) -> str:
    table = [list(COLUMNS)] + [_cells(report, r) for r in report.rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + _notes(report))


def to_markdown(report: Report) -> str:
    """The long table, then the paper's shape: setups x use cases (per device kind), speedups."""
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(_cells(report, r)) + " |" for r in report.rows]
    for device in sorted({r.device for r in report.rows}):
        rows = [r for r in report.rows if r.device == device]
        cases = sorted({report.label(r.workload) for r in rows})
        setups = sorted({r.setup for r in rows})
        value = {(r.setup, report.label(r.workload)): r.speedup for r in rows}
        out += ["", f"Speedup over {BASELINE_LABEL.get(device, 'sequential')} on {device}:", "",
                "| setup | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
        for setup in setups:
            cells = [value.get((setup, c)) for c in cases]
            out.append(f"| {setup} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells) + " |")
    return "\n".join(out + [""] + _notes(report)) + "\n"


def to_csv(report: Report) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["host", "model", "data", "image_size", "batch_size", "num_images", "device", "setup", "runs",
                     "mean_epoch_time_s", "speedup"])
    for r in report.rows:
        w = r.workload
        writer.writerow([w.host, w.model, w.data, w.image_size, w.batch_size, w.num_images, r.device, r.setup, r.runs,
                         f"{r.mean_epoch_time_s:.4f}", "" if r.speedup is None else f"{r.speedup:.4f}"])
    return buf.getvalue()


def _notes(report: Report) -> list[str]:
    notes = []
    for line in report.missing_baselines:
        notes.append(f"missing baseline: {line}")
    for run in report.failed:
        notes.append(f"failed: {report.label(run.workload)} {run.setup} (run {run.run_id}): {run.error or 'no error recorded'}")
    for run in report.unmeasured:
        why = (f"status {run.status}" if run.status != "FINISHED" else
               f"not a measurement ({run.tags['not_measured_because']})" if run.tags.get("measured") == "false" else
               "no mean_epoch_time_s")
        notes.append(f"not counted: {report.label(run.workload)} {run.setup} (run {run.run_id}): {why}")
    return notes


def plot(report: Report, path: Path) -> Path:
    """Grouped bars: one group per use case and device, one bar per setup, height = speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.speedup is not None]
    groups = sorted({(report.label(r.workload), r.device) for r in rows})
    setups = sorted({r.setup for r in rows})
    fig, ax = plt.subplots(figsize=(max(6.0, 3 + 0.4 * len(groups) * len(setups)), 4.5))
    width = 0.8 / max(1, len(setups))
    for i, setup in enumerate(setups):
        xs, ys = [], []
        for g, (label, device) in enumerate(groups):
            match = [r.speedup for r in rows if (report.label(r.workload), r.device, r.setup) == (label, device, setup)]
            if match:
                xs.append(g + i * width)
                ys.append(match[0])
        bars = ax.bar(xs, ys, width, label=setup)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [f"{lbl}\n{dev}" for lbl, dev in groups])
    ax.set_ylabel("speedup over one device")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(report: Report, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "speedup.md", out_dir / "speedup.csv", out_dir / "speedup.png"]
    files[0].write_text(to_markdown(report))
    files[1].write_text(to_csv(report))
    plot(report, files[2])
    return files


def log_to_mlflow(tracking_uri: str, files: list[Path], sources: dict[str, str], experiment: str = "reports") -> str:
    """One run in the ``reports`` experiment holding the report's files, tagged with what it read."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from ..tracking import artifacts_beside_store, experiment_id

    client = MlflowClient(tracking_uri)
    exp_id = experiment_id(client, experiment, tracking_uri, artifacts_beside_store(tracking_uri), setting=None)
    run = client.create_run(exp_id, tags={k: v for k, v in sources.items() if v}, run_name="speedup-report")
    for path in files:
        client.log_artifact(run.info.run_id, str(path))
    client.set_terminated(run.info.run_id, mlflow.entities.RunStatus.to_string(mlflow.entities.RunStatus.FINISHED))
    return run.info.run_id
