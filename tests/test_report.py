"""The speedup report on a small fixed set of MLflow runs, with figures checked by hand."""
from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ddlx import report as cli
from ddlx.measure import speedup_table as report
from ddlx.tracking import load_runs

WORKLOAD = {"model.name": "alexnet", "data.name": "firesmall", "data.image_size": "64", "data.batch_size": "32",
            "data.num_images": "200", "data.num_workers": "0", "data.root": "None", "trainer.limit_train_batches": "1.0",
            "measure.warmup_epochs": "1"}


def _log(client, exp_id, strategy, mean_epoch, status="FINISHED", tags=None, params=None, sweep="multirun/a"):
    run = client.create_run(exp_id, tags={"strategy": strategy, "host": "h1", "accelerator": "cpu",
                                          "sweep_id": sweep, **(tags or {})})
    for key, value in {**WORKLOAD, **(params or {})}.items():
        client.log_param(run.info.run_id, key, value)
    if mean_epoch is not None:  # 3 epochs after a warm-up one, of 160 samples
        client.log_metric(run.info.run_id, "mean_epoch_time_s", mean_epoch)
        client.log_metric(run.info.run_id, "mean_samples_per_s", 160 / mean_epoch)
        client.log_metric(run.info.run_id, "measured_epochs", 3)
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


@pytest.fixture
def store(tracking_uri):
    uri = tracking_uri
    client = MlflowClient(uri)
    exp = client.create_experiment("ddlx")
    _log(client, exp, "sequential", 30.0, tags={"threads": "1"})
    _log(client, exp, "sequential", 16.0, tags={"threads": "2"})
    _log(client, exp, "cpu_mp", 12.0, tags={"processes": "2"})
    _log(client, exp, "cpu_mp", 10.0, tags={"processes": "2"})  # three runs of one setup: their median counts
    _log(client, exp, "cpu_mp", 8.0, tags={"processes": "2"})
    _log(client, exp, "ddp_gloo", 20.0, tags={"processes": "2", "backend": "gloo", "comm_hook": "none"})
    _log(client, exp, "pipe", None, status="FAILED", tags={"chunks": "4", "error": "OutOfMemoryError: boom"})
    # A second workload without its one-core baseline, and a run of another sweep.
    _log(client, exp, "threads", 5.0, tags={"threads": "2"}, params={"model.name": "vgg16"})
    _log(client, exp, "sequential", 60.0, tags={"threads": "1"}, sweep="multirun/b", params={"data.batch_size": "16"})
    return uri


def test_speedups_over_the_one_core_baseline(store):
    built = report.build_report(load_runs(store, ["ddlx"]))
    alexnet = {r.setup: r for r in built.rows if r.workload.model == "alexnet" and r.workload.batch_size == "32"}
    assert alexnet["sequential threads=1"].speedup == pytest.approx(1.0)
    assert alexnet["sequential threads=2"].speedup == pytest.approx(30 / 16)
    assert alexnet["cpu_mp processes=2"].mean_epoch_time_s == pytest.approx(10.0)  # median of 12, 10, 8
    assert alexnet["cpu_mp processes=2"].runs == 3 and alexnet["cpu_mp processes=2"].speedup == pytest.approx(3.0)
    assert alexnet["ddp_gloo processes=2"].speedup == pytest.approx(1.5)


@pytest.mark.integration
def test_missing_baseline_is_named_with_the_command_that_measures_it(store):
    built = report.build_report(load_runs(store, ["ddlx"]))
    (vgg,) = [r for r in built.rows if r.workload.model == "vgg16"]
    assert vgg.speedup is None
    (missing,) = built.missing_baselines
    assert "vgg16/firesmall 64px b32" in missing and "sequential threads=1" in missing
    assert "python train.py model=vgg16 data=firesmall data.image_size=64 data.batch_size=32" in missing
    assert missing.endswith("strategy=sequential strategy.threads=1 measure.warmup_epochs=1 trainer.max_epochs=3"), \
        "a run the report then counts, however few steps an epoch has"


