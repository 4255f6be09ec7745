"""Runs you can trust: every run its own folder and config, a true status and exit status on every
way out, resume into the same MLflow run, checkpoints that land whole, concurrent writers."""
from __future__ import annotations

import operator
import os
import re
import shutil
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import pytorch_lightning as pl
import torch
from conftest import PROJECT_DIR, TINY, alive, compose_config, rank_workers, runs, signalled, subprocess_env

from ddlx import run as run_module
from ddlx.errors import ConfigError, Stopped
from ddlx.run import train

FULL = ["checkpoint.save=full"]


class SignalAtStep(pl.Callback):
    """Sends ``signum`` to this process when training reaches ``step``: a stop at a known point."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            signal.raise_signal(self.signum)


def _with_callback(monkeypatch, make: Callable[[], pl.Callback]) -> None:
    """Each job of this test trains with a new ``make()`` besides ddlx's own callbacks."""
    measured = run_module.measurement_callbacks
    monkeypatch.setattr(run_module, "measurement_callbacks", lambda cfg: [*measured(cfg), make()])


def _with_signal_at(monkeypatch, step: int, signum: int) -> None:
    _with_callback(monkeypatch, lambda: SignalAtStep(step, signum))


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def _history(uri: str, run_id: str, metric: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, metric)]


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["sequential", *(pytest.param(s, marks=pytest.mark.slow, id=s.split()[0]) for s in (
    "ddp_gloo", "cpu_mp", "pipe strategy.engine=torch strategy.devices=[cpu,cpu] strategy.chunks=2 strategy.balance=auto"))])
def test_a_run_stopped_mid_epoch_resumes_into_the_same_run_as_if_never_stopped(tiny_config, tracking_uri, tmp_path,
                                                                               monkeypatch, strategy):
    """Ctrl-C at step 7 (epoch 3 of 3, after its first batch): a checkpoint of that step, the run
    KILLED; resumed from it, the same MLflow run goes on to FINISHED with one figure per epoch,
    its metrics and its weights those of a run that was never stopped: optimizer, loop, random
    state, the data position (the loader's own state, set before its worker reads an index) and
    the epoch's running sums restored (with several ranks, every rank's added up once) and each
    rank's own random state (a pipeline's last stage draws AlexNet's dropout masks, its first none;
    the profile of balance=auto on rank 0 draws none of the run's)."""
    job = ["model=alexnet", "trainer.max_epochs=3", "trainer.limit_train_batches=3", "data.num_workers=1", *FULL,
           *f"strategy={strategy}".split()]
    train(tiny_config(*job), tmp_path / "never_stopped")

    _with_signal_at(monkeypatch, step=7, signum=signal.SIGINT)
    with pytest.raises(Stopped) as stop:
        train(tiny_config(*job), tmp_path / "stopped")
    assert (stop.value.signal_name, stop.value.exit_status, stop.value.step) == ("SIGINT", 130, 7)
    checkpoint = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=True)
    assert stop.value.checkpoint == checkpoint and saved["global_step"] == 7
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 2, "batches_done": 1}]
    stopped = next(r for r in runs(tracking_uri) if r.info.status != "FINISHED")
    assert stopped.info.status == "KILLED" and "stopped by SIGINT after step 7" in stopped.data.tags["error"]

    monkeypatch.undo()
    train(tiny_config(*job, f"ckpt_path={checkpoint}", "logger.run_name=renamed"), tmp_path / "resumed")
    assert len(runs(tracking_uri)) == 2, "the resumed run is the stopped one, not a third"
    resumed = next(r for r in runs(tracking_uri) if r.info.run_id == stopped.info.run_id)
    assert resumed.info.status == "FINISHED" and resumed.data.tags["resumes"] == "1"
    assert resumed.info.run_name == "renamed", "a name given on resume is the run's (logger.* may change)"
    assert "error" not in resumed.data.tags and "SIGINT" in resumed.data.tags["previous_error"]
    assert [s for s, _ in _history(tracking_uri, stopped.info.run_id, "epoch_time_s")] == [3, 6, 9], "each epoch once"
    assert resumed.data.metrics["measured_epochs"] == 3
    assert not (tmp_path / "resumed" / "checkpoints").exists(), "a resumed run goes on in its checkpoint's folder"
    never, again = _weights(tmp_path / "never_stopped" / "checkpoints" / "last.ckpt"), _weights(checkpoint)
    for name, value in never.items():
        assert torch.allclose(value, again[name], atol=1e-6), name
    (unstopped,) = [r for r in runs(tracking_uri) if r.info.run_id != stopped.info.run_id]
    for metric in ("train_loss", "train_acc", "val_loss"):  # the stopped epoch's over all its batches too
        expected, got = (_history(tracking_uri, r.info.run_id, metric) for r in (unstopped, resumed))
        assert [s for s, _ in got] == [s for s, _ in expected] and \
            [v for _, v in got] == pytest.approx([v for _, v in expected], abs=1e-5), metric


@pytest.mark.slow
def test_a_stop_in_an_epochs_last_step_waits_for_the_epochs_end_and_resumes_as_if_never_stopped(tiny_config, tracking_uri,
                                                                                               tmp_path, monkeypatch):
    """Ctrl-C in epoch 2's last step: resumed from after that step, Lightning counts the epoch
    done and skips its validation and end, so epoch 2's figures were never logged. The stop
    waits for the epoch's end: the stopped run logs them, and its checkpoint is the epoch's."""
    job = ["model=alexnet", "trainer.max_epochs=3", "trainer.limit_train_batches=3", *FULL]
    train(tiny_config(*job), tmp_path / "never_stopped")
    (never,) = runs(tracking_uri)
    _with_signal_at(monkeypatch, step=6, signum=signal.SIGINT)
    with pytest.raises(Stopped) as stop:
        train(tiny_config(*job), tmp_path / "stopped")
    assert stop.value.step == 6 and torch.load(stop.value.checkpoint, weights_only=True)["epoch"] == 1
    (stopped,) = [r for r in runs(tracking_uri) if r.info.run_id != never.info.run_id]
    assert stopped.info.status == "KILLED"
    metrics = ("train_loss", "train_acc", "val_loss")
    for metric in metrics:  # epochs 1 and 2, as the run never stopped logged them
        expected, got = (_history(tracking_uri, r.info.run_id, metric) for r in (never, stopped))
        assert len(expected) == 3 and [s for s, _ in got] == [s for s, _ in expected[:2]], metric
        assert [v for _, v in got] == pytest.approx([v for _, v in expected[:2]], abs=1e-5), metric
    monkeypatch.undo()
    train(tiny_config(*job, f"ckpt_path={stop.value.checkpoint}"), tmp_path / "resumed")
    for metric in metrics:
        expected, got = (_history(tracking_uri, r.info.run_id, metric) for r in (never, stopped))
        assert [s for s, _ in got] == [s for s, _ in expected] and \
            [v for _, v in got] == pytest.approx([v for _, v in expected], abs=1e-5), metric
    assert [s for s, _ in _history(tracking_uri, stopped.info.run_id, "epoch_time_s")] == [3, 6, 9], "each epoch once"


