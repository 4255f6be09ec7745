"""Resource use over a whole run: Lerat et al. 2022 Figures 2-5 (CPU %, RAM, threads against time).

A daemon thread in launch-rank 0 samples the process tree it belongs to: this process and its
descendants (data-parallel ranks started by the launcher, loader workers); under ``mpirun``
the tree of the local MPI daemon, so every rank on this node is counted. Samples stay in
memory and are written to MLflow in one batch at the end (no database writes while training),
with a PNG plot. On CUDA, each rank's peak allocated memory per device is max-reduced over
the ranks at the end of training.
"""
from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytorch_lightning as pl
import torch

from .. import tracking

log = logging.getLogger(__name__)

MIB = 2**20
# Parents that launch the ranks of one job on this node: monitor from there when found.
MPI_LAUNCHERS = {"mpirun", "mpiexec", "orterun", "orted", "prted", "prterun", "hydra_pmi_proxy"}


@dataclass
class Sample:
    elapsed_s: float
    cpu_percent: float  # summed over the tree: 100 = one core busy
    ram_mb: float  # proportional set size summed over the tree (shared pages counted once; RSS where PSS is unknown)
    threads: int
    processes: int


@dataclass
class ResourceSeries:
    samples: list[Sample] = field(default_factory=list)
    start_wall: float = 0.0  # time.time() of elapsed 0
    sampler_cpu_s: float = 0.0  # CPU time the sampling itself used
    duration_s: float = 0.0
    epoch_ends_s: list[float] = field(default_factory=list)  # elapsed at each training epoch's end

    def peak_ram_mb(self) -> float:
        return max((s.ram_mb for s in self.samples), default=0.0)

    def mean_cpu_percent(self) -> float:
        """Mean CPU % over the run (the first sample only primes psutil's counters and reads 0).
        MLflow shows a series' last value as the run's figure: the final sample, after training."""
        busy = [s.cpu_percent for s in self.samples[1:]]
        return sum(busy) / len(busy) if busy else 0.0

    def overhead_fraction(self) -> float:
        """Sampler CPU time / run time: the share of one core the sampling took (an upper bound on
        what it can cost a step, reached only if every sample lands on the step's critical path)."""
        return self.sampler_cpu_s / self.duration_s if self.duration_s > 0 else 0.0


def monitor_root() -> psutil.Process:
    me = psutil.Process()
    for parent in me.parents():
        if parent.name() in MPI_LAUNCHERS:
            return parent
    return me


# A PSS reading walks the process's page tables (about 6 ms per GB mapped, on the cores the run
# trains on: 6% of a 2-process VGG11 run when read every second). So PSS is read every PSS_EVERY-th
# sample (and for a new process at once); in between, each process's RSS is scaled by its last
# PSS/RSS ratio, which changes only as slowly as the sharing between processes does.
PSS_EVERY = 10