def test_failed_runs_are_listed_with_their_error(store):
    built = report.build_report(load_runs(store, ["ddlx"]))
    (failed,) = built.failed
    assert failed.strategy == "pipe" and "OutOfMemoryError" in failed.error
    assert "failed: " in report.to_text(built) and "OutOfMemoryError: boom" in report.to_text(built)


def test_a_different_batch_is_a_different_workload(store):
    built = report.build_report(load_runs(store, ["ddlx"]))
    b16 = [r for r in built.rows if r.workload.batch_size == "16"]
    assert len(b16) == 1 and b16[0].speedup == pytest.approx(1.0), "not compared with the batch-32 runs"


def test_another_allocator_is_another_workload_with_its_own_baseline(store):
    """Runs with cpu_allocator=keep_freed are not compared with glibc's default (runs without the
    param used it): a workload of their own, named so, whose missing baseline is asked for with it."""
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ddlx").experiment_id
    _log(client, exp, "cpu_mp", 7.0, tags={"processes": "2"}, params={"cpu_allocator": "keep_freed"})
    built = report.build_report(load_runs(store, ["ddlx"]))
    (kept,) = [r for r in built.rows if r.workload.cpu_allocator == "keep_freed"]
    assert kept.speedup is None and built.label(kept.workload) == "alexnet/firesmall 64px b32 cpu_allocator=keep_freed"
    assert any("cpu_allocator=keep_freed" in m and "strategy=sequential strategy.threads=1" in m for m in built.missing_baselines)
    default = {r.setup: r for r in built.rows if r.workload.model == "alexnet" and r.workload.batch_size == "32"
               and r.workload.cpu_allocator == "system"}
    assert default["cpu_mp processes=2"].runs == 3, "the default's runs stay as they were"


def test_another_precision_is_another_workload(store):
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ddlx").experiment_id
    _log(client, exp, "cpu_mp", 7.0, tags={"processes": "2", "precision": "bf16-mixed"})
    built = report.build_report(load_runs(store, ["ddlx"]))
    (half,) = [r for r in built.rows if r.workload.precision == "bf16-mixed"]
    assert half.speedup is None and "precision=bf16-mixed" in built.label(half.workload)
    assert any("trainer.precision=bf16-mixed" in m for m in built.missing_baselines)


def test_a_compiled_run_is_a_row_of_its_own_and_never_the_baseline(store):
    """compile.enable changes the time, not the setup's name: mixed into the eager row, a compiled
    run would move its median, and taken for the one-core baseline, every speedup."""
    from ddlx.records import run_name

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ddlx").experiment_id
    _log(client, exp, "sequential", 15.0, tags={"threads": "1"}, params={"compile.enable": "True"})
    _log(client, exp, "cpu_mp", 5.0, tags={"processes": "2"}, params={"compile.enable": "True"})
    built = report.build_report(load_runs(store, ["ddlx"]))
    alexnet = {r.setup: r for r in built.rows if r.workload.model == "alexnet" and r.workload.batch_size == "32"}
    assert alexnet["sequential threads=1"].speedup == pytest.approx(1.0) and alexnet["sequential threads=1"].runs == 1
    assert alexnet["sequential threads=1 compile.enable=True"].speedup == pytest.approx(2.0), "over the eager baseline"
    assert alexnet["cpu_mp processes=2"].mean_epoch_time_s == pytest.approx(10.0), "the eager row as it was"
    assert alexnet["cpu_mp processes=2 compile.enable=True"].speedup == pytest.approx(6.0)
    params = {**WORKLOAD, "compile.enable": "True"}
    assert run_name(params, {"strategy": "sequential", "threads": "1"}).startswith("sequential threads=1 compile.enable=True ")
    assert "compile" not in run_name({**WORKLOAD, "compile.enable": "False"}, {"strategy": "sequential", "threads": "1"})


