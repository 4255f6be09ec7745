"""End to end: train.py writes one MLflow run with the contract's metrics; bad input fails early."""
from __future__ import annotations

import ctypes.util
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PROJECT_DIR, TINY, compose_config, runs, signalled, subprocess_env, with_made_store

from ddlx import run as run_module
from ddlx.errors import ConfigError
from ddlx.models import ARCHITECTURES
from ddlx.costmodel.memory import GIB
from ddlx.records import not_measured
from ddlx.run import check_memory, train
from ddlx.tracking import load_runs

EPOCH_METRICS = {"train_loss", "train_acc", "val_loss", "val_acc", "epoch_time_s", "samples_per_s",
                 "data_wait_s", "compute_s", "step_time_s"}
# Logged straight to MLflow at the end of training (not Lightning's per-epoch metrics).
RUN_METRICS = EPOCH_METRICS | {"mean_epoch_time_s", "mean_samples_per_s", "cpu_percent", "ram_mb", "os_threads", "os_processes", "peak_ram_mb", "mean_cpu_percent"}
DATASETS = ["firesmall", "firebig", "mnist", "cifar10", "imagenet", "highres"]


def run_train_py(tmp_path, *overrides, timeout=300, multirun=False, env=None):
    """``env``: variables to add to the environment train.py starts in. Its store (paths.root's
    mlflow.db) is a copy of the session's, its schema made (conftest.with_made_store)."""
    with_made_store(tmp_path)
    cmd = [sys.executable, str(PROJECT_DIR / "train.py"), *(["-m"] if multirun else []), f"paths.root={tmp_path}", *TINY, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env() | (env or {}), cwd=tmp_path)


@pytest.mark.integration
def test_ctrl_c_before_the_run_is_open_ends_train_py_with_one_line(tmp_path):
    """Ctrl-C while train.py imports (seconds before any run is opened; a run's own Ctrl-C writes
    its checkpoint, tests/test_runs.py): one line and status 130, not an import's traceback."""
    import os
    import signal

    with_made_store(tmp_path)
    cmd = [sys.executable, str(PROJECT_DIR / "train.py"), f"paths.root={tmp_path}", *TINY]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=tmp_path, start_new_session=True)  # its own group, as a terminal's Ctrl-C reaches
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("ddlx: train.py stopped by Ctrl-C before its end: no run was open"), err
    assert runs(f"sqlite:///{tmp_path / 'mlflow.db'}") == [], "no run opened"


@pytest.mark.parametrize("composition", [1, 3], ids=["the command line's check", "hydra's"])
def test_ctrl_c_while_a_config_is_composed_ends_train_py_with_one_line(tmp_path, composition):
    """Ctrl-C inside omegaconf building a config (train.py's check of the command line, then
    Hydra's) left a node half made, and omegaconf's cleanup failed on it: the stop became a config
    error (status 2, "defaults is not a key of the config") or omegaconf's error (status 1). It is
    held to the check's end, or until the job starts, which stops with the line. No job folder is
    left: Hydra's, made for a job that never ran, went with it."""
    proc = signalled(tmp_path, f"composing:{composition}", "SIGINT", f"paths.root={tmp_path}", *TINY)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("ddlx: train.py stopped by Ctrl-C before its end: no run was open")
    assert runs(f"sqlite:///{tmp_path / 'mlflow.db'}") == [], "no run opened"
    assert list(tmp_path.glob("outputs/*")) == [], "no job folder without a run"