@pytest.mark.integration
def test_a_stop_in_a_one_step_epoch_under_a_linked_folder_stops_at_the_next_epochs_start(tiny_config, tracking_uri,
                                                                                          tmp_path, monkeypatch):
    """Each step an epoch's last: the stop waits for the epoch's end and its checkpoint, which
    Lightning names by the folder's resolved path; compared with the link's, it was never seen
    written, and the signal was never acted on (the run trained to its end)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    _with_signal_at(monkeypatch, step=2, signum=signal.SIGINT)
    with pytest.raises(Stopped) as stop:
        train(tiny_config("trainer.max_epochs=4", "trainer.limit_train_batches=1", *FULL), tmp_path / "link" / "run")
    assert (stop.value.step, stop.value.after_training, stop.value.resumable) == (2, False, True)
    assert torch.load(stop.value.checkpoint, weights_only=True)["global_step"] == 2
    (run,) = runs(tracking_uri)
    assert run.info.status == "KILLED"


@pytest.mark.integration
def test_a_signal_to_another_rank_in_the_last_step_ends_the_process_as_stopped(tiny_config, tracking_uri, tmp_path,
                                                                                monkeypatch):
    """SIGTERM to rank 1 only, in the last epoch's last step: no stop is left to make (the run is
    FINISHED), but rank 0, whose exit status the job's is, must exit as stopped too, not 0."""
    class SignalRankOne(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
            if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and trainer.current_epoch == trainer.max_epochs - 1:
                (worker,) = rank_workers(os.getpid())
                worker.send_signal(signal.SIGTERM)

    _with_callback(monkeypatch, SignalRankOne)
    with pytest.raises(Stopped) as stop:
        train(tiny_config("trainer.max_epochs=2", "strategy=ddp_gloo", *FULL), tmp_path / "run")
    assert (stop.value.after_training, stop.value.exit_status) == (True, 143)
    (run,) = runs(tracking_uri)
    assert run.info.status == "FINISHED"


@pytest.mark.integration
def test_an_overfit_batches_run_resumes_as_if_never_stopped(tiny_config, tracking_uri, tmp_path, monkeypatch):
    """Lightning's overfit_batches would swap the training loader's sampler for its own
    SequentialSampler, which cannot resume: a resume then failed on an AttributeError."""
    job = ["model=alexnet", "trainer.max_epochs=3", "trainer.overfit_batches=2", "data.shuffle=true",
           "data.num_workers=1", *FULL]
    train(tiny_config(*job), tmp_path / "never_stopped")
    _with_signal_at(monkeypatch, step=3, signum=signal.SIGINT)
    with pytest.raises(Stopped) as stop:
        train(tiny_config(*job), tmp_path / "stopped")
    checkpoint = stop.value.checkpoint
    assert torch.load(checkpoint, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"] == \
        [{"epoch": 1, "batches_done": 1}]
    monkeypatch.undo()
    train(tiny_config(*job, f"ckpt_path={checkpoint}"), tmp_path / "resumed")
    assert {r.info.status for r in runs(tracking_uri)} == {"FINISHED"}
    never, again = _weights(tmp_path / "never_stopped" / "checkpoints" / "last.ckpt"), _weights(checkpoint)
    for name, value in never.items():
        assert torch.allclose(value, again[name], atol=1e-6), name


@pytest.mark.integration
def test_a_resume_that_would_close_the_run_before_the_epoch_its_checkpoint_is_within_is_refused(tiny_config, tmp_path,
                                                                                                monkeypatch):
    """Stopped within epoch 2 and resumed with trainer.max_epochs=1, the run closed FINISHED
    "after 1 epoch" while its weights held part of a second."""
    job = ["model=alexnet", "trainer.max_epochs=2", *FULL]  # 2 steps an epoch
    _with_signal_at(monkeypatch, step=3, signum=signal.SIGINT)
    with pytest.raises(Stopped) as stop:
        train(tiny_config(*job), tmp_path / "stopped")
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"written within epoch 2.*resume with trainer.max_epochs=2 or more"):
        train(tiny_config("model=alexnet", "trainer.max_epochs=1", *FULL, f"ckpt_path={stop.value.checkpoint}"), tmp_path / "r")


@pytest.mark.integration
def test_a_folder_of_images_resumes_from_where_it_moved_under_another_name(tiny_config, tracking_uri, tmp_path, data_dir):
    """data=imagefolder names the data by its folder: a resume from the folder moved and renamed
    (data.root may move) was refused for data.name, and adding data.name failed on the folder."""
    synthetic = next((data_dir / "synthetic").glob("firesmall-n48-*"))
    first, moved = tmp_path / "photos", tmp_path / "moved" / "photos_2026"
    shutil.copytree(synthetic, first)
    job = ["model=alexnet", "data=imagefolder", "data.image_size=32", *FULL]
    train(tiny_config(*job, f"data.root={first}"), tmp_path / "a")
    shutil.move(first, moved)
    train(tiny_config(*job, f"data.root={moved}", "trainer.max_epochs=2",
                      f"ckpt_path={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}"), tmp_path / "b")
    (run,) = runs(tracking_uri)
    assert run.info.status == "FINISHED" and "data.name=photos_2026" in run.data.tags["resume_changes"]


class TwoCtrlCsInValidation(pl.Callback):
    """Two SIGINTs within the validation of ``epoch``: the second stops at once."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.current_epoch == self.epoch and not trainer.sanity_checking:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)


@pytest.mark.integration
def test_a_second_ctrl_c_stops_at_once_and_names_the_last_checkpoint_which_resumes(tiny_config, tracking_uri, tmp_path,
                                                                                    monkeypatch):
    """It said "stopped by SIGINT before training; no checkpoint written" and printed no resume
    line, while the last epoch's checkpoint resumes."""
    job = ["model=alexnet", "trainer.max_epochs=2", *FULL]
    _with_callback(monkeypatch, lambda: TwoCtrlCsInValidation(1))
    with pytest.raises(Stopped) as stop:
        train(tiny_config(*job), tmp_path / "stopped")
    monkeypatch.undo()
    checkpoint = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    assert stop.value.at_once and stop.value.resumable and stop.value.checkpoint == checkpoint and stop.value.step == 4
    (run,) = runs(tracking_uri)
    assert run.info.status == "KILLED"
    assert re.search(r"stopped at once by a second SIGINT after step 4; the last checkpoint, written before it: \S+last.ckpt",
                     run.data.tags["error"]), run.data.tags["error"]
    train(tiny_config(*job, f"ckpt_path={checkpoint}"), tmp_path / "resumed")
    (run,) = runs(tracking_uri)
    assert run.info.status == "FINISHED"


@pytest.mark.integration
def test_sigusr1_slurms_preemption_warning_checkpoints_and_stops(tiny_config, tracking_uri, tmp_path, monkeypatch):
    _with_signal_at(monkeypatch, step=1, signum=signal.SIGUSR1)
    with pytest.raises(Stopped) as stop:
        train(tiny_config(*FULL), tmp_path / "preempted")
    assert stop.value.exit_status == 138 and stop.value.checkpoint.is_file()
    (run,) = runs(tracking_uri)
    assert run.info.status == "KILLED" and "SIGUSR1" in run.data.tags["error"]


def _params(*overrides: str) -> dict[str, str]:
    """A run's params (as a checkpoint keeps its config) of train.py's config with ``overrides``."""
    from dataclasses import asdict

    from ddlx.config_check import typed_config
    from ddlx.tracking import flatten_config

    return flatten_config(asdict(typed_config(compose_config([*TINY, *overrides]))))


@pytest.mark.parametrize("composed, keys_known, val_fraction", [(True, True, "0"), (True, False, "0.3"), (False, False, "0")],
                         ids=["in a Hydra job", "outside one", "options not composed"])
def test_a_resume_on_another_option_of_a_group_names_that_option(tmp_path, composed, keys_known, val_fraction):
    """Resumed with data=cifar10 for a run of firesmall (ten values differ), the refusal says
    data=firesmall, the values the run set otherwise (TINY's) and those this command sets
    (data.val_fraction, to cifar10's own 0 where the job's overrides are known); the words, in
    place of the command's group options, resume the run. Where options cannot be composed, every
    value of the group is given, the dataset by data.name."""
    from ddlx.checkpoints import SavedRun, check_resumable
    from ddlx.config_check import option_params

    saved = SavedRun(tmp_path / "last.ckpt", None, None, None, {"params": _params("model=resnet18")}, 1, 6, 1)
    params = operator.itemgetter("params")  # (as flatten_config flattens a checkpoint's config)
    command = ["model=resnet18", f"data.val_fraction={val_fraction}"]  # (firesmall's own is 0.2)
    groups = ["data=cifar10", "strategy=cpu_mp", "strategy.processes=2"]
    keys = frozenset(o.split("=")[0] for o in [*command, *groups]) if keys_known else None
    with pytest.raises(ConfigError) as refused:
        check_resumable(saved, _params(*command, *groups), params, option_params if composed else None, keys)
    said = str(refused.value)
    assert "written by a run with strategy=sequential (now cpu_mp), " in said and "data=firesmall (now cifar10)" in said, said
    assert f"data.val_fraction=0.2 (now {float(val_fraction)})" in said
    assert "settings; in place of strategy=cpu_mp data=cifar10, resume with " in said, said
    fix = re.search(r"resume with (.*), or start a new run", said).group(1).split()
    dataset = "data=firesmall" if composed else "data.name=firesmall"
    assert fix[0] == "strategy=sequential" and {dataset, "data.val_fraction=0.2"} <= set(fix), fix
    if composed:  # what data=firesmall and strategy=sequential give back is not listed
        assert "data.classes" not in said and not any(w.startswith(("data.classes", "data.mean", "strategy.threads"))
                                                      for w in fix), fix
    assert check_resumable(saved, _params(*command, *fix), params) == {}, "the words resume it"


@pytest.mark.integration
def test_a_checkpoint_resumes_only_the_run_it_belongs_to(tiny_config, tracking_uri, tmp_path, data_dir):
    job = ["model=resnet18", *FULL]
    train(tiny_config(*job), tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"ckpt_path=.*was written by a run with optim.lr=0.005 \(now 0.05\).*"
                                          r"resume with optim.lr=0.005"):
        train(tiny_config(*job, "optim.lr=0.05", f"ckpt_path={checkpoint}"), tmp_path / "b")
    with pytest.raises(ConfigError, match=r"ckpt_path=.*nope.ckpt does not exist"):
        train(tiny_config(*job, f"ckpt_path={tmp_path}/nope.ckpt"), tmp_path / "c")
    with pytest.raises(ConfigError, match=r"resume with trainer.gradient_clip_val=null,"):  # as Hydra takes it
        train(tiny_config(*job, "trainer.gradient_clip_val=0.5", f"ckpt_path={checkpoint}"), tmp_path / "b")
    with pytest.raises(ConfigError, match=r"FINISHED, and trainer.max_epochs=1 leave\(s\) nothing to train after its 1 "
                                          r"epoch\(s\); raise it to train on \(e.g. trainer.max_epochs=2\)"):
        train(tiny_config(*job, f"ckpt_path={checkpoint}"), tmp_path / "b")
    with pytest.raises(ConfigError, match=r"with strategy=sequential \(now cpu_mp\).*resume with strategy=sequential\b") as refused:
        train(tiny_config(*job, "strategy=cpu_mp", "strategy.processes=2", f"ckpt_path={checkpoint}"), tmp_path / "b")
    fix = re.search(r"resume with (.*), or start a new run", str(refused.value)).group(1).split()
    from ddlx.config_check import check_config

    check_config(compose_config([*TINY, *job, *fix]))  # the advice is a command line train.py takes (its knobs were cpu_mp's)
    folder = next((data_dir / "synthetic").glob("firesmall-n48-*"))  # the same images, as a folder of real ones
    with pytest.raises(ConfigError, match=r"written by a run on synthetic images, and this one would train on the images "
                                          r"of data.root=\S+: one run of two datasets"):
        train(tiny_config(*job, f"data.root={folder}", "trainer.max_epochs=2", f"ckpt_path={checkpoint}"), tmp_path / "b")
    running = next(iter(runs(tracking_uri)))
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).update_run(running.info.run_id, status="RUNNING")  # as if this process still ran it
    with pytest.raises(ConfigError, match=rf"MLflow run {running.info.run_id} is still running \(pid {os.getpid()}"):
        train(tiny_config(*job, f"ckpt_path={checkpoint}"), tmp_path / "d")
    other = tmp_path / "other.db"
    with pytest.raises(ConfigError, match=rf"which sqlite:///{other} does not hold.*logger.tracking_uri={tracking_uri}"):
        train(tiny_config(*job, f"ckpt_path={checkpoint}", f"logger.tracking_uri=sqlite:///{other}"), tmp_path / "e")
    assert not other.exists(), "refused without making the store it names"