def test_a_sweep_job_is_named_by_the_settings_its_sweep_varies_that_the_name_does_not_show():
    from ddlx.entry import swept_overrides
    from ddlx.records import run_name

    job = ["model=alexnet", "optim.lr=0.1", "data.image_size=64", "+logger.tags.note=x", "strategy.threads=2",
           "trainer.precision=bf16-mixed", "compile.enable=true"]
    sweep = ["model=alexnet", "optim.lr=0.01,0.1", "data.image_size=range(32,96,32)", "+logger.tags.note=x,y",
             "strategy.threads=1,2", "trainer.precision=32,bf16-mixed", "compile.enable=true,false"]
    swept = swept_overrides(job, sweep)
    assert swept == job[1:], "model=alexnet is the same in every job"
    assert swept_overrides(job, ["optim.lr=0.1"]) == [] and swept_overrides(job, ["/not/hydra's argv"]) == []
    params = {**WORKLOAD, "data.image_size": "64", "compile.enable": "True", "trainer.precision": "bf16-mixed"}
    name = run_name(params, {"strategy": "sequential", "threads": "2", "swept": " ".join(swept)})
    assert name.endswith(" 64px b32 bf16-mixed optim.lr=0.1 logger.tags.note=x"), \
        "what the name shows (threads, image size, precision, compile) is not repeated"


def test_a_sweep_job_reads_what_its_sweep_varies_from_the_sweep_folder_not_its_command_line(tmp_path, monkeypatch):
    """Under a launcher plugin (submitit) a job's process has the launcher's command line: what the
    sweep varies is read from the multirun.yaml Hydra's sweeper wrote, with the sweeper's params;
    not from another sweep's file in a reused folder; without one, from this process's command line."""
    from omegaconf import OmegaConf

    from ddlx.entry import sweep_overrides, swept_overrides

    OmegaConf.save({"hydra": {"overrides": {"task": ["strategy=sequential,threads", "data.synthetic_size=[40, 64]"]}}},
                   tmp_path / "multirun.yaml")
    monkeypatch.setattr(sys, "argv", ["/usr/bin/python", "-m", "submitit.core._submit", str(tmp_path)])
    job = ["strategy=threads", "data.synthetic_size=[40,64]", "optim.lr=0.1"]
    sweep = sweep_overrides(tmp_path, job, {"optim.lr": "0.01,0.1"})
    assert sweep == ["optim.lr=0.01,0.1", "strategy=sequential,threads", "data.synthetic_size=[40, 64]"]
    assert swept_overrides(job, sweep) == ["strategy=threads", "optim.lr=0.1"]
    other = ["strategy=threads", "data.synthetic_size=[32,32]"]
    assert swept_overrides(other, sweep_overrides(tmp_path, other, None)) == [], \
        "another sweep's file (a folder reused): the command line's, here submitit's, with nothing swept"
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "optim.lr=0.01,0.1"])
    assert sweep_overrides(tmp_path / "elsewhere", job, None) == ["optim.lr=0.01,0.1"]
    assert swept_overrides(["optim.lr=0.05"], ["optim.lr=0.01,0.1", "optim.lr=0.05"]) == [], \
        "the command line's value replaces the params' sweep, as Hydra's sweeper reads them"


def test_a_run_that_did_not_leave_out_its_start_up_is_listed_not_counted(store):
    """No warm-up epoch and 5 steps (one epoch of 160 samples, batch 32): start-up is most of it."""
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ddlx").experiment_id
    short = _log(client, exp, "cpu_mp", 1.0, tags={"processes": "2"}, params={"measure.warmup_epochs": "0"})
    client.log_metric(short, "measured_epochs", 1)
    built = report.build_report(load_runs(store, ["ddlx"]))
    (cpu_mp,) = [r for r in built.rows if r.setup == "cpu_mp processes=2" and r.workload.model == "alexnet"
                 and r.workload.batch_size == "32"]
    assert cpu_mp.runs == 3, "the short run is not among the counted ones"
    (note,) = [n for n in report._notes(built) if short in n]
    assert "not steady state" in note and "5 measured steps < 100" in note and "measure.warmup_epochs=1" in note


