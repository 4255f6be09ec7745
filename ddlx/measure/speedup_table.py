"""The speedup report: Lerat et al. 2022 Tables 1-3 for whatever was measured, read from MLflow runs.

Runs are grouped by *workload* (host, model, dataset, image size, global batch, dataset size,
loader workers, batches per epoch) and device kind (cpu / gpu). In each group the baseline is
``sequential`` on one device: one CPU core (``threads=1``) or one GPU. Speedup is the
baseline's mean epoch time over the setup's (the Lerat et al. entry, section 2); with several runs of one
setup the median of their ``mean_epoch_time_s`` is used. Only these names are read: the
params (flattened config), tags and metrics every ddlx run logs.
"""
from __future__ import annotations

import csv
import io
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from ..records import (
    BASELINE_LABEL,
    MeasuredRun,
    Workload,
    distinct_labels,
    not_measured_because,
)


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


def build_report(runs: list[MeasuredRun]) -> Report:
    report = Report(labels=distinct_labels(run.workload for run in runs))
    groups: dict[tuple[Workload, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    baselines: dict[tuple[Workload, str], list[float]] = defaultdict(list)
    for run in runs:
        if run.status == "FAILED":
            report.failed.append(run)
        elif not_measured_because(run) is not None:
            report.unmeasured.append(run)
        else:
            groups[run.workload, run.device][run.setup_as_run].append(run.mean_epoch_time_s)
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

# A setup's epoch time: the mean over its measured epochs of one run, the median of these over
# repeated runs (the "runs" column); the table's header and the chart's axis both name it so.
EPOCH_TIME = "mean epoch s"
COLUMNS = ("use case", "device", "setup", "runs", EPOCH_TIME, "speedup")


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
        notes.append(f"failed: {report.label(run.workload)} {run.setup_as_run} (run {run.run_id}): {run.error or 'no error recorded'}")
    for run in report.unmeasured:
        why = not_measured_because(run)
        notes.append(f"not counted: {report.label(run.workload)} {run.setup_as_run} (run {run.run_id}): {why}")
    return notes


# The chart's type sizes (points) and a row's height (inches): at the 100 dpi it is saved at, a
# 10-point label is about as tall as the table's text on a screen, and a row fits its label.
FONT = {"setup": 10, "group": 10.5, "value": 9, "axis": 11, "title": 12}
ROW_IN = 0.3
BARS_IN = 5.0  # the bars' width; the figure adds its labels' width to it
SAVE_DPI = 100


def speedup_axis_label() -> str:
    """What the bars are, in the table's words: the baseline's epoch time over the setup's."""
    return (f"speedup = one device's {EPOCH_TIME} / the setup's {EPOCH_TIME}\n"
            f"(a setup's runs: their median, as in the table; the line: 1.0x)")


def speedup_figure(report: Report):
    """Horizontal bars, one per setup, grouped under their workload (a bold row), fastest first;
    the one-device baseline marked at 1.0x. Readable at any number of setups: each row is as tall
    as its label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.speedup is not None]
    groups = list(dict.fromkeys((report.label(r.workload), r.device) for r in rows))
    strategies = sorted({r.setup.split()[0] for r in rows})
    colours = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(strategies)}
    ticks, labels, bold = [], [], []
    height = 1.2 + ROW_IN * (len(rows) + len(groups))
    fig, ax = plt.subplots(figsize=(BARS_IN + 4, height))
    y = 0
    for label, device in groups:
        ticks.append(y), labels.append(f"{label} ({device})"), bold.append(True)
        y += 1
        for row in sorted((r for r in rows if (report.label(r.workload), r.device) == (label, device)),
                          key=lambda r: -r.speedup):
            ax.barh(y, row.speedup, height=0.7, color=colours[row.setup.split()[0]])
            ax.annotate(f"{row.speedup:.2f}x", (row.speedup, y), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=FONT["value"])
            ticks.append(y), labels.append(row.setup), bold.append(False)
            y += 1
    ax.set_yticks(ticks, labels, fontsize=FONT["setup"])
    for text, is_group in zip(ax.get_yticklabels(), bold):
        text.set_fontweight("bold" if is_group else "normal")
        text.set_fontsize(FONT["group"] if is_group else FONT["setup"])
    ax.tick_params(axis="x", labelsize=FONT["setup"])
    ax.set_ylim(y - 0.5, -0.5)  # first group on top
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0, 1.15 * max((r.speedup for r in rows), default=1.0))  # room for the value beside the longest bar
    ax.set_xlabel(speedup_axis_label(), fontsize=FONT["axis"])
    ax.set_title(f"Speedup per setup: {len(groups)} workload(s), {len(rows)} setup(s)", fontsize=FONT["title"])
    _fit_width(fig, ax, height)
    return fig


def _fit_width(fig, ax, height: float) -> None:
    """The figure as wide as its longest label plus :data:`BARS_IN`: a fixed width would give
    long labels the bars' room, or short ones a blank margin."""
    fig.canvas.draw()
    label_in = max((t.get_window_extent().width for t in ax.get_yticklabels()), default=0.0) / fig.dpi
    fig.set_size_inches(label_in + BARS_IN + 0.5, height)
    fig.tight_layout()


def plot(report: Report, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = speedup_figure(report)
    fig.savefig(path, dpi=SAVE_DPI, bbox_inches="tight", pad_inches=0.15)  # labels whole, no blank border
    plt.close(fig)
    return path


def write(report: Report, out_dir: Path) -> list[Path]:
    """The table as Markdown and CSV, and the chart where a row has a speedup to draw (an empty
    chart says less than the notes do)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "speedup.md", out_dir / "speedup.csv"]
    files[0].write_text(to_markdown(report))
    files[1].write_text(to_csv(report))
    chart = out_dir / "speedup.png"
    if any(r.speedup is not None for r in report.rows):
        files.append(plot(report, chart))
    else:
        chart.unlink(missing_ok=True)  # an earlier report's chart in the same folder would not be this one's
    return files