@pytest.mark.integration
def test_checkpoint_policies(tiny_config, tmp_path):
    """Default: one last.ckpt, resumable; weights only: the model alone, refused for resuming with
    the reason; keep_best adds the best by val_acc; none writes nothing."""
    train(tiny_config("checkpoint.save=weights", "checkpoint.keep_best=true"), tmp_path / "weights")
    files = sorted(p.name for p in (tmp_path / "weights" / "checkpoints").iterdir())
    assert files[-1] == "last.ckpt" and re.fullmatch(r"best-epoch0-val_acc[\d.]+\.ckpt", files[0]) and len(files) == 2
    from hydra.core.override_parser.overrides_parser import OverridesParser

    best = tmp_path / "weights" / "checkpoints" / files[0]
    (given,) = OverridesParser.create().parse_overrides([f"ckpt_path={best}"])  # as written, unquoted
    assert given.value() == str(best)
    assert "optimizer_states" not in torch.load(tmp_path / "weights" / "checkpoints" / "last.ckpt", weights_only=True)
    with pytest.raises(ConfigError, match=r"holds the model's weights only .*checkpoint.save=full"):
        train(tiny_config(f"ckpt_path={tmp_path / 'weights' / 'checkpoints' / 'last.ckpt'}"), tmp_path / "again")
    train(tiny_config("checkpoint.save=none"), tmp_path / "none")
    assert not (tmp_path / "none" / "checkpoints").exists()


@pytest.mark.integration
def test_a_checkpoint_write_cut_short_leaves_no_file_under_a_valid_name(tiny_config, tracking_uri, tmp_path):
    """The file system refuses the write past 20 MB (as a full disk would; Python ignores SIGXFSZ,
    so the write fails): the run is FAILED with the error, and no truncated checkpoint (nor its
    partial file) is left under the checkpoint's name."""
    import resource

    cfg = tiny_config(*FULL, "model=resnet18")  # a 90 MB checkpoint
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 2**20, hard))
    try:
        with pytest.raises(OSError, match=r"checkpoint \S*last.ckpt not written"):
            train(cfg, tmp_path / "run")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    (run,) = runs(tracking_uri)
    assert run.info.status == "FAILED" and re.search(r"checkpoint \S*last.ckpt not written", run.data.tags["error"])
    assert not list((tmp_path / "run" / "checkpoints").iterdir()), "neither a truncated last.ckpt nor its partial file"