class ResourceSampler:
    """Samples a process tree every ``interval_s`` in a daemon thread until :meth:`stop`."""

    def __init__(self, interval_s: float = 1.0, root: psutil.Process | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0")
        self.interval_s = interval_s
        self.root = root or monitor_root()
        self.series = ResourceSeries()
        self._procs: dict[int, psutil.Process] = {}  # kept between samples: cpu_percent needs the last one
        self._share: dict[int, float] = {}  # each process's PSS/RSS at its last PSS reading
        self._count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> "ResourceSampler":
        self._t0 = time.perf_counter()
        self.series.start_wall = time.time()
        self._sample()  # primes cpu_percent (its first reading is 0) and records the start
        self._thread = threading.Thread(target=self._loop, name="ddlx-resource-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> ResourceSeries:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10 * self.interval_s + 5)
            self._thread = None
            self._sample()
            self.series.duration_s = time.perf_counter() - self._t0
        return self.series

    def mark_epoch_end(self) -> None:
        self.series.epoch_ends_s.append(time.perf_counter() - self._t0)

    def _loop(self) -> None:
        cpu_start = time.thread_time()
        while not self._stop.wait(self.interval_s):
            self._sample()
        self.series.sampler_cpu_s += time.thread_time() - cpu_start

    def _tree(self) -> list[psutil.Process]:
        try:
            found = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []
        procs = []
        for proc in found:
            known = self._procs.setdefault(proc.pid, proc)  # same object: its cpu_percent baseline
            procs.append(known)
        alive = {p.pid for p in found}
        for pid in list(self._procs):
            if pid not in alive:
                del self._procs[pid]
                self._share.pop(pid, None)
        return procs

    def _ram_bytes(self, proc: psutil.Process, fresh: bool) -> float:
        rss = proc.memory_info().rss
        if fresh or proc.pid not in self._share:
            pss = _proportional_bytes(proc)
            self._share[proc.pid] = pss / rss if rss else 1.0
            return pss
        return rss * self._share[proc.pid]

    def _sample(self) -> None:
        cpu = ram = 0.0
        threads = processes = 0
        fresh = self._count % PSS_EVERY == 0
        self._count += 1
        for proc in self._tree():
            try:
                with proc.oneshot():
                    cpu += proc.cpu_percent(None)
                    ram += self._ram_bytes(proc, fresh) / MIB
                    threads += proc.num_threads()
                processes += 1
            except psutil.Error:  # a worker that ended between listing and reading
                continue
        self.series.samples.append(Sample(time.perf_counter() - self._t0, cpu, ram, threads, processes))


def _proportional_bytes(proc: psutil.Process) -> int:
    """The process's share of the memory: each page divided by the processes that map it (PSS),
    so the ranks' shared weights and the pages loader workers share with their parent are
    counted once over the tree, as RSS would count them once per process; RSS where the system
    does not tell PSS."""
    try:
        return proc.memory_full_info().pss
    except (AttributeError, psutil.AccessDenied):
        return proc.memory_info().rss


def peak_gpu_memory_mb(strategy) -> dict[str, float]:
    """Peak allocated memory of every visible CUDA device, max over the ranks (all ranks call)."""
    if not torch.cuda.is_available():
        return {}
    count = torch.cuda.device_count()
    local = torch.tensor([torch.cuda.max_memory_allocated(i) / MIB for i in range(count)], dtype=torch.float64)
    device = strategy.root_device if strategy.root_device.type == "cuda" else torch.device("cpu")
    peak = strategy.reduce(local.to(device), reduce_op="max").cpu().tolist()
    return {f"peak_gpu_mem_mb_cuda{i}": v for i, v in enumerate(peak) if v > 0}


class ResourceMonitor(pl.Callback):
    """Samples from fit start to fit end on global rank 0 and logs the series, peaks and plot."""

    # Metric name -> sample field. The OS's thread and process counts are os_*: "threads" and
    # "processes" are the strategies' settings, tags of the same run.
    SERIES = {"cpu_percent": "cpu_percent", "ram_mb": "ram_mb", "os_threads": "threads", "os_processes": "processes"}

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.sampler: ResourceSampler | None = None
        self.series: ResourceSeries | None = None
        self._gpu_peaks: dict[str, float] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if trainer.is_global_zero:
            self.sampler = ResourceSampler(self.interval_s).start()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sampler is not None:
            self.sampler.mark_epoch_end()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._gpu_peaks = peak_gpu_memory_mb(trainer.strategy)  # a collective: every rank calls it

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish(trainer)  # what was sampled before the failure is kept with the failed run

    def _finish(self, trainer: pl.Trainer) -> None:
        if self.sampler is None:
            return
        self.series = self.sampler.stop()
        self.sampler = None
        try:
            log_series(trainer.logger, self.series, self._gpu_peaks)
        except Exception as err:  # never lose the run over its plot
            log.warning("could not log the resource series: %s", err)


def log_series(logger, series: ResourceSeries, extra: dict[str, float]) -> None:
    """Metric series with their sample times (MLflow's 'relative time' axis = elapsed s), the
    peaks and means, and the plot."""
    start_ms = int(series.start_wall * 1000)
    metrics = [(name, float(getattr(s, field)), start_ms + int(s.elapsed_s * 1000))
               for s in series.samples for name, field in ResourceMonitor.SERIES.items()]
    summary = {"peak_ram_mb": series.peak_ram_mb(), "mean_cpu_percent": series.mean_cpu_percent(),
               "monitor_cpu_fraction": series.overhead_fraction(), **extra}
    with tempfile.TemporaryDirectory() as tmp:
        path = plot_series(series, Path(tmp) / "resources.png", tracking.run_title(logger))
        tracking.log_series(logger, metrics, summary, start_ms + int(series.duration_s * 1000), files=[path])


def resource_figure(series: ResourceSeries, title: str = ""):
    """The paper's figure, one panel per unit: CPU in the ``cpu_percent`` metric's unit (100 = one
    core busy, up to 100 x the cores) with the OS thread count, and RAM in MB; epoch ends marked.
    Legends sit above the panels, off the curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.elapsed_s for s in series.samples]
    cores = psutil.cpu_count() or 1
    total_mb = psutil.virtual_memory().total / MIB
    fig, (cpu, ram) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=(3, 2))
    (cpu_line,) = cpu.plot(t, [s.cpu_percent for s in series.samples], color="tab:blue", label="CPU % (100 = one core busy)")
    cpu.set_ylabel("CPU %")
    cpu.set_ylim(0, 100 * cores * 1.05)
    threads = cpu.twinx()
    (thread_line,) = threads.plot(t, [s.threads for s in series.samples], color="tab:red", linestyle="--", label="OS threads")
    threads.set_ylabel("OS threads")
    threads.set_ylim(0, 1.2 * max((s.threads for s in series.samples), default=1))
    ram.plot(t, [s.ram_mb for s in series.samples], color="tab:green", label="RAM (MB, resident)")
    ram.set_ylabel("RAM (MB)")
    ram.set_ylim(0, max(1.0, 1.15 * series.peak_ram_mb()))
    ram.set_xlabel("elapsed (s)")
    for axis in (cpu, ram):
        for epoch, end in enumerate(series.epoch_ends_s, start=1):
            axis.axvline(end, color="grey", linewidth=0.7, linestyle=":")
            if axis is cpu:
                axis.annotate(f"epoch {epoch}", (end, 1.0), xycoords=("data", "axes fraction"), xytext=(-2, -2),
                              textcoords="offset points", ha="right", va="top", fontsize=7, color="grey")
    cpu.legend([cpu_line, thread_line], [cpu_line.get_label(), thread_line.get_label()], loc="lower left",
               bbox_to_anchor=(0, 1.0), ncol=2, fontsize=8, frameon=False)
    (ram_line,) = ram.get_lines()[:1]
    ram.legend([ram_line], [ram_line.get_label()], loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=8, frameon=False)
    fig.suptitle(title or "resources", fontsize=10)
    fig.text(0.99, 0.005, f"machine: {cores} cores, {total_mb / 1024:.0f} GiB", ha="right", va="bottom", fontsize=7, color="grey")
    fig.tight_layout()
    return fig


def plot_series(series: ResourceSeries, path: Path, title: str = "") -> Path:
    import matplotlib.pyplot as plt

    fig = resource_figure(series, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
