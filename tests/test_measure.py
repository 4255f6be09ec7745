"""Timing callback and resource monitor: what every run logs, measured the same way everywhere."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import runs
from mlflow.tracking import MlflowClient

from ddlx.errors import ConfigError
from ddlx.measure.resources import ResourceSampler, ResourceSeries, Sample, plot_series
from ddlx.measure.timing import EpochTimer
from ddlx.run import train


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory, data_dir_module):
    """One two-epoch run with a warm-up epoch and a fast monitor; shared by the assertions below."""
    from conftest import TINY, compose_config

    root = tmp_path_factory.mktemp("measured")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    cfg = compose_config([
        f"paths.root={root}", f"paths.data_dir={data_dir_module}", f"logger.tracking_uri={uri}", *TINY,
        "trainer.max_epochs=2", "measure.warmup_epochs=1", "measure.monitor_interval_s=0.1",
    ])
    train(cfg, root / "run")
    (run,) = runs(uri)
    return MlflowClient(uri), run


@pytest.fixture(scope="module")
def data_dir_module(tmp_path_factory):
    return tmp_path_factory.mktemp("measure-data")


@pytest.mark.integration
def test_a_run_says_at_its_end_when_the_report_and_the_recommender_will_not_count_it(tiny_config, tracking_uri,
                                                                                      tmp_path, capsys):
    """A run of few steps and no warm-up epoch was said FINISHED with its mean epoch, and its user
    learnt only from the report (or recommend.py's 'left out') that its times do not count."""
    from ddlx.records import not_measured_because
    from ddlx.tracking import load_runs

    train(tiny_config(), tmp_path / "short")  # one epoch of 2 steps, nothing left out
    said = [line for line in capsys.readouterr().out.splitlines() if "not counted" in line]
    (run,) = load_runs(tracking_uri, ["ddlx"])
    assert said == [f"  not counted by the report or recommend.py: {not_measured_because(run)}"], said
    train(tiny_config("trainer.max_epochs=2", "measure.warmup_epochs=1"), tmp_path / "steady")
    assert "not counted" not in capsys.readouterr().out


@pytest.mark.integration
def test_epoch_time_splits_into_data_wait_and_compute(measured_run):
    client, run = measured_run
    history = {name: [m.value for m in client.get_metric_history(run.info.run_id, name)]
               for name in ("epoch_time_s", "data_wait_s", "compute_s", "step_time_s", "samples_per_s")}
    assert all(len(values) == 2 for values in history.values()), history
    for epoch in range(2):
        total = history["data_wait_s"][epoch] + history["compute_s"][epoch]
        assert total == pytest.approx(history["epoch_time_s"][epoch], rel=1e-5)
        assert history["step_time_s"][epoch] == pytest.approx(history["epoch_time_s"][epoch] / 2, rel=1e-5)  # 2 steps
        assert history["samples_per_s"][epoch] == pytest.approx(16 / history["epoch_time_s"][epoch], rel=1e-5)


@pytest.mark.integration
def test_mean_epoch_time_leaves_out_the_warm_up_epoch(measured_run):
    client, run = measured_run
    epochs = [m.value for m in client.get_metric_history(run.info.run_id, "epoch_time_s")]
    assert run.data.metrics["mean_epoch_time_s"] == pytest.approx(epochs[1], rel=1e-5)
    assert run.data.metrics["measured_epochs"] == 1


@pytest.mark.integration
def test_monitor_logs_series_against_time_and_a_plot(measured_run):
    client, run = measured_run
    cpu = client.get_metric_history(run.info.run_id, "cpu_percent")
    ram = client.get_metric_history(run.info.run_id, "ram_mb")
    threads = client.get_metric_history(run.info.run_id, "os_threads")
    assert len(cpu) >= 3 and len(ram) == len(cpu) == len(threads)
    stamps = [m.timestamp for m in cpu]
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] >= 200, "samples carry their own times"
    assert max(m.value for m in cpu) > 10, "training keeps a core busy"
    assert min(m.value for m in ram) > 100 and min(m.value for m in threads) >= 1
    assert run.data.metrics["peak_ram_mb"] == pytest.approx(max(m.value for m in ram))
    busy = [m.value for m in sorted(cpu, key=lambda m: m.step)[1:]]  # the first sample primes psutil
    assert run.data.metrics["mean_cpu_percent"] == pytest.approx(sum(busy) / len(busy)) and run.data.metrics["mean_cpu_percent"] > 10
    assert 0 <= run.data.metrics["monitor_cpu_fraction"] < 0.2
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "resources.png" in artifacts
    png = client.download_artifacts(run.info.run_id, "resources.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_run_is_tagged_with_its_machine_and_device_kind(measured_run):
    _, run = measured_run
    tags = run.data.tags
    assert tags["accelerator"] == "cpu" and tags["strategy"] == "sequential"
    assert tags["host"] and int(tags["cpu_cores"]) >= 1


@pytest.mark.integration
def test_sampler_counts_the_whole_process_tree():
    """Child processes (ranks, loader workers) are in the figures, not only the sampling process."""
    busy = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        time.sleep(0.5)  # the child is running
        sampler = ResourceSampler(interval_s=0.2).start()
        time.sleep(1.5)
        series = sampler.stop()
    finally:
        child.kill()
        child.wait()
    assert max(s.processes for s in series.samples) >= 2
    assert max(s.cpu_percent for s in series.samples[1:]) > 50, "the busy child's core shows"
    assert series.duration_s >= 1.5 and series.sampler_cpu_s >= 0


def test_sampler_rejects_a_bad_interval():
    with pytest.raises(ValueError, match="interval_s=0"):
        ResourceSampler(interval_s=0)


def test_plot_of_a_fixed_series(tmp_path):
    series = ResourceSeries(samples=[Sample(t, 100.0 * t, 500 + t, 4 + t, 1) for t in range(5)], duration_s=4)
    path = plot_series(series, tmp_path / "r.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_timer_summary_means_the_epochs_after_warm_up():
    timer = EpochTimer(warmup_epochs=1)
    timer.epoch_times, timer.epoch_samples = [9.0, 2.0, 4.0], [60, 60, 60]
    assert timer.summary() == {"mean_epoch_time_s": 3.0, "mean_samples_per_s": 20.0, "measured_epochs": 2.0}


def test_a_resumed_run_keeps_its_inductor_cache_counts_and_drops_those_a_checkpoint_lacks():
    """A checkpoint carries compile_s and inductor's (hits, misses); one written before ddlx counted
    them carries compile_s alone, and the resumed run then logs its compile seconds without counts
    (its cold compile is in them, the counts of the attempt after would say warm)."""
    state = {"epoch_times": [1.0], "epoch_samples": [8], "epoch_steps": [1], "step_times": [], "samples": 0,
             "compile_s": 30.0}
    for saved, counts in (((2, 3), {"compile_cache_hits": 2.0, "compile_cache_misses": 3.0}), (None, {})):
        timer = EpochTimer()
        timer.clock.install()  # counting from now: this process's earlier compiles are not the run's
        try:
            timer.load_state_dict(state if saved is None else {**state, "compile_cache": saved})
            summary = timer.summary()
            assert summary["compile_s"] == 30.0 and {k: v for k, v in summary.items() if k.startswith("compile_cache")} == counts
            assert timer.state_dict()["compile_cache"] == saved
        finally:
            timer.clock.remove()


@pytest.mark.parametrize("max_steps", [-1, 5])
def test_an_epoch_ends_when_its_last_step_is_done_on_the_device(monkeypatch, max_steps):
    """A GPU still runs the last steps after the host has issued them: the timer waits for the
    devices once, at the epoch's last step (max_steps cuts the second epoch short), and the wait
    counts in the epoch (here a sleep stands in for the queued work). An epoch cut short is no
    epoch's time: it is left out of the epoch times and their mean."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ddlx.measure import timing

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    waits = []
    monkeypatch.setattr(timing, "wait_for_devices", lambda module: waits.append(module.global_step) or time.sleep(0.3))
    timer = EpochTimer()
    data = DataLoader(TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,))), batch_size=4)
    trainer = pl.Trainer(max_epochs=2, max_steps=max_steps, callbacks=[timer], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0)
    trainer.fit(Tiny(), data)
    assert waits == ([3, 6] if max_steps < 0 else [3, 5]), "once an epoch, at its last step"
    assert len(timer.epoch_times) == (2 if max_steps < 0 else 1) and min(timer.epoch_times) >= 0.3, timer.epoch_times
    assert timer.epoch_steps == ([3, 3] if max_steps < 0 else [3])
    assert timer.summary()["measured_epochs"] == len(timer.epoch_times)


@pytest.mark.integration
def test_warm_up_that_leaves_no_epoch_is_refused(tiny_config):
    with pytest.raises(ConfigError, match=r"measure.warmup_epochs=1 with trainer.max_epochs=1"):
        train(tiny_config("measure.warmup_epochs=1"), "unused")


@pytest.mark.integration
def test_bad_monitor_interval_is_refused(tiny_config):
    with pytest.raises(ConfigError, match=r"measure.monitor_interval_s=0"):
        train(tiny_config("measure.monitor_interval_s=0"), "unused")


def test_the_resource_plot_names_its_run_marks_epochs_and_uses_the_metric_unit():
    from test_report import overlapping_labels

    from ddlx.measure.resources import resource_figure

    samples = [Sample(t, 180.0 if t > 2 else 20.0, 900.0 + 10 * t, 30, 3) for t in range(40)]
    series = ResourceSeries(samples=samples, epoch_ends_s=[10.0, 20.0, 30.0, 39.0])
    fig = resource_figure(series, "alexnet/firesmall 224px b32 cpu_mp processes=2 (MLflow run abc)")
    assert "cpu_mp processes=2" in fig._suptitle.get_text()
    cpu = fig.axes[0]
    assert max(cpu.get_lines()[0].get_ydata()) == 180.0, "CPU % as the metric: 100 = one core"
    marks = [line for line in cpu.get_lines() if line.get_linestyle() == ":"]
    assert len(marks) == 4, "one mark per epoch"
    labels = [t for ax in fig.axes for t in ax.get_yticklabels() + ax.get_xticklabels()]
    assert overlapping_labels(fig, labels) == []


@pytest.mark.integration
def test_the_sampler_reads_pss_every_tenth_sample_and_scales_rss_in_between(monkeypatch):
    """A PSS reading walks the page tables (costly for big processes): between readings each
    process's RSS is scaled by its last PSS/RSS ratio."""
    import psutil

    from ddlx.measure import resources

    readings = []

    def pss(proc):
        readings.append(proc.pid)
        return proc.memory_info().rss // 2  # as if half of every page were shared

    monkeypatch.setattr(resources, "_proportional_bytes", pss)
    sampler = ResourceSampler(interval_s=1.0, root=psutil.Process())
    for _ in range(resources.PSS_EVERY + 1):
        sampler._sample()
    from collections import Counter

    assert set(Counter(readings).values()) == {2}, "each process at the first sample and the PSS_EVERY-th"
    first = sampler.series.samples[0].ram_mb
    assert all(s.ram_mb == pytest.approx(first, rel=0.05) for s in sampler.series.samples), "RSS scaled in between"


@pytest.mark.integration
def test_cores_other_processes_keep_busy_are_found_and_a_run_on_them_says_so(tiny_config, tracking_uri, tmp_path,
                                                                             monkeypatch, caplog):
    """A neighbour (a process keeping one of this run's cores busy) is named before the run starts,
    and the run is tagged with it: its times are of a shared machine."""
    import os

    from ddlx import run as run_module
    from ddlx.machine import busy_cores

    core = min(os.sched_getaffinity(0))
    neighbour = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        time.sleep(0.5)
        assert core in busy_cores(sample_s=1.0)
    finally:
        neighbour.kill()
        neighbour.wait()
    monkeypatch.setattr(run_module, "busy_cores", lambda: {core: 97.0})
    train(tiny_config(), tmp_path / "run")
    (run,) = runs(tracking_uri)
    assert run.data.tags["busy_cores"] == f"{core}:97%"
    assert any("busy with other processes" in r.getMessage() for r in caplog.records)