@pytest.mark.integration
def test_errors_before_and_after_the_run_opens_and_runs_without_a_step(tiny_config, tracking_uri, tmp_path,
                                                                          monkeypatch, capsys):
    """A value Lightning refuses when the Trainer is built: refused before any run is opened. An
    error once it is open: FAILED with the error. A run without a measured step: not counted."""
    with pytest.raises(ConfigError, match=r"Lightning refused the trainer settings.*not a valid duration"):
        train(tiny_config("trainer.max_time=abc"), tmp_path / "bad")
    assert runs(tracking_uri) == []
    from ddlx.module import ClassifierModule

    with monkeypatch.context() as patch:
        patch.setattr(ClassifierModule, "training_step", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            train(tiny_config(), tmp_path / "boom")
    (failed,) = runs(tracking_uri)
    assert failed.info.status == "FAILED" and failed.data.tags["error"] == "RuntimeError: boom"
    capsys.readouterr()
    train(tiny_config("trainer.fast_dev_run=true"), tmp_path / "smoke")
    smoke = next(r for r in runs(tracking_uri) if r.info.run_id != failed.info.run_id)
    assert smoke.info.status == "FINISHED" and smoke.data.tags["measured"] == "false"
    from ddlx.measure.speedup_table import build_report
    from ddlx.records import not_measured_because
    from ddlx.tracking import load_runs

    (record,) = [r for r in load_runs(tracking_uri, ["ddlx"]) if r.run_id == smoke.info.run_id]
    said = [line for line in capsys.readouterr().out.splitlines() if "not counted" in line]
    assert said == [f"  not counted by the report or recommend.py: {not_measured_because(record)}"], "the report's reason"

    report = build_report(load_runs(tracking_uri, ["ddlx"]))
    assert not report.rows and [r.run_id for r in report.unmeasured] == [smoke.info.run_id]


def test_a_run_whose_process_vanished_is_marked_failed():
    from ddlx.tracking import STALE_AFTER_S, process_key, vanished_reason

    now = time.time()

    def run(host, key="", beat=now):
        tags = {"host": host, "heartbeat": f"{beat:.0f}", "pid": key.split(":")[2] if key else "", "process": key}
        return SimpleNamespace(data=SimpleNamespace(tags=tags), info=SimpleNamespace(start_time=int(now * 1000)))

    import socket

    here, mine = socket.gethostname(), process_key(os.getpid())
    assert vanished_reason(run(here, mine)) is None, "this process is alive"
    boot, namespace, pid, started = mine.split(":")
    reused = f"{boot}:{namespace}:{pid}:{int(started) - 100}"
    assert "ended without closing the run" in vanished_reason(run(here, reused)), "the pid is another process's now"
    other_container = f"{boot}:{int(namespace) + 1}:{pid}:{started}"
    assert vanished_reason(run(here, other_container)) is None, "another pid namespace: its heartbeat decides"
    assert vanished_reason(run("node7", beat=now - 10)) is None
    assert "no heartbeat from node7" in vanished_reason(run("node7", beat=now - STALE_AFTER_S - 60))


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _an_epoch_done(tmp_path: Path) -> bool:
    """The run has timed its first epoch (read under the store's lock, as a training job opens it)."""
    from ddlx.tracking import store_lock

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    if not (tmp_path / "mlflow.db").exists():
        return False
    with store_lock(uri):
        return any("epoch_time_s" in r.data.metrics for r in runs(uri))


DDP_JOB = [*TINY, *FULL, "model=resnet18", "strategy=ddp_gloo", "trainer.max_epochs=4", "trainer.limit_train_batches=1.0",
           "data.num_images=96"]


def _sigterm_to_rank_0_of_a_ddp_run(tmp_path: Path) -> Path:
    """What SLURM, Kubernetes and timeout send: every rank stops after the same step, rank 0 writes
    the checkpoint, the run is KILLED and the process exits 143, leaving no rank behind."""
    proc = subprocess.Popen([sys.executable, str(PROJECT_DIR / "train.py"), f"paths.root={tmp_path}", *DDP_JOB],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=tmp_path)
    workers = _wait_for(lambda: rank_workers(proc.pid), 120, "rank 1")
    _wait_for(lambda: _an_epoch_done(tmp_path), 120, "the first epoch")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert not alive(workers), "no rank left behind"
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "KILLED" and "stopped by SIGTERM after step" in run.data.tags["error"]
    checkpoint = Path(re.search(r"resume with: python train.py .* ckpt_path=(\S+)", err).group(1))
    assert checkpoint.is_file()
    return checkpoint


@pytest.mark.integration
def test_sigterm_to_rank_0_of_a_ddp_run_stops_every_rank_with_a_checkpoint(tmp_path):
    _sigterm_to_rank_0_of_a_ddp_run(tmp_path)


@pytest.mark.slow
def test_a_ddp_run_stopped_by_sigterm_resumes_on_every_rank(tmp_path):
    checkpoint = _sigterm_to_rank_0_of_a_ddp_run(tmp_path)
    resumed = subprocess.run([sys.executable, str(PROJECT_DIR / "train.py"), f"paths.root={tmp_path}", *DDP_JOB,
                              f"ckpt_path={checkpoint}"], capture_output=True, text=True, timeout=300,
                             env=subprocess_env(), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "FINISHED" and run.data.metrics["measured_epochs"] == 4


@pytest.mark.integration
def test_kill_9_of_rank_0_ends_every_process_closes_the_run_and_it_resumes_from_the_last_epoch_end(tmp_path):
    """kill -9 (the OOM killer, a lost shell) of rank 0 of a DDP run with loader workers: its
    other processes (the rank fork server, rank 1, every loader worker) end within 5 s; the run is
    FAILED with the reason without another command (its watch process records it, then ends);
    the watch says how to resume, as the process would have, and that command resumes it from the
    checkpoint of the last epoch's end, into the same run, to FINISHED."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = [f"paths.root={tmp_path}", *TINY, *FULL, "strategy=ddp_gloo", "data.num_workers=1", "trainer.max_epochs=50"]
    console = tmp_path / "console.txt"  # the terminal the run and its watch write to
    with console.open("w") as terminal:
        proc = subprocess.Popen([sys.executable, str(PROJECT_DIR / "train.py"), *job], stdout=subprocess.DEVNULL,
                                stderr=terminal, env=subprocess_env(), cwd=tmp_path)
    _wait_for(lambda: rank_workers(proc.pid), 120, "rank 1")
    _wait_for(lambda: _an_epoch_done(tmp_path), 120, "the first epoch")
    checkpoint = _wait_for(lambda: next(tmp_path.glob("outputs/*/*/checkpoints/last.ckpt"), None), 60, "last.ckpt")
    tree = psutil.Process(proc.pid).children(recursive=True)
    watch = [p for p in tree if "ddlx.run_watch" in " ".join(p.cmdline())]
    run_processes = [p for p in tree if p not in watch]
    assert len(watch) == 1 and len(run_processes) >= 4, [p.name() for p in tree]  # server, rank 1, 2 loaders at least
    assert "trainer.max_epochs=50" not in " ".join(watch[0].cmdline()), "a pkill -f of the job's words leaves its watch"
    proc.kill()
    proc.wait()
    _wait_for(lambda: not alive(run_processes), 5, "every process of the run to end within 5 s of rank 0")
    (run,) = _wait_for(lambda: [r for r in runs(uri) if r.info.status == "FAILED"], 60, "the watch to close the run")
    assert f"pid {proc.pid}" in run.data.tags["error"] and "ended without closing the run" in run.data.tags["error"]
    _wait_for(lambda: not alive(watch), 10, "the watch to end")
    said = [line for line in console.read_text().splitlines() if line.startswith("ddlx: ")]
    assert said[-2].startswith(f"ddlx: MLflow run {run.info.run_id} marked FAILED: its process (pid {proc.pid}"), said
    assert "was left RUNNING" not in console.read_text(), "said once, in the watch's own line"
    assert said[-1].startswith("ddlx: resume with: python train.py "), said

    saved_epoch = torch.load(checkpoint, map_location="cpu", weights_only=True)["epoch"]
    printed = shlex.split(said[-1].removeprefix("ddlx: resume with: python train.py "))
    assert printed == [*job, f"ckpt_path={checkpoint}"], printed  # the job's own words, and its checkpoint
    resume = [w if w != "trainer.max_epochs=50" else f"trainer.max_epochs={saved_epoch + 2}" for w in printed]
    resumed = subprocess.run([sys.executable, str(PROJECT_DIR / "train.py"), *resume], capture_output=True, text=True,
                             timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (run,) = runs(uri)
    assert run.info.status == "FINISHED" and run.data.tags["resumes"] == "1" and "ended without" in run.data.tags["previous_error"]


@pytest.mark.integration
def test_ddp_sweeps_started_at_once_each_get_their_own_folders_config_and_record(tmp_path):
    """Two sweeps of one DDP job each, with their own seeds and learning rates, started together
    against a store that does not exist yet: each is recorded with its own sweep_id and folder,
    every rank of a run on that run's own config. (Four writers at once: test_tracking.py.)"""
    seeds = {"11": "0.01", "22": "0.02"}
    procs = [subprocess.Popen([sys.executable, str(PROJECT_DIR / "train.py"), "-m", *TINY, "strategy=ddp_gloo",
                               f"seed={s}", f"optim.lr={lr}", f"paths.root={tmp_path}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=subprocess_env(), cwd=tmp_path)
             for s, lr in seeds.items()]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    for seed, out in zip(seeds, outputs):
        assert set(re.findall(r"Seed set to (\d+)", out)) == {seed}, f"every rank of the seed={seed} run"
    recorded = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert sorted(r.data.params["seed"] for r in recorded) == ["11", "22"]
    assert all(r.info.status == "FINISHED" for r in recorded)
    assert len({r.data.tags["output_dir"] for r in recorded}) == 2 and len({r.data.tags["sweep_id"] for r in recorded}) == 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for r in recorded:
        config = Path(client.download_artifacts(r.info.run_id, "config_resolved.yaml", str(tmp_path / r.info.run_id)))
        assert f"seed: {r.data.params['seed']}" in config.read_text()


def test_a_slurm_job_stopped_with_a_checkpoint_is_resumed_only_once_slurm_requeued_it(tmp_path, monkeypatch, capsys):
    """The marker a requeued job resumes from (ddlx.slurm): written by rank 0 when a stop leaves a
    resumable checkpoint, read only by a start that SLURM counts as a restart; the warning signal
    requeues the job, SIGTERM does not; scontrol's refusal is said with the way to resume by hand."""
    from ddlx.errors import Stopped
    from ddlx.slurm import RequeueMarker

    calls = tmp_path / "scontrol-calls"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n[ "$2" != refused ] || {{ echo "Requeue not allowed" >&2; exit 1; }}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    checkpoint = tmp_path / "run" / "last.ckpt"

    marker = RequeueMarker.of_this_job(tmp_path, sweep_job="3")
    marker.after_stop(Stopped(signal.SIGTERM, checkpoint, step=5, resumable=True), rank0=False)
    assert not marker.path.exists(), "only rank 0 leaves it"
    marker.after_stop(Stopped(signal.SIGTERM, checkpoint, step=5, resumable=True), rank0=True)
    assert marker.path.name == "41-3" and not calls.exists(), "SIGTERM leaves the marker, and does not requeue"
    assert marker.checkpoint_to_resume() is None, "a first start resumes nothing"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert marker.checkpoint_to_resume() == str(checkpoint.resolve())

    marker.after_stop(Stopped(signal.SIGUSR1, checkpoint, step=9, resumable=True), rank0=True)
    assert calls.read_text().split() == ["requeue", "41"]
    marker.forget()
    assert marker.checkpoint_to_resume() is None

    monkeypatch.setenv("SLURM_JOB_ID", "refused")
    RequeueMarker.of_this_job(tmp_path, None).after_stop(Stopped(signal.SIGUSR2, checkpoint, 9, resumable=True), rank0=True)
    err = capsys.readouterr().err
    assert "did not requeue job refused" in err and "Requeue not allowed" in err and f"ckpt_path={checkpoint}" in err
    weights_only = RequeueMarker.of_this_job(tmp_path / "w", None)
    weights_only.after_stop(Stopped(signal.SIGUSR1, checkpoint, 9, resumable=False), rank0=True)
    assert not weights_only.path.exists(), "nothing to resume from"


@pytest.mark.integration
@pytest.mark.parametrize("validation,steps", [([], 2), (["trainer.check_val_every_n_epoch=2"], 2),
                                              (["trainer.limit_train_batches=3", "trainer.val_check_interval=2"], 3)],
                         ids=["every_epoch", "every_2nd_epoch", "within_the_epoch"])
def test_last_ckpt_is_rewritten_at_every_epoch_end_and_every_n_minutes_within_one(tiny_config, tmp_path, monkeypatch,
                                                                                  validation, steps):
    """What a kill -9 can lose: at most the work since the last epoch's end, or since the last
    checkpoint.every_minutes within an epoch (a run started before one is killed resumes from it),
    however often it validates."""
    seen: list[tuple[str, int, int]] = []

    class Look(pl.Callback):
        def _look(self, when: str, trainer) -> None:
            checkpoint = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
            saved = torch.load(checkpoint, weights_only=True)["global_step"] if checkpoint.exists() else None
            seen.append((when, trainer.global_step, saved))

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self._look("epoch start", trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._look("step", trainer)

        def on_validation_start(self, trainer, pl_module) -> None:
            if not trainer.sanity_checking:
                self._look("validation", trainer)

    _with_callback(monkeypatch, Look)
    train(tiny_config(*FULL, "checkpoint.background=false", "trainer.max_epochs=3", *validation), tmp_path / "run")
    starts = [(0, None), (steps, steps), (2 * steps, 2 * steps)]
    assert [(g, s) for when, g, s in seen if when == "epoch start"] == starts, seen
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3 * steps, \
        "the run's end in last.ckpt"
    seen.clear()
    train(tiny_config(*FULL, "checkpoint.background=false", "checkpoint.every_minutes=1e-9"), tmp_path / "minutes")
    assert [(g, s) for when, g, s in seen if when == "step"] == [(0, None), (1, 1)], "saved within the epoch"
    # Not after the epoch's last batch: a kill during its validation resumes from within the epoch,
    # which then validates and ends; resumed from after its last batch, it would do neither.
    assert [(g, s) for when, g, s in seen if when == "validation"] == [(2, 1)], seen


def test_a_checkpoint_written_in_the_background_holds_the_state_it_was_taken_at(tmp_path):
    """The training step goes on while the disk writes: the file holds the tensors as they were
    when the checkpoint was taken, not as later steps changed them; a refused write is raised."""
    from ddlx.checkpoints import checkpoint_writer
    from ddlx.errors import CheckpointNotWritten

    writer = checkpoint_writer(background=True)
    weights = torch.zeros(1000, 1000)
    writer.save_checkpoint({"state_dict": {"w": weights}}, tmp_path / "last.ckpt")
    weights += 1  # the next step, while the file is written
    writer.teardown()  # what Lightning calls when training ends: waits for the writes
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]["w"].sum() == 0
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):  # raised at the next save or, at the latest, when the writes are waited for
        writer.save_checkpoint({"w": weights}, tmp_path / "file" / "last.ckpt")  # under a file: cannot be written
        writer.teardown()
    assert issubclass(CheckpointNotWritten, OSError)


class SignalAt(pl.Callback):
    """Raises ``SIGTERM`` in this process at ``point`` of the run (the checkpoint write: see the test)."""

    def __init__(self, point: str) -> None:
        self.point = point

    def setup(self, trainer, pl_module, stage) -> None:
        if self.point == "setup":
            signal.raise_signal(signal.SIGTERM)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.point == "training step" and trainer.global_step == 1:
            signal.raise_signal(signal.SIGTERM)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.point == "validation" and not trainer.sanity_checking and trainer.current_epoch == 0:
            signal.raise_signal(signal.SIGTERM)

    def teardown(self, trainer, pl_module, stage) -> None:
        if self.point == "teardown":
            signal.raise_signal(signal.SIGTERM)


@pytest.mark.integration
@pytest.mark.parametrize("point,status,step", [
    ("setup", "KILLED", None),            # before training: at once, nothing to keep
    ("training step", "KILLED", 1),       # after the step it came in, with its checkpoint
    ("validation", "KILLED", 2),          # after that epoch's end, with its checkpoint and its training metrics logged
    ("checkpoint write", "KILLED", 2),    # the epoch end's write completes, and the next epoch's start stops with it
    ("teardown", "FINISHED", 4),          # training was done: the run is, and the process says it was stopped
])
def test_a_stop_signal_at_any_point_ends_the_run_with_its_status_and_no_loader_worker_left(
        point, status, step, tiny_config, tracking_uri, tmp_path, monkeypatch):
    from ddlx.checkpoints import AtomicCheckpointIO

    _with_callback(monkeypatch, lambda: SignalAt(point))
    if point == "checkpoint write":
        write = AtomicCheckpointIO.save_checkpoint

        def signalled_write(self, *args, **kwargs):
            signal.raise_signal(signal.SIGTERM)
            write(self, *args, **kwargs)
            monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", write)

        monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", signalled_write)
    with pytest.raises(Stopped) as stop:
        train(tiny_config(*FULL, "data.num_workers=1", "trainer.max_epochs=2"), tmp_path / "run")
    assert stop.value.exit_status == 143 and stop.value.step == step
    assert stop.value.after_training == (point == "teardown")
    (run,) = runs(tracking_uri)
    assert run.info.status == status
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists() == (point != "setup")
    if point in ("validation", "checkpoint write"):  # a stop within the epoch's end lost them
        assert "train_loss" in run.data.metrics and "train_acc" in run.data.metrics
    loaders = alive(c for c in psutil.Process().children() if c.name() == "ddlx-loader")
    assert not loaders, "the loader workers ended with the run (multiprocessing would wait for them at exit)"


def test_a_stopped_runs_record_is_written_before_lightnings_teardown_and_after_its_checkpoint(
        tiny_config, tracking_uri, tmp_path, monkeypatch):
    """mpirun turns Ctrl-C into SIGTERM to each rank, and SIGKILL 1 s later: a rank killed in
    Lightning's teardown (loader workers, the process group) left its run FAILED with no reason,
    Lightning's own "failed". The stop's record (KILLED, the signal, the checkpoint) is written
    before that teardown, Lightning's "failed" not at all, and not before the checkpoint it names
    is on disk (written in the background, slowly here)."""
    from ddlx import tracking
    from ddlx.checkpoints import AtomicCheckpointIO

    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    write, end_run, teardown = AtomicCheckpointIO.save_checkpoint, tracking.end_run, pl.Trainer._teardown  # noqa: SLF001
    on_disk, seen = [], []

    def slow_write(self, *args, **kwargs):
        time.sleep(1)
        write(self, *args, **kwargs)

    def noting_end_run(client, run_id, status, error=None):
        on_disk.append((status, checkpoint.is_file()))
        end_run(client, run_id, status, error)

    def record_then_teardown(trainer):  # where the kill would fall
        (run,) = runs(tracking_uri)
        seen.append((run.info.status, run.data.tags.get("error", "")))
        teardown(trainer)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", slow_write)
    monkeypatch.setattr(tracking, "end_run", noting_end_run)
    monkeypatch.setattr(pl.Trainer, "_teardown", record_then_teardown)
    _with_callback(monkeypatch, lambda: SignalAt("training step"))
    with pytest.raises(Stopped):
        train(tiny_config(*FULL, "trainer.max_epochs=2", "checkpoint.background=true"), tmp_path / "run")
    status, error = seen[0]
    assert status == "KILLED" and error.startswith("stopped by SIGTERM after step 1; checkpoint "), seen
    assert on_disk[0] == ("KILLED", True), "recorded once its checkpoint was written"


@pytest.mark.integration
def test_a_stop_signal_to_the_process_group_during_validation_exits_at_once(tmp_path):
    """Ctrl-C, timeout or a scheduler signal every process of the group: the loader workers leave
    it to the training process, which stops after that validation with a checkpoint and exits
    143 within 10 s (it used to wait for ever for workers that ignored multiprocessing's SIGTERM)."""
    sent = tmp_path / "signal-sent"
    proc = signalled(tmp_path, "validation", "SIGTERM", f"paths.root={tmp_path}", *TINY, *FULL, "data.num_workers=2",
                     "trainer.max_epochs=4", env={"DDLX_SIGNAL_SENT": str(sent)})
    ended = time.time()
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert ended - float(sent.read_text()) < 10, "ended within 10 s of the signal"
    (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.info.status == "KILLED" and "stopped by SIGTERM" in run.data.tags["error"]
    assert re.search(r"ddlx: resume with: python train.py .*ckpt_path=\S+last.ckpt", proc.stderr)


@pytest.mark.integration
def test_a_run_that_fails_says_how_to_resume_from_its_last_checkpoint(tiny_config, tracking_uri, tmp_path, monkeypatch,
                                                                    capsys):
    """An error in epoch 2 (out of memory, a lost connection): the run is FAILED, and the console
    gave only its checkpoint's path, not the command that resumes it from epoch 1's end."""
    class FailAtStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
            if trainer.global_step == 3:
                raise RuntimeError("CUDA out of memory (a stand-in)")

    _with_callback(monkeypatch, FailAtStep)
    job = ["trainer.max_epochs=2", *FULL]
    with pytest.raises(RuntimeError, match="stand-in"):
        train(tiny_config(*job), tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert f"ddlx: resume with: python train.py ckpt_path={checkpoint}" in capsys.readouterr().err.splitlines()
    monkeypatch.undo()
    train(tiny_config(*job, f"ckpt_path={checkpoint}"), tmp_path / "resumed")
    (run,) = runs(tracking_uri)
    assert run.info.status == "FINISHED" and run.data.tags["resumes"] == "1"
    assert [s for s, _ in _history(tracking_uri, run.info.run_id, "epoch_time_s")] == [2, 4]


@pytest.mark.integration
def test_a_refused_checkpoint_write_is_one_line_and_a_failed_run(capsys):
    from ddlx.entry import run_training_job
    from ddlx.errors import CheckpointNotWritten

    def refused():
        raise CheckpointNotWritten("checkpoint /x/last.ckpt not written (No space left on device)")

    with pytest.raises(SystemExit) as end:
        run_training_job(refused, in_sweep=False, overrides=[])
    assert end.value.code == 1
    err = capsys.readouterr().err
    assert err.strip() == "ddlx: error: checkpoint /x/last.ckpt not written (No space left on device)"


@pytest.mark.integration
def test_a_process_ended_but_not_yet_reaped_is_gone():
    from ddlx.tracking import process_key

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    _wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 30, "the child to end")
    assert process_key(child.pid) is None, "a zombie is not the run's process any more"
    child.wait()


@pytest.mark.integration
def test_a_sweep_job_refused_for_its_data_is_a_failed_run(tiny_config, tracking_uri, tmp_path):
    """Refused while its folder is read (one class folder: no classifier), before its data has a
    name: still one FAILED run of the sweep, with the reason."""
    (tmp_path / "one_class" / "a").mkdir(parents=True)
    cfg = tiny_config("data=imagefolder", f"data.root={tmp_path / 'one_class'}")
    with pytest.raises(ConfigError, match=r"data.root=\S+one_class has one class sub-folder"):
        train(cfg, tmp_path / "run", extra_tags={"sweep_id": "multirun/x", "sweep_job": "0"})
    (run,) = runs(tracking_uri)
    assert run.info.status == "FAILED" and "one class sub-folder" in run.data.tags["error"]
    assert run.data.tags["sweep_id"] == "multirun/x"


@pytest.mark.integration
def test_a_run_that_is_not_mpi_leaves_mpi_alone(tiny_config, tmp_path, monkeypatch):
    """Lightning is handed its cluster environment, so it never asks mpi4py (which starts MPI and
    an OpenMPI orted); an error outside an MPI job ends the process without MPI_Abort's banner."""
    from lightning_fabric.plugins.environments import MPIEnvironment

    from ddlx.parallel.mpi_ranks import abort_job

    def detect():
        raise AssertionError("MPIEnvironment.detect imports mpi4py")

    monkeypatch.setattr(MPIEnvironment, "detect", staticmethod(detect))
    train(tiny_config(), tmp_path / "run")
    aborted = []
    fake = SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False,
                           COMM_WORLD=SimpleNamespace(Abort=aborted.append))
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    abort_job(1)
    assert aborted == [], "no MPI_Abort outside an MPI job"
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    abort_job(1, show_traceback=False)
    assert aborted == [1]


def test_the_console_times_an_epoch_resumed_mid_way_from_the_resume_and_says_whether_it_validated(tmp_path, caplog):
    """Resumed mid-epoch, Lightning skips on_train_epoch_start: the epoch line said the seconds
    since the machine booted (69463.0 s). An epoch without validation is not said to have one."""
    import logging

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ddlx.console import EpochLines

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)

    def fit(epochs: int, ckpt_path=None, **kw):
        pl.Trainer(max_epochs=epochs, callbacks=[EpochLines(), *kw.pop("callbacks", [])], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0, default_root_dir=tmp_path,
                   **kw).fit(Tiny(), data, data, ckpt_path=ckpt_path)

    fit(1, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="mid-{step}", auto_insert_metric_name=False,
                                      every_n_train_steps=2, save_top_k=-1)], limit_val_batches=1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddlx.console"):
        fit(2, ckpt_path=tmp_path / "mid-2.ckpt", check_val_every_n_epoch=2)  # 2 of epoch 1's 4 steps
    lines = [r.getMessage() for r in caplog.records if " done, " in r.getMessage()]
    assert len(lines) == 2, lines
    assert float(re.search(r"done, ([\d.]+) s", lines[0]).group(1)) < 60, lines[0]
    assert " with validation" not in lines[0] and " with validation" in lines[1], lines


@pytest.mark.parametrize("gloo,said", [
    ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:58011. This is "
     "typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error.",
     "(Connection closed by peer [127.0.0.1]:58011)"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.77.77.2]:40521: Connection reset by peer",
     "(Read error [10.77.77.2]:40521: Connection reset by peer)"),
])
def test_gloos_lost_peer_under_a_launcher_is_said_with_its_address_and_without_its_source_location(gloo, said):
    """Under mpirun, srun or torchrun a rank that loses another ends with one line (tests/test_multinode.py
    kills one): gloo's first sentence, the peer's address in it; any other error is left as it is."""
    from ddlx.errors import RankLost, rank_lost

    lost = rank_lost(RuntimeError(gloo), 3)
    assert isinstance(lost, RankLost) and str(lost).startswith(f"rank 3 lost another rank of the job {said}: "), lost
    assert "strategy.timeout_s" in str(lost) and ".cc:" not in str(lost)
    assert rank_lost(RuntimeError("CUDA out of memory"), 0) is None and rank_lost(ValueError(gloo), 0) is None
    timed_out = rank_lost(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv "
                                       "operation to complete"), 3)
    assert isinstance(timed_out, RankLost) and str(timed_out).startswith(
        "rank 3 waited strategy.timeout_s and no other rank answered (Timed out waiting 20000ms for recv operation to "
        "complete): "), timed_out
    quoting = "DataLoader worker (pid 7) raised an error.\nTraceback ...\nConnectionResetError: [Errno 104] Connection reset by peer"
    assert rank_lost(RuntimeError(quoting), 0) is None, "an error that quotes another's traceback is not gloo's"