@pytest.mark.integration
def test_ctrl_c_while_a_sweep_composes_its_next_job_stops_the_sweep_with_one_line(tmp_path):
    """Between a sweep's jobs Hydra composes the next job's config: Ctrl-C there failed the sweep
    with omegaconf's error (status 1), or was lost and the sweep ran on. Held, it stops the sweep
    where the second job starts: status 130, the line, the sweep's end; the first job's run stays
    FINISHED and no second is opened."""
    proc = signalled(tmp_path, "composing:next", "SIGINT", "-m", f"paths.root={tmp_path}", *TINY, "seed=1,2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 130 and "Traceback" not in out and "ConfigKeyError" not in out, out[-3000:]
    assert "_invalidate_flags_cache" not in out, "omegaconf's cleanup did not fail on a half-made node"
    assert "#1 : " in out, "the second job was composed"
    assert "ddlx: train.py stopped by Ctrl-C before its end: no run was open" in proc.stderr
    assert re.search(r"ddlx: sweep \S+ ended: 1 run\(s\)", proc.stdout)
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FINISHED" and run.data.params["seed"] == "1"
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"], "the second job's folder, made for no run, went"


@pytest.mark.integration
def test_train_py_logs_one_mlflow_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_train_py(tmp_path, "model=vgg16", "data=firesmall", "trainer.max_epochs=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = runs(uri)
    assert run.info.status == "FINISHED"
    assert RUN_METRICS <= set(run.data.metrics)
    assert run.data.metrics["epoch_time_s"] > 0 and run.data.metrics["samples_per_s"] > 0
    tags = run.data.tags
    assert (tags["model"], tags["data"], tags["strategy"], tags["use_case"]) == ("vgg16", "firesmall", "sequential", "complexsmall")
    params = run.data.params
    assert params["data.batch_size"] == "8" and params["model.name"] == "vgg16" and params["strategy.threads"] == "1"
    assert params["cpu_allocator"] == "keep_freed", "the default, auto, is recorded as what it resolved to on glibc"
    assert "cpu_allocator=auto (the default) resolved to keep_freed: glibc keeping freed memory" in proc.stdout + proc.stderr, \
        "the run's first lines say what its heap is and why"
    out = proc.stdout + proc.stderr
    assert re.search(r"epoch 1/2 done, [\d.]+ s with validation: train_loss [\d.]+, train_acc [\d.]+, val_loss", out), \
        "output that is not a terminal shows a line per epoch"
    summary = proc.stdout[proc.stdout.index("ddlx: run FINISHED after 2 epoch(s)"):]
    assert "samples/s" in summary and "final val_acc" in summary
    assert f"mlflow ui --backend-store-uri {uri}, then http://127.0.0.1:5000/#/experiments/" in summary
    assert f"/runs/{run.info.run_id}?workflowType=machine_learning" in summary
    job_log = (Path(tags["output_dir"]) / "train.log").read_text()
    assert "[ddlx][INFO] - run FINISHED after 2 epoch(s)" in job_log and run.info.run_id in job_log, \
        "the job's folder says how it ended, as the console did"
    for noise in ("💡", "LeafSpec", "Total FLOPs", "limit_train_batches=1.0", "The `srun` command", "MPI_ABORT",
                  "smaller than the logging interval"):  # 2 batches an epoch, and ddlx logs once an epoch
        assert noise not in out, noise
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config_resolved.yaml", "resources.png"}
    assert run.info.run_name == "sequential threads=1 vgg16/firesmall 32px b8", "what it trains, as the runs table shows it"
    assert client.get_experiment_by_name("ddlx").tags["mlflow.experimentKind"] == "custom_model_development", \
        "MLflow 3's UI opens it on the training runs, not its GenAI pages"
    assert "threads" not in run.data.metrics and tags["precision"] == "32-true"
    assert tags["data_cache"] == "memory", "data.cache=auto kept the small set's decoded images in memory"
    history = client.get_metric_history(run.info.run_id, "epoch_time_s")
    assert len(history) == 2, "one epoch_time_s per epoch"
    # Defaults put the store (the run read from uri, above) and data in the project folder given as paths.root.
    assert (tmp_path / "data" / "synthetic").is_dir()


def _assert_clear_error(proc, *keys):
    """Exit status 2, no traceback, and a ddlx error line naming each of ``keys`` (regexes)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = next((line for line in proc.stderr.splitlines() if line.startswith("ddlx: error:")), "")
    assert all(re.search(key, line) for key in keys), proc.stderr[-3000:]


# A ConfigError is train.py's exit status 2 and one line, no traceback (checked through train.py
# itself by the tests that call _assert_clear_error): these check the error and that it comes first.
@pytest.mark.integration
def test_missing_data_root_is_a_clear_error(tiny_config, tracking_uri, tmp_path):
    with pytest.raises(ConfigError, match=r"data.root=\S*nope.*data.root=null"):
        train(tiny_config(f"data.root={tmp_path}/nope"), output_dir=tmp_path / "run")
    assert runs(tracking_uri) == [], "nothing is logged for a run that never started"


@pytest.mark.integration
def test_too_small_image_is_a_clear_error(tiny_config, tracking_uri, tmp_path):
    with pytest.raises(ConfigError, match=r"data.image_size=8: expected a value >= 16"):
        train(tiny_config("data.image_size=8"), output_dir=tmp_path / "run")
    assert runs(tracking_uri) == [], "refused before a run was opened"


@pytest.mark.integration
def test_unreachable_tracking_server_fails_at_start(tiny_config, tmp_path):
    cfg = tiny_config("logger.tracking_uri=http://127.0.0.1:9", f"paths.data_dir={tmp_path}/fresh")
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"logger.tracking_uri=http://127.0.0.1:9"):
        train(cfg, output_dir=tmp_path / "run")
    assert time.monotonic() - start < 30
    assert not (tmp_path / "fresh").exists(), "failed before preparing data"


@pytest.mark.integration
def test_a_sweep_whose_store_cannot_record_is_refused_before_its_first_job(tmp_path):
    """No job of this sweep could be recorded (the store's folder does not exist): one line says
    why, exit status 2, before Hydra makes the sweep's folder (the first job said it, 5-7 s in,
    leaving its folder), instead of refusing each job in turn."""
    proc = run_train_py(tmp_path, f"logger.tracking_uri=sqlite:///{tmp_path}/nope/mlflow.db", "seed=1,2,3", multirun=True)
    _assert_clear_error(proc, r"^ddlx: error: all 3 jobs of the sweep: logger.tracking_uri=\S*nope/mlflow.db: folder \S*nope does not exist")
    assert proc.stderr.count("ddlx: error:") == 1
    assert not (tmp_path / "multirun").exists(), "no job was started"


def test_a_refused_job_says_why_in_its_folders_log_too(tmp_path, capsys):
    """The job's log (Hydra's train.log, in its folder) ends with why, as the console does: it
    ended at the seed and the data, with no word of the refusal."""
    import logging

    from ddlx.entry import report_config_errors

    def job():
        raise ConfigError("the training split has 4 images (5 images, data.val_fraction=0.2) but data.batch_size=32")

    handler = logging.FileHandler(tmp_path / "train.log")  # as Hydra's job logging adds it
    logging.getLogger().addHandler(handler)
    try:
        with pytest.raises(SystemExit) as stop:
            report_config_errors(job)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert stop.value.code == 2
    assert capsys.readouterr().err == "ddlx: error: the training split has 4 images (5 images, data.val_fraction=0.2) but data.batch_size=32\n"
    assert (tmp_path / "train.log").read_text() == "error: the training split has 4 images (5 images, data.val_fraction=0.2) but data.batch_size=32\n"


def test_a_sweep_stops_at_the_first_job_the_store_refuses(capsys):
    """A store that went bad after the command line's check: the job that finds it says why and
    the sweep ends there, exit status 2 (its other jobs log to the same store)."""
    from ddlx.entry import report_config_errors
    from ddlx.errors import StoreError

    def job():
        raise StoreError("logger.tracking_uri=sqlite:///gone/mlflow.db: folder gone does not exist")

    with pytest.raises(SystemExit) as stop:
        report_config_errors(job, in_sweep=True)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ddlx: error: logger.tracking_uri=sqlite:///gone/mlflow.db") and "the sweep stops here" in err


@pytest.mark.integration
def test_the_runs_of_a_sweep_are_named_apart_and_its_end_says_how_to_compare_them(tmp_path, monkeypatch, capsys):
    """MLflow's runs table shows names: a sweep over a setting the name does not show (the
    learning rate) adds it to each job's name; one the name shows already (the batch) is not repeated.
    The sweep ends saying what the report will count of it and the command that reports on it
    (it ended with the last job's own lines)."""
    from ddlx import report

    proc = run_train_py(tmp_path, "model=alexnet", "optim.lr=0.01,0.02", "data.batch_size=8,16",
                        "trainer.limit_train_batches=1", multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    names = sorted(r.info.run_name for r in found)
    assert names == sorted(f"sequential threads=1 alexnet/firesmall 32px b{b} optim.lr={lr}"
                           for lr in ("0.01", "0.02") for b in (8, 16)), names
    (sweep_id,) = {r.data.tags["sweep_id"] for r in found}
    ended, compare = proc.stdout.rstrip().splitlines()[-2:]
    assert ended == f"ddlx: sweep {sweep_id} ended: 4 run(s); the report counts 0 (left out: 4 not steady state)", ended
    assert compare == f"  compare them: python -m ddlx.report --sweep-id {sweep_id}", compare  # the store at its default here
    monkeypatch.chdir(tmp_path)  # where the sweep ran
    assert report.main(shlex.split(compare.split(": ", 1)[1])[3:] + ["--no-log"]) == 0
    assert capsys.readouterr().out.count("not counted: alexnet/firesmall") == 4


@pytest.mark.integration
def test_a_sweep_job_takes_values_from_hydras_config(tmp_path):
    """${hydra:...} in a value: what each job resolves it to (the command line's check refused it)."""
    proc = run_train_py(tmp_path, "model=alexnet", "seed=1,2", "trainer.limit_train_batches=1",
                        "logger.run_name=${hydra:job.name}-${hydra:job.num}", multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(r.info.run_name for r in runs(f"sqlite:///{tmp_path / 'mlflow.db'}")) == ["train-0", "train-1"]


@pytest.mark.integration
def test_a_later_sweep_job_leaves_the_console_to_its_rank_0(tmp_path):
    """A sweep whose first job starts no ranks starts a later job's as new interpreters, where
    Lightning gave its loggers a handler of their own: rank 1 printed 'Seed set to 42' and
    'Initializing distributed' beside rank 0's lines."""
    proc = run_train_py(tmp_path, "model=alexnet", "strategy=sequential,ddp_gloo", multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "GLOBAL_RANK: 0" in said and "GLOBAL_RANK: 1" not in said and "[rank: 1]" not in said, said[-3000:]


@pytest.mark.integration
@pytest.mark.parametrize("model", ARCHITECTURES)
def test_every_model_trains(tiny_config, tracking_uri, model):
    metrics = train(tiny_config(f"model={model}", "data=cifar10", "data.num_images=24", "data.val_fraction=0.25"),
                    output_dir=tiny_config().paths.root)
    assert EPOCH_METRICS <= set(metrics)


@pytest.mark.integration
@pytest.mark.parametrize("data", DATASETS)
def test_every_dataset_trains_at_its_own_size(tiny_config, data):
    native = compose_config([f"data={data}"]).data
    cfg = tiny_config("model=alexnet", f"data={data}", f"data.image_size={native.image_size}", "data.batch_size=4",
                      f"data.num_images={max(12, native.num_classes)}", "trainer.limit_train_batches=1")
    lo = min(native.image_size, 64)
    cfg.data.synthetic_size = [lo, lo + 8]
    metrics = train(cfg, output_dir=cfg.paths.root)
    validated = {"val_loss", "val_acc"}
    assert EPOCH_METRICS - validated <= set(metrics)
    assert (validated <= set(metrics)) == (native.val_fraction > 0), "validation only where the config holds images out"


@pytest.mark.parametrize("model", ARCHITECTURES)
@pytest.mark.parametrize("data", DATASETS)
def test_memory_check_passes_or_names_a_batch_that_fits(monkeypatch, model, data):
    """With 16 GiB free, every pair either fits at its default batch or the error names a batch that does."""
    monkeypatch.setattr(run_module, "available_memory_bytes", lambda accelerator: (16 * GIB, "available RAM"))
    cfg = compose_config([f"model={model}", f"data={data}"])
    try:
        check_memory(cfg)
    except ConfigError as err:
        message = str(err)
        assert f"model={model} on data={data}" in message and "GiB" in message
        fit = re.search(r"lower data.batch_size to (\d+)", message)
        assert fit, message
        cfg.data.batch_size = int(fit.group(1))
        check_memory(cfg)


@pytest.mark.integration
def test_oversized_pair_is_refused_before_training(tiny_config, monkeypatch, tmp_path):
    monkeypatch.setattr(run_module, "available_memory_bytes", lambda accelerator: (16 * GIB, "available RAM"))
    cfg = tiny_config("model=resnet152", "data=highres", "data.image_size=512", "data.batch_size=32",
                      "data.num_images=1000", f"paths.data_dir={tmp_path}/fresh")
    with pytest.raises(ConfigError, match=r"needs about \d+\.\d GiB.*lower data.batch_size to \d+"):
        train(cfg, output_dir=cfg.paths.root)
    assert not Path(cfg.paths.data_dir).exists(), "refused before writing any data"


@pytest.mark.integration
def test_a_run_whose_loss_diverges_stops_there_and_says_to_lower_the_learning_rate(tiny_config, tracking_uri, capsys):
    """NaN weights train nothing: train.py's default run (AlexNet, then at lr 0.01) ended its 5
    epochs at train_loss nan where its loss blew up in epoch 4, and said nothing of it."""
    from mlflow.tracking import MlflowClient

    cfg = tiny_config("optim.lr=1000", "trainer.max_epochs=5")
    train(cfg, output_dir=cfg.paths.root)
    (run,) = runs(tracking_uri)
    diverged = run.data.tags["diverged"]
    epoch = re.match(r"train_loss (nan|inf) in epoch (\d): the weights diverged", diverged)
    assert epoch and int(epoch[2]) < 5, diverged
    assert "a lower optim.lr (now 1000)" in diverged
    assert run.info.status == "FINISHED"
    assert len(MlflowClient(tracking_uri).get_metric_history(run.info.run_id, "epoch_time_s")) == int(epoch[2]), "stopped there"
    out = capsys.readouterr().out
    assert f"  {diverged}\n" in out
    assert "not counted by the report or recommend.py: diverged" in out, "its last epochs ran on diverging values"
    (measured,) = load_runs(tracking_uri, ["ddlx"])
    assert not_measured(measured)[0] == "diverged", "the report leaves it out, as the run said"


@pytest.mark.integration
def test_learns_the_synthetic_classes(tiny_config):
    """On a small synthetic fire set, validation accuracy ends well above chance (1/3)."""
    cfg = tiny_config(
        "model=vgg11", "data.num_images=90", "data.val_fraction=0.25", "data.batch_size=10",
        "trainer.max_epochs=3", "trainer.limit_train_batches=1.0", "trainer.limit_val_batches=1.0", "optim.lr=0.01",
    )
    metrics = train(cfg, output_dir=cfg.paths.root)
    assert metrics["val_acc"] >= 0.8, metrics


@pytest.mark.slow  # two train.py sweeps; the allocator's choice is also checked in-process (tests/test_allocator.py)
def test_cpu_allocator_is_recorded_and_a_sweep_cannot_go_back_to_glibcs_default(tmp_path):
    """The default, auto, is keep_freed on glibc: it trains (its rank worker inheriting it) and is
    recorded as keep_freed; the next job of the same sweep asks for "system", which glibc cannot
    restore in that process: a FAILED run that says so, not a run measured with the wrong allocator."""
    proc = run_train_py(tmp_path, "model=alexnet", "strategy=cpu_mp", "strategy.processes=2",
                        "cpu_allocator=auto,system", multirun=True)
    assert proc.returncode != 0, "the sweep reports that a job failed"
    got = {r.data.params["cpu_allocator"]: r for r in runs(f"sqlite:///{tmp_path / 'mlflow.db'}")}
    assert got["keep_freed"].info.status == "FINISHED" and "mean_epoch_time_s" in got["keep_freed"].data.metrics
    assert got["system"].info.status == "FAILED"
    assert "glibc cannot return to its default" in got["system"].data.tags["error"]


@pytest.mark.slow  # a preloaded train.py run
@pytest.mark.skipif(ctypes.util.find_library("jemalloc") is None,
                    reason="needs jemalloc to preload (Debian: apt-get install libjemalloc2, as the README's setup does)")
def test_a_run_under_a_preloaded_jemalloc_is_recorded_as_jemalloc(tmp_path):
    """With jemalloc in LD_PRELOAD, cpu_allocator=system would mislabel the run: refused before any
    work; the default (auto) trains as jemalloc, its rank workers (which check it again) inheriting
    the preload, and records it."""
    preload = {"LD_PRELOAD": "libjemalloc.so.2"}
    refused = run_train_py(tmp_path, "model=alexnet", "cpu_allocator=system", env=preload)
    _assert_clear_error(refused, r"cpu_allocator=system", r"libjemalloc\.so\.2", r"use cpu_allocator=jemalloc")
    proc = run_train_py(tmp_path, "model=alexnet", "strategy=cpu_mp", "strategy.processes=2", env=preload)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FINISHED" and run.data.params["cpu_allocator"] == "jemalloc"