def test_train_pys_default_run_counts_its_steps_with_each_epochs_short_last_batch():
    """5 epochs of firesmall's 633 training images in batches of 32 are 100 steps (20 an epoch,
    the last of 25 images); samples over the batch made them 98.9 and left the default run out."""
    from ddlx.records import short_of_steady_state

    epoch_s = 7.3
    default = {"mean_epoch_time_s": epoch_s, "mean_samples_per_s": 633 / epoch_s, "measured_epochs": 5.0}
    assert short_of_steady_state(0, default, 32) is None
    four = default | {"measured_epochs": 4.0}
    assert "80 measured steps < 100" in short_of_steady_state(0, four, 32)


def test_workloads_sharing_a_short_label_are_named_apart(store):
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ddlx").experiment_id
    _log(client, exp, "sequential", 90.0, tags={"threads": "1"}, params={"data.num_images": "800"})
    built = report.build_report(load_runs(store, ["ddlx"]))
    base = [r for r in built.rows if r.setup == "sequential threads=1" and r.workload.model == "alexnet"
            and r.workload.batch_size == "32"]
    assert sorted(built.label(r.workload) for r in base) == [
        "alexnet/firesmall 64px b32 num_images=200", "alexnet/firesmall 64px b32 num_images=800"]
    assert all(r.speedup == pytest.approx(1.0) for r in base), "each compared with its own baseline"
    assert "num_images=800" in report.to_markdown(built)


def test_sweep_filter_and_latest(store):
    assert {r.sweep_id for r in load_runs(store, ["ddlx"], "multirun/a")} == {"multirun/a"}
    assert {r.sweep_id for r in load_runs(store, ["ddlx"], "latest")} == {"multirun/b"}
    with pytest.raises(ValueError, match=r"no runs tagged sweep_id='multirun/c' .*; their newest sweeps: multirun/b, "
                                         r"multirun/a; did you mean multirun/b or multirun/a\?$"):
        load_runs(store, ["ddlx"], "multirun/c")


def test_an_experiment_not_in_the_store_is_refused_with_those_it_holds(store):
    with pytest.raises(ValueError, match=r"no MLflow experiment named 'ddl' at \S+; it holds Default, ddlx; did you mean ddlx\?$"):
        load_runs(store, ["ddl"])


def test_markdown_has_the_papers_table_shape(store):
    md = report.to_markdown(report.build_report(load_runs(store, ["ddlx"], "multirun/a")))
    assert "Speedup over sequential threads=1 (one core) on cpu:" in md
    assert "| setup | alexnet/firesmall 64px b32 | vgg16/firesmall 64px b32 |" in md
    assert "| cpu_mp processes=2 | 3.00 | - |" in md
    assert "| threads threads=2 | - | - |" in md


def test_csv_and_plot(store, tmp_path):
    built = report.build_report(load_runs(store, ["ddlx"], "multirun/a"))
    md, csv_file, png = report.write(built, tmp_path / "out")
    rows = list(csv.DictReader(io.StringIO(csv_file.read_text())))
    by_setup = {r["setup"]: r for r in rows if r["model"] == "alexnet"}
    assert float(by_setup["cpu_mp processes=2"]["speedup"]) == pytest.approx(3.0)
    assert png.read_bytes()[:4] == b"\x89PNG" and md.read_text().startswith("| use case |")