def _frames(*chain: tuple[str, str, str]):
    """A traceback through functions of the given modules (module, function, file), the last raising
    gloo's timeout: each compiled under its module's name and file, as an installed package's are."""
    names: dict = {}
    for index, (module, function, file) in enumerate(chain):
        body = f"{function}_next()" if index + 1 < len(chain) else \
            "raise RuntimeError('[unbound_buffer.cc:81] Timed out waiting 9ms for recv operation to complete')"
        scope = {"__name__": module}
        exec(compile(f"def {function}():\n    {body}\n", file, "exec"), scope)
        names[index] = scope
    for index, scope in names.items():
        if index + 1 < len(chain):
            scope[f"{chain[index][1]}_next"] = names[index + 1][chain[index + 1][1]]
    try:
        names[0][chain[0][1]]()
    except RuntimeError as err:
        return err


def test_where_a_rank_waited_is_read_by_module_not_by_path():
    """An environment named torch (conda create -n torch) puts /torch/ in every package's path:
    frames are torch's by their module; private and decorator frames are skipped."""
    from ddlx.errors import waiting_in

    env = "/opt/conda/envs/torch/lib/python3.11/site-packages"
    gathered = _frames(("ddlx.data.cache", "gathered", f"{env}/ddlx/data/cache.py"),
                       ("torch.distributed.c10d_logger", "wrapper", f"{env}/torch/distributed/c10d_logger.py"),
                       ("torch.distributed.distributed_c10d", "all_gather_object", f"{env}/torch/distributed/distributed_c10d.py"),
                       ("torch.distributed.distributed_c10d", "all_gather", f"{env}/torch/distributed/distributed_c10d.py"))
    assert waiting_in(gathered.__traceback__).startswith(" in all_gather_object (from ddlx.data.cache:"), gathered
    backward = _frames(("pytorch_lightning.core.module", "manual", f"{env}/pytorch_lightning/core/module.py"),
                       ("torch._tensor", "backward", f"{env}/torch/_tensor.py"),
                       ("torch.autograd.graph", "_engine_run_backward", f"{env}/torch/autograd/graph.py"))
    assert waiting_in(backward.__traceback__).startswith(" in backward (from pytorch_lightning.core.module:"), backward
    through_stdlib = _frames(("ddlx.run", "fit", "/work/ddlx/run.py"), ("contextlib", "enter", "/usr/lib/python3.11/contextlib.py"),
                             ("torch.nn.modules.module", "_call_impl", "/x/torch/nn/modules/module.py"))
    assert waiting_in(through_stdlib.__traceback__).startswith(" (from ddlx.run:"), "no public torch call: the caller alone"


def _waits_alone(rank: int, port: int, folder: str) -> None:
    """Rank 0 gathers (ddlx's data cache asks every rank's host); rank 1 never does, as in a deadlock."""
    import datetime
    import time

    import torch.distributed as dist

    from ddlx.data.cache import machine_group
    from ddlx.errors import rank_lost

    Path(folder, f"ready{rank}").touch()  # both imported: the short timeout below must not meet the rendezvous
    while not all(Path(folder, f"ready{r}").exists() for r in (0, 1)):
        time.sleep(0.05)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(6)
        os._exit(0)
    try:
        machine_group()
    except RuntimeError as err:
        Path(folder, "said").write_text(str(rank_lost(err, 0)))
    os._exit(0)  # as ddlx's own ranks end (rank_worker): no interpreter exit racing gloo's threads


@pytest.mark.integration
def test_gloos_timeout_under_a_launcher_says_where_this_rank_waited(tmp_path):
    """A rank that waits out strategy.timeout_s lost no connection: the other rank may be alive
    and waiting elsewhere (a deadlock). The one line names the collective and the code that called it,
    the part of gloo's traceback that tells a hang from a lost node."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_waits_alone, args=(port, str(tmp_path)), nprocs=2)
    said = (tmp_path / "said").read_text()
    assert said.startswith("rank 0 waited strategy.timeout_s in all_gather_object (from ddlx.data.cache:"), said
    assert "(Timed out waiting 2000ms for " in said and "a deadlock" in said and ".cc:" not in said, said


def test_a_resume_with_other_ranks_or_nodes_than_its_launcher_started_is_refused(tmp_path):
    """mpirun's ranks and the nodes srun or torchrun spread them over are in no config key: the
    checkpoint keeps them (its 'layout'), and a resume started otherwise (its printed command run
    without mpirun went on as one rank, re-tagging the run ranks=1) is refused with the fix
    (tests/test_multinode.py runs that). A checkpoint without a layout (written before it was
    kept) is not refused for it."""
    from ddlx.checkpoints import RunInCheckpoint, SavedRun

    identity = RunInCheckpoint({"seed": 42}, {"ranks": "2", "nodes": "2"})
    checkpoint: dict = {}
    identity.on_save_checkpoint(None, None, checkpoint)
    assert checkpoint["ddlx"]["layout"] == {"ranks": "2", "nodes": "2"}

    saved = SavedRun(tmp_path / "last.ckpt", None, None, None, {}, 1, 6, 1, {"ranks": "2", "nodes": "2"})
    assert saved.layout_changed({"strategy": "mpi", "ranks": "2", "nodes": "2", "backend": "gloo"}) is None
    said = saved.layout_changed({"strategy": "mpi", "ranks": "1", "nodes": "1"})
    assert said.startswith(f"ckpt_path={tmp_path / 'last.ckpt'} was written by a run of ranks=2, nodes=2 (now ranks=1, nodes=1)")
    assert "mpirun -np" in said and "or start a new run without ckpt_path" in said
    assert saved.layout_changed({"strategy": "mpi", "ranks": "2", "nodes": "1"}).count("nodes=") == 2, "only what changed"
    before = SavedRun(tmp_path / "last.ckpt", None, None, None, {}, 1, 6, 1)
    assert before.layout_changed({"ranks": "1", "nodes": "1"}) is None


def test_a_launchers_job_names_the_runs_folder_the_same_on_every_rank_and_shortly(monkeypatch):
    """Every rank of a job started by srun, mpirun or torchrun composes its own config: the folder
    is named by the launcher's job id, as squeue says it, or, for torchrun's 57 characters (its
    UUID, host and port), by a hash of them."""
    from ddlx.entry import LAUNCHERS, job_id

    for _, size, names in LAUNCHERS:
        for name in (size, *names):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert job_id.__wrapped__() == "12345-0"
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-n1-4242@1")  # OpenMPI 5's
    assert job_id.__wrapped__() == "prterun-n1-4242_1"
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "b1158aae-bff5-4b60-aa11-6dd51367256b")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "42411")
    first = job_id.__wrapped__()
    assert re.fullmatch(r"torchrun-[0-9a-f]{8}", first) and job_id.__wrapped__() == first
    monkeypatch.setenv("MASTER_PORT", "42412")
    assert job_id.__wrapped__() != first, "another job"


def test_the_resume_line_says_the_launcher_that_started_the_job(monkeypatch, tmp_path, capsys):
    """Under mpirun, srun or torchrun the printed train.py command alone would start one process."""
    from ddlx.command_line import HowToResume
    from ddlx.process import outside_launcher

    checkpoint = tmp_path / "last.ckpt"
    checkpoint.write_bytes(b"")
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert outside_launcher() is None
    monkeypatch.setenv("WORLD_SIZE", "2")  # as Lightning sets it for ranks it starts itself
    assert outside_launcher() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert outside_launcher() == ("torchrun", 2)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    how = HowToResume.from_json(HowToResume.of(["strategy=mpi"], checkpoint, False).to_json())  # as the run's watch takes it
    assert how.command == f"python train.py strategy=mpi ckpt_path={checkpoint}"
    assert how.launcher == ("mpirun", 4, None)
    how.say()
    assert capsys.readouterr().err == (f"ddlx: resume under mpirun with 4 processes, as this job was started, with: "
                                       f"python train.py strategy=mpi ckpt_path={checkpoint}\n")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "3")  # mpirun in an allocation: its daemons' srun step, inherited
    HowToResume.of(["strategy=mpi"], checkpoint, False, nodes="2").say()
    assert capsys.readouterr().err.startswith("ddlx: resume under mpirun with 4 processes on 2 nodes, as this job was started")