def test_no_chart_is_drawn_when_no_row_has_a_speedup(store, tmp_path, capsys):
    """The vgg16 workload has no one-core baseline: its table says so, an empty chart would not."""
    import warnings

    built = report.build_report([r for r in load_runs(store, ["ddlx"], "multirun/a") if r.workload.model == "vgg16"])
    assert built.rows and all(r.speedup is None for r in built.rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's warning on the empty chart's axis
        files = report.write(built, tmp_path / "out")
    assert [f.name for f in files] == ["speedup.md", "speedup.csv"] and not (tmp_path / "out" / "speedup.png").exists()
    report.write(report.build_report(load_runs(store, ["ddlx"], "multirun/a")), tmp_path / "again")
    assert (tmp_path / "again" / "speedup.png").exists()
    report.write(built, tmp_path / "again")
    assert not (tmp_path / "again" / "speedup.png").exists(), "an earlier report's chart is not left beside this one's table"
    assert cli.main(["--tracking-uri", store, "--out", str(tmp_path / "all"), "--no-log"]) == 0
    assert "no speedup.png" not in capsys.readouterr().out, "where rows have speedups, the chart is drawn"


def test_command_line_prints_writes_and_logs_the_report(store, tmp_path, capsys):
    assert cli.main(["--tracking-uri", store, "--sweep-id", "multirun/a", "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "cpu_mp processes=2" in out and "3.00x" in out and "missing baseline" in out
    (compare,) = [line for line in out.splitlines() if "/#/compare-runs?" in line]
    assert "workflowType=machine_learning" in compare, "MLflow 3's model-training view, not its GenAI pages"
    assert all(run.run_id in compare for run in load_runs(store, ["ddlx"], "multirun/a")), "the sweep's runs"
    client = MlflowClient(store)
    (logged,) = client.search_runs([client.get_experiment_by_name("reports").experiment_id])
    assert logged.data.tags["sweep_id"] == "multirun/a"
    assert {a.path for a in client.list_artifacts(logged.info.run_id)} == {"speedup.md", "speedup.csv", "speedup.png"}
    assert logged.info.artifact_uri.removeprefix("file://").startswith(str(tmp_path / "mlruns")), \
        "artifacts beside the store, not in the folder the command ran from"


def test_command_line_errors_name_the_problem(tmp_path, capsys):
    assert cli.main(["--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    assert "no MLflow store at" in capsys.readouterr().err
    damaged = tmp_path / "mlflow.db"
    damaged.write_bytes(bytes(range(256)) * 20)
    assert cli.main(["--tracking-uri", f"sqlite:///{damaged}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tracking-uri=" in err and "is not an SQLite database" in err, err
    empty = f"sqlite:///{tmp_path / 'empty.db'}"  # a store whose experiment holds no runs yet
    MlflowClient(empty).create_experiment("ddlx")
    assert cli.main(["--tracking-uri", empty, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "experiment(s) 'ddlx' at" in err and "hold no runs" in err, err
    assert not (tmp_path / "out").exists() and MlflowClient(empty).get_experiment_by_name("reports") is None, \
        "no empty report written or logged"


@pytest.mark.parametrize("where", ["under_a_file", "in_proc"])
def test_an_out_folder_that_cannot_be_made_is_refused_before_any_run_is_read(store, tmp_path, capsys, where):
    """Permission bits do not tell: root passes them in /proc, where the report failed with a traceback."""
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "rep" if where == "under_a_file" else Path("/proc/ddlx-report")
    assert cli.main(["--tracking-uri", store, "--out", str(out), "--no-log"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out={out}:" in err and "--out ~/reports" in err, err


def test_the_report_command_of_a_sweep_names_the_store_and_experiment_unless_they_are_its_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.command("multirun/a", f"sqlite:///{tmp_path}/mlflow.db", "ddlx") == "python -m ddlx.report --sweep-id multirun/a"
    assert cli.command("multirun/a", f"sqlite:///{tmp_path}/my runs/mlflow.db", "mine") == \
        f"python -m ddlx.report --sweep-id multirun/a --tracking-uri 'sqlite:///{tmp_path}/my runs/mlflow.db' --experiment mine"
    assert cli.command("m/b", "http://host:5000", "ddlx") == "python -m ddlx.report --sweep-id m/b --tracking-uri http://host:5000"


def overlapping_labels(fig, texts) -> list[tuple[str, str]]:
    """Pairs of the given texts whose drawn boxes overlap (matplotlib's text extents)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_text() and t.get_visible()]
    return [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]


def outside_figure(fig, texts) -> list[str]:
    """The given texts not wholly inside the figure: cut off when it is saved."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_text()]
    return [text for text, box in boxes if not (fig.bbox.contains(*box.p0) and fig.bbox.contains(*box.p1))]


def test_the_speedup_chart_stays_readable_with_30_setups():
    from ddlx.records import Workload

    setups = ["sequential threads=1", "sequential threads=2", "threads threads=2", "cpu_mp processes=2",
              "ddp_gloo processes=2 backend=gloo bucket_cap_mb=25", "pipe chunks=4 devices=[cpu,cpu]",
              "pipe chunks=8 devices=[cpu,cpu] checkpoint=always", "split devices=[cpu,cpu]",
              "hybrid processes=2 local=pipe", "mpi local=threads threads=2"]
    rows = []
    for model in ("alexnet", "resnet18", "mobilenet_v2"):
        workload = Workload("host", model, "firesmall", "224", "32", "791", "2", "None", "None")
        rows += [report.Row(workload, "cpu", s, 1, 10.0 / (0.5 + k / 5), 0.5 + k / 5) for k, s in enumerate(setups)]
    fig = report.speedup_figure(report.Report(rows=rows))
    (ax,) = fig.axes
    assert len(ax.patches) == 30 and ax.get_title()
    labels = ax.get_yticklabels() + ax.get_xticklabels()
    assert {t.get_text() for t in labels} >= set(setups) | {"alexnet/firesmall 224px b32 (cpu)"}
    assert overlapping_labels(fig, labels) == []
    assert outside_figure(fig, [ax.xaxis.label, ax.title, *ax.get_yticklabels()]) == [], "long labels took the axis label's room"
    assert any(line.get_xdata()[0] == 1.0 for line in ax.get_lines()), "the one-device baseline is marked"


def test_the_chart_says_what_the_table_says(store):
    """The bars are the table's speedups, and the axis names the table's epoch-time column (it said
    median epoch time where the table says mean)."""
    built = report.build_report(load_runs(store, ["ddlx"], "multirun/a"))
    header = report.to_text(built).splitlines()[0]
    fig = report.speedup_figure(built)
    (ax,) = fig.axes
    assert sorted(bar.get_width() for bar in ax.patches) == pytest.approx(
        sorted(r.speedup for r in built.rows if r.speedup is not None))
    epoch_column = next(name for name in report.COLUMNS if "epoch" in name)
    assert epoch_column in header and epoch_column in ax.get_xlabel()
    assert "median epoch" not in ax.get_xlabel(), "the table's column is a mean epoch time"


def test_the_recommender_names_the_runs_it_leaves_out_and_why(store):
    from omegaconf import OmegaConf

    from ddlx.predict.cli import measured_runs

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ddlx").experiment_id
    short = _log(client, exp, "cpu_mp", 1.0, tags={"processes": "2"}, params={"measure.warmup_epochs": "0"})
    client.log_metric(short, "measured_epochs", 1)
    from ddlx.costmodel.hardware import HardwareSpec

    h1 = HardwareSpec(name="local", host="h1")  # the runs' host
    runs, note = measured_runs(OmegaConf.create({"logger": {"tracking_uri": store}, "experiments": ["ddlx"]}), [h1])
    assert f"1 not steady state ({short[:8]})" in note
    assert "1 status FAILED" in note


def test_every_batch_is_one_workload_whether_written_out_or_not(store):
    """Runs that left trainer.limit_train_batches at Lightning's default (null) and runs that wrote
    1.0 train the same epochs: one workload, one baseline."""
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("ddlx").experiment_id
    _log(client, exp, "threads", 15.0, tags={"threads": "2"}, params={"trainer.limit_train_batches": "None"})
    built = report.build_report(load_runs(store, ["ddlx"]))
    (threads,) = [r for r in built.rows if r.setup == "threads threads=2" and r.workload.model == "alexnet"]
    assert threads.speedup == pytest.approx(30.0 / 15.0), "compared with the baseline that wrote 1.0"
