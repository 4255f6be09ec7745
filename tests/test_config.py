"""The config schema: wrong types, unknown keys and out-of-range values are named, with the fix,
when the command line is read: before torch, Lightning or MLflow load, and before any run."""
from __future__ import annotations

import inspect
import re
import subprocess
import sys
import time

import pytest
from conftest import CONF_DIR, PROJECT_DIR, as_a_shell_reads, compose_config, subprocess_env

from ddlx.config import STRATEGY_CONFIGS, TRAINER_ARGS_SET_BY_DDLX, TrainConfig, TrainerConfig
from ddlx.config_check import check_config, typed_config
from ddlx.errors import ConfigError


def train_py(*overrides: str, multirun: bool = False, script: str = "train.py") -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, str(PROJECT_DIR / script), *(["-m"] if multirun else []), *overrides]
    start = time.monotonic()
    env = {**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}  # no GPU, on any machine: trainer=gpu is refused
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    return proc, time.monotonic() - start


@pytest.mark.integration
@pytest.mark.parametrize("override,key,expected", [
    ("seed=abc", r"seed=abc", r"an integer, e.g. seed=42"),
    ("seed=-1", r"seed=-1", r"a value in \[0, 4294967295\], e.g. seed=42"),
    ("data.image_size=abc", r"data.image_size=abc", r"an integer"),
    ("data.batch_size=0", r"data.batch_size=0", r">= 1"),
    ("optim.lr=-1", r"optim.lr=-1.0", r"> 0, e.g. optim.lr=0.005"),
    ("data.val_fraction=1", r"data.val_fraction=1.0", r"in \[0, 1\)"),
    ("data.num_workers=-1", r"data.num_workers=-1", r">= 0"),
    ("data.batchsize=8", r"data.batchsize is not a key of data", r"did you mean data.batch_size\?"),
    ("+data.batchsize=8", r"data.batchsize is not a key of data", r"did you mean data.batch_size\?"),
    ("trainer.max_epoch=3", r"trainer.max_epoch is not a key of trainer", r"did you mean trainer.max_epochs\?"),
    ("data.lr=0.1", r"data.lr is not a key of data", r"did you mean optim.lr\?"),
    ("+trainer.ckpt_path=x.ckpt", r"trainer.ckpt_path is set by ddlx", r"ckpt_path=PATH"),
    ("hw=titanrtx_4x", r"hw is recommend.py's, not train.py's", r"python recommend.py hw=NAME"),  # its --help lists hw
    ("trainer.devices=4", r"trainer.devices is set by ddlx", r"strategy.processes"),
    ("strategy.processes=2", r"strategy.processes is not a knob of strategy=sequential", r"knob of strategy=cpu_mp"),
    ("model=vgg17", r"model=vgg17 is not an option of model", r"did you mean model=vgg11 or model=vgg16\?"),
    ("logger.tags.hw=x", r"logger.tags.hw is not in logger.tags yet", r"add it with \+logger.tags.hw=VALUE"),
    ("+logger.tags.x=[1,2]", r"logger.tags.x=\[1,2\]", r"expected a string$"),
    ("data.std=[a,b,c]", r"data.std\[0\]=a", r"expected a number$"),
    ("trainer.accelerator=tpu", r"trainer.accelerator=tpu", r"expected one of auto, cpu, gpu, cuda"),
    ("trainer.val_check_interval=0", r"trainer.val_check_interval=0", r"> 0"),
    ("trainer.max_steps=0", r"trainer.max_steps=0 trains no batch", r"leave trainer.max_steps out"),
    ("trainer.limit_train_batches=0", r"trainer.limit_train_batches=0 trains no batch", r"leave trainer.limit_train_batches out"),
    ("paths.root=", r"paths.root='' is empty", r"leave paths.root out"),
    ("data.synthetic_size=[10]", r"data.synthetic_size=\[10\]", r"1 <= min <= max, e.g. data.synthetic_size=\[320,800\]"),
    ("data.std=[0,0,0]", r"data.std=\[0.0, 0.0, 0.0\]", r"values > 0"),
    # Known before torch loads: across keys, the paths named, the machine.
    ("trainer.max_epochs=0", r"trainer.max_epochs=0 trains no epoch", r"trainer.max_epochs=4 measure.warmup_epochs=1"),
    ("model.memory_format=channels_last strategy=fsdp", r"model.memory_format=channels_last with strategy=fsdp",
     r"model.memory_format=contiguous"),
    ("model.memory_format=channels_last strategy=pipe strategy.engine=torch",
     r"model.memory_format=channels_last with strategy=pipe", r"strategy.engine=fairscale"),
    ("strategy=hybrid strategy.local=split strategy.balance=[3,19]",
     r"strategy.balance=\[3, 19\] is a knob of strategy.local=pipe, which strategy=hybrid with local=split does not use",
     r"leave it out, or use strategy.local=pipe"),
    ("strategy=mpi strategy.threads=4", r"strategy.threads=4 is a knob of strategy.local=threads", r"strategy.local=threads"),
    ("trainer.min_epochs=4 trainer.max_epochs=2", r"trainer.min_epochs=4 with trainer.max_epochs=2", r"trainer.max_epochs=4"),
    ("trainer=gpu", r"trainer.accelerator=gpu, but this machine has no GPU", r"trainer=default"),
    ("strategy=ddp_nccl", r"strategy=ddp_nccl needs CUDA GPUs", r"strategy=ddp_gloo"),
    ("strategy=ddp_gloo strategy.processes=99", r"data.batch_size=32 is the global batch", r"a multiple of 99"),
    (f"ckpt_path={PROJECT_DIR / 'conf'}", r"ckpt_path=\S+/conf is a folder, not a checkpoint file", r"last.ckpt"),
    ("ckpt_path=/nowhere/last.ckpt", r"ckpt_path=/nowhere/last.ckpt does not exist", r"last.ckpt"),
    ("data=imagefolder data.root=/nowhere", r"data.root=/nowhere does not exist", r"data.root=null"),
    ("ckpt_path=", r"ckpt_path='' is empty", r"leave ckpt_path out"),
    ("data=imagefolder data.root=", r"data.root='' does not exist", r"data.root=null"),
    ("hydra.run.dir=/proc/ddlx-run", r"hydra.run.dir=/proc/ddlx-run: cannot create a folder in /proc",
     r"choose another hydra.run.dir"),
])
def test_a_bad_value_is_named_with_the_fix_before_anything_loads(override, key, expected):
    proc, seconds = train_py(*override.split())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert re.search(rf"ddlx: error: .*{key}", proc.stderr) and re.search(expected, proc.stderr), proc.stderr
    assert seconds < 20, "reported before torch, Lightning and MLflow load (about a second on a quiet machine)"


@pytest.mark.integration
def test_what_the_config_and_the_machine_tell_is_checked_before_torch_loads():
    """The checks that need no model, data or device answer without importing torch (train.py
    then exits; ddlx.run.train checks the same for its callers)."""
    code = ("import functools, sys\nfrom pathlib import Path\nfrom ddlx.entry import register_recommend_config\n"
            "from ddlx.config_check import check_command_line, check_recommend_job\n"
            "register_recommend_config(Path(sys.argv[1]))\nentry = sys.argv[2]\n"
            "check = functools.partial(check_recommend_job, hw_dir=Path(sys.argv[1]) / 'conf' / 'hw') if entry == 'recommend' else None\n"
            "try:\n    check_command_line(sys.argv[3:], Path(sys.argv[1]) / 'conf', entry, check)\n"
            "except SystemExit as stop:\n    print('exit', stop.code, 'torch' in sys.modules, 'mlflow' in sys.modules)\n")
    for entry, overrides in (("train", ["trainer.max_epochs=0"]), ("train", ["trainer=gpu"]),
                             ("train", ["strategy=ddp_gloo", "strategy.processes=99"]),
                             ("train", ["logger.tracking_uri=sqllite:///mlflow.db"]),
                             ("train", ["logger.tracking_uri=sqlite:////nowhere/mlflow.db"]),
                             ("train", ["data=imagefolder"]),  # (its folder's keys: once after the seed was set and logged)
                             ("recommend", ["strategies=[ddp]"]), ("recommend", ["candidates.pipe.chunks=[0]"]),
                             ("recommend", ["seed=abc"])):
        proc = subprocess.run([sys.executable, "-c", code, str(PROJECT_DIR), entry, *overrides], capture_output=True, text=True,
                              timeout=60, env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""})
        assert proc.stdout.split() == ["exit", "2", "False", "False"], (overrides, proc.stdout, proc.stderr[-2000:])


@pytest.mark.integration
def test_recommend_names_an_unknown_machine_or_model_with_the_options(tmp_path):
    for override, expected in (("hw=nosuch", r"hw=nosuch is not an option of hw.*expected one of .*titanrtx_4x"),
                               ("model=nosuch", r"model=nosuch is not an option of model.*expected one of .*vgg16"),
                               ("hw=schema", r"hw=schema is the fields every machine description has, not a machine"),
                               ("data.synthetic_dir=", r"data.synthetic_dir='' is empty"),  # else written at /synthetic
                               ("data.std=[0,1,1]", r"data.std=\[0.0, 1.0, 1.0\]: every pixel is divided by it"),
                               ("strategy=ddp_nccl", r"strategy is train.py's, not recommend.py's: .*candidates.STRATEGY.KNOB")):
        proc, _ = train_py(override, f"paths.root={tmp_path}", script="recommend.py")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert re.search(rf"ddlx: error: {expected}", proc.stderr), proc.stderr
        assert "schema" not in proc.stderr.split("expected one of")[-1], "the schema is no option"


@pytest.mark.integration
def test_every_job_of_a_sweep_is_checked_before_the_first_runs(tmp_path):
    proc, _ = train_py(f"paths.root={tmp_path}", "strategy=sequential,cpu_mp", "strategy.threads=2", multirun=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(r"sweep job strategy=cpu_mp: strategy.threads is not a knob of strategy=cpu_mp",
                     proc.stderr)
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "mlflow.db").exists(), "no job ran"


@pytest.mark.parametrize("argv,said", [
    (["--cfg", "hydra", "--resolve"], r"--cfg hydra --resolve .*paths.root.*: --cfg all --resolve --package hydra$"),
    (["--cfg", "hydra", "--resolve", "--package", "hydra.run"], r"--cfg all --resolve --package hydra.run$"),
    (["-m", "--cfg", "job", "seed=1,2"], r"--multirun and --cfg given together; .*drop all but one"),
    (["--info", "--multirun"], r"--multirun and --info given together"),
    (["--experimental-rerun", "/nonexistent/config.pickle"], r"/nonexistent/config.pickle: no such file; .*PickleJobInfoCallback"),
], ids=["cfg hydra resolved", "a package of it", "a sweep's cfg", "info and multirun", "a rerun of no file"])
def test_hydras_flags_that_would_end_in_a_traceback_are_refused_with_the_fix(argv, said, capsys):
    """Hydra answers these with a traceback: omegaconf's (--cfg hydra drops paths.root, which
    Hydra's folders name, then resolves them) or its own ValueError (two commands at once, a
    rerun of a file not there)."""
    from ddlx.config_check import check_command_line

    with pytest.raises(SystemExit) as stop:
        check_command_line(argv, CONF_DIR, "train")
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.match(rf"ddlx: error: .*{said}", line), line


@pytest.mark.parametrize("entry", ["train", "recommend"])
def test_a_basic_sweepers_params_on_the_command_line_are_refused_with_the_fix(entry, capsys):
    """Hydra's basic sweeper starts with no params, and Hydra fails on any given there with a
    traceback (omegaconf's AttributeError or AssertionError) unless a config file gave some
    (test_a_config_folder_of_ones_own_is_checked_with_it)."""
    from ddlx.config_check import check_command_line

    for given in ('hydra.sweeper.params={seed:"1,2"}', '+hydra.sweeper.params.seed="1,2"'):
        with pytest.raises(SystemExit):
            check_command_line(["-m", given], CONF_DIR, entry)
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"ddlx: error: {given}: Hydra's basic sweeper takes params on the command line only "
                               f"where a config file has given it some") and \
            f"python {entry}.py -m seed=1,2" in line and "experiment option" in line, line


def test_a_config_folder_of_ones_own_is_checked_with_it(tmp_path, capsys):
    """--config-dir adds a folder where Hydra looks (a user's own experiment options): the
    command line's check left such a command line to Hydra unchecked; it checks it with that folder."""
    from ddlx.config_check import check_command_line

    own = tmp_path / "Dropbox (Personal), ours"  # a name Hydra's override grammar would not read bare
    (own / "experiment").mkdir(parents=True)
    (own / "experiment" / "mine.yaml").write_text("# @package _global_\ndata:\n  batch_size: 0\n")
    (own / "experiment" / "fine.yaml").write_text("# @package _global_\nhydra:\n  sweeper:\n    params:\n      seed: 1,2\n")
    (own / "experiment" / "chooses.yaml").write_text("# @package _global_\ndefaults:\n  - /model: vgg16\n")  # no 'override'
    assert check_command_line(["--config-dir", str(own), "-m", "experiment=fine"], CONF_DIR, "train") is None
    assert check_command_line(["--config-dir", str(own), "-m", "experiment=fine", 'hydra.sweeper.params.seed="3,4"'],
                              CONF_DIR, "train") is None, "params given on the command line where a file gave some"
    for argv, said in ((["experiment=mine"], "data.batch_size=0: expected a value >= 1"),
                       (["experiment=nope"], "experiment=nope is not an option of experiment; expected one of chooses, complexsmall, fine, mine, simplebig"),
                       (["experiment=chooses"], "Multiple values for model. To override a value use 'override model: vgg16'")):
        with pytest.raises(SystemExit):
            check_command_line(["--config-dir", str(own), *argv], CONF_DIR, "train")
        assert capsys.readouterr().err == f"ddlx: error: {said}\n", "(the last: Hydra's fix, for a defaults list it is)"


def test_a_sweeps_store_is_checked_once_and_where_its_jobs_run(monkeypatch, capsys):
    """A server that does not answer waits its timeout once for the whole sweep, not per job; under
    a launcher plugin (submitit) the jobs run on other hosts, which reach the store for themselves."""
    from ddlx import tracking
    from ddlx.config_check import check_command_line

    asked = []

    def unreachable(uri, **how):
        asked.append(uri)
        raise tracking.StoreError(f"MLflow tracking server logger.tracking_uri={uri} is unreachable")

    monkeypatch.setattr(tracking, "check_tracking_uri", unreachable)
    with pytest.raises(SystemExit):
        check_command_line(["-m", "seed=1,2,3", "logger.tracking_uri=http://10.255.255.1:5000"], CONF_DIR, "train")
    assert asked == ["http://10.255.255.1:5000"]
    assert capsys.readouterr().err.startswith("ddlx: error: all 3 jobs of the sweep: MLflow tracking server")
    assert check_command_line(["-m", "seed=1,2", "hydra/launcher=submitit_local",
                               "logger.tracking_uri=http://10.255.255.1:5000"], CONF_DIR, "train") is None
    assert asked == ["http://10.255.255.1:5000"], "not asked from the submitting host"


def test_hydras_own_answers_are_left_to_it():
    from ddlx.config_check import check_command_line

    for argv in (["--cfg", "job", "--resolve"], ["--cfg", "all", "--resolve", "--package", "hydra"], ["--help", "-m"],
                 ["--cfg", "hydra"]):
        assert check_command_line(argv, CONF_DIR, "train") is None, argv


@pytest.mark.parametrize("entry,argv", [
    ("train", ["paths.root=${hydra:runtime.cwd}/runs"]),
    ("train", ["logger.tracking_uri=sqlite:///${hydra:runtime.output_dir}/mlflow.db"]),
    ("train", ["-m", "seed=1,2", "logger.run_name=${hydra:job.name}-${hydra:job.num}"]),
    ("recommend", ["paths.root=${hydra:runtime.cwd}/runs", "logger.run_name=${hydra:job.name}"]),
], ids=["the folder it runs in", "the job's folder", "a sweep job's number", "recommend.py's"])
def test_a_value_taken_from_hydras_config_passes_the_check_as_the_job_resolves_it(entry, argv):
    """${hydra:...} resolves once Hydra runs the job; the command line's check refused it (HydraConfig
    was not set), and recommend.py's ended in omegaconf's traceback."""
    from hydra.core.hydra_config import HydraConfig

    from ddlx.config_check import check_command_line, check_recommend_job

    check = None if entry == "train" else (lambda cfg, multirun: check_recommend_job(cfg, multirun, CONF_DIR / "hw"))
    assert check_command_line(argv, CONF_DIR, entry, check) is None
    assert not HydraConfig.initialized(), "Hydra sets its config for the job it runs"


def test_a_value_taken_from_hydras_config_is_checked_as_the_job_resolves_it(capsys):
    """Resolved as in each job, not left out: a sweep's first job (number 0) has no batch."""
    from ddlx.config_check import check_command_line

    with pytest.raises(SystemExit):
        check_command_line(["-m", "seed=1,2", "data.batch_size=${hydra:job.num}"], CONF_DIR, "train")
    (line,) = capsys.readouterr().err.splitlines()
    assert re.match(r"ddlx: error: sweep job seed=1: data.batch_size=0: expected .*>= 1", line), line


def _refusal(entry: str, overrides: list[str]):
    """The one error ``entry`` (train or recommend) gives a single run of ``overrides``, as its
    command line check makes it."""
    from ddlx.config_check import _job_errors, check_recommend_job, check_train_job

    check = check_train_job if entry == "train" else (lambda cfg, multirun: check_recommend_job(cfg, multirun, CONF_DIR / "hw"))
    ((_, _, err),) = _job_errors(overrides, False, CONF_DIR, entry, check)
    return err


@pytest.mark.parametrize("entry,override,said", [
    ("train", "hw=titanrtx_4x", "hw is recommend.py's, not train.py's"),
    ("train", "+hw=titanrtx_4x", "hw is recommend.py's"),  # Hydra's advice after the first: 'Could not load hw/schema'
    ("train", "hw.nodes=2", "hw.nodes is recommend.py's"),
    ("train", "compare=[h100_1x]", "compare is recommend.py's"),
    ("recommend", "strategy=ddp_nccl", "strategy is train.py's, not recommend.py's"),
    ("recommend", "+strategy=ddp_nccl", "strategy is train.py's"),  # was: 'strategy is not a key; did you mean strategy?'
    ("recommend", "strategy.processes=2", "strategy.processes is train.py's"),
    ("recommend", "trainer=gpu", "trainer is train.py's"),
    ("recommend", "trainer.accelerator=gpu", "trainer.accelerator is train.py's"),
    ("recommend", "experiment=simplebig", "experiment is train.py's"),
    ("recommend", "ckpt_path=x.ckpt", "ckpt_path is train.py's"),
])
def test_a_group_or_key_of_the_other_entry_point_is_named_as_its(entry, override, said):
    """train.py and recommend.py share conf/, so each one's --help lists the other's groups."""
    err = _refusal(entry, [override])
    assert str(err).startswith(said), err


@pytest.mark.parametrize("entry,override,said", [
    ("train", "+model=vgg16", "model is a group the config chooses already, so it takes no '+': choose it as model=vgg16"),
    ("recommend", "+model=vgg16", "model is a group the config chooses already"),
    ("train", "+experiment=simplebig", "experiment is a group the config chooses already, so it takes no '+': choose it as experiment=simplebig"),
])
def test_a_group_the_config_chooses_takes_no_plus(entry, override, said):
    """Hydra's fix for these, 'override model: vgg16', is a defaults list's, not the command line's."""
    assert str(_refusal(entry, [override])).startswith(said)


@pytest.mark.integration
@pytest.mark.parametrize("script", ["train.py", "recommend.py"])
def test_help_lists_the_groups_a_user_chooses_from_and_not_their_schemas(script):
    proc, _ = train_py("--help", script=script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    listed = {line.split(":")[0] for line in groups.splitlines() if ": " in line}
    assert {"data", "model", "strategy", "trainer", "optim", "logger", "hw"} <= listed, listed
    assert not [group for group in listed if "schema" in group], groups


@pytest.mark.parametrize("entry", ["train", "recommend"])
def test_a_store_that_cannot_record_is_refused_before_a_job_starts(entry, tmp_path):
    """A scheme MLflow has no store for, a server or a database file without its scheme, a folder
    that is not there, a server that does not answer: said in the command line's check, not after
    Hydra made the job's folder and torch loaded (5-7 s in). A store in the folder the job makes
    (or one of its parents) is not missing its folder."""
    for uri, said in (("sqllite:///m.db", ": MLflow has no store for the scheme sqllite://; did you mean sqlite://"),
                      ("localhost:5000", " names no scheme"), (str(tmp_path / "m.db"), " names a database file without its scheme"),
                      (f"sqlite:///{tmp_path}/nope/m.db", f": folder {tmp_path}/nope does not exist")):
        err = _refusal(entry, [f"logger.tracking_uri={uri}"])
        assert str(err).startswith(f"logger.tracking_uri={uri}{said}"), err
    for server in ("http://127.0.0.1:9", "http://localhost:50o0"):  # (the second: http.client's InvalidURL)
        assert re.match(rf"MLflow tracking server logger.tracking_uri={server} is unreachable",
                        str(_refusal(entry, [f"logger.tracking_uri={server}"])))
    inside = "logger.tracking_uri=sqlite:///${hydra:runtime.output_dir}/sub/m.db"  # Hydra makes the job's folder, not sub/
    assert re.search(r"folder \S+/sub does not exist", str(_refusal(entry, [f"paths.root={tmp_path}", inside])))
    from ddlx.config_check import _job_errors, check_recommend_job, check_train_job

    check = check_train_job if entry == "train" else (lambda cfg, multirun: check_recommend_job(cfg, multirun, CONF_DIR / "hw"))
    later = f"logger.tracking_uri=sqlite:///{tmp_path}/new/mlflow.db"
    assert list(_job_errors([f"paths.root={tmp_path}/new", later], False, CONF_DIR, entry, check)) == []
    if entry == "recommend":  # an answer not recorded: its store only read, if there
        assert list(_job_errors([f"logger.tracking_uri=sqlite:///{tmp_path}/nope/m.db", "log=false"], False, CONF_DIR,
                                entry, check)) == []


@pytest.mark.parametrize("overrides,said", [
    (["data=imagefolder"], "data.root is not set, but data.name is to be read from the folder there"),
    (["data=imagefolder", "data.root=/nowhere"], "data.root=/nowhere does not exist"),
])
def test_recommend_names_a_data_folder_that_is_not_there_before_its_job_starts(overrides, said):
    """As train.py does: recommend.py refused these only after Hydra had started its job and
    torch had loaded (2.4-10 s in). Its modes that read no data (validate, probe) take them."""
    assert str(_refusal("recommend", overrides)).startswith(said)
    from ddlx.config_check import _job_errors, check_recommend_job

    def check(cfg, multirun):
        return check_recommend_job(cfg, multirun, CONF_DIR / "hw")

    assert not list(_job_errors([*overrides, "mode=validate"], False, CONF_DIR, "recommend", check))


@pytest.mark.parametrize("entry,override,said", [
    ("recommend", "seed=abc", r"seed=abc: expected an integer, e.g. seed=42$"),  # was named data.seed, which copies it
    ("recommend", "seed=-1", r"seed=-1: expected a value in \[0, 4294967295\], e.g. seed=42$"),  # once, not for data.seed too
    ("train", "seed=-1", r"seed=-1: expected a value in \[0, 4294967295\], e.g. seed=42$"),
    ("recommend", "data.batch_size=0", r"data.batch_size=0: expected a value >= 1$"),
    ("recommend", "logger.run_name=${nokey}", r"logger.run_name cannot be resolved: Interpolation key 'nokey' not found$"),
    ("recommend", "data.batch_size=${oops:1}", r"data.batch_size cannot be resolved: Unsupported interpolation type oops$"),
    ("recommend", "compare=h100_1x", r"compare=h100_1x; expected a list of hw names, e.g. compare=\["),  # its own words first
    ("recommend", "max_epoch_s=abc", r"max_epoch_s=abc; expected seconds > 0 .*, e.g. max_epoch_s=600$"),
    ("recommend", "max_epoch_s=${nokey}", r"max_epoch_s cannot be resolved: Interpolation key 'nokey' not found$"),
    ("recommend", "strategies=[ddp]", r"strategies=\[ddp\]: ddp is not a strategy; did you mean ddp_gloo or ddp_nccl\?"),
    ("recommend", "candidates.pipe.chunks=[0]", r"candidates.pipe.chunks=\[0\]; expected a list of values, each a value >= 1"),
])
def test_recommend_types_its_config_before_its_job_starts(entry, override, said):
    """recommend.py typed its config only once Hydra had made the job's folder (a value that did
    not resolve: a traceback, as Hydra read the override back); the key named is the one given."""
    assert re.match(said, str(_refusal(entry, [override]))), _refusal(entry, [override])


@pytest.mark.parametrize("override,meant", [
    ("strategy=ddp", "strategy=ddp_gloo or strategy=ddp_nccl"),
    ("model=resnet", "model=resnet152 or model=resnet18 or model=resnet50"),
    ("strategy=nccl", "strategy=ddp_nccl"),
    ("hw=a100_8x", "hw=a100_sxm4_40gb_8x or hw=a100_sxm4_80gb_8x"),  # its closest spelling is v100_8x
    ("model=alexnett", "model=alexnet"),  # a close spelling: that one alone
    ("model=vgg17", "model=vgg11 or model=vgg16"),  # as close as each other by spelling
    ("model=resnet34", "model=resnet18 or model=resnet50"),  # two as close: both, not the one sorting last
    ("trainer.mode=x", "compile.mode"),  # a key's own name elsewhere before a family of trainer's (inference_mode, ...)
    ("trainer.val=1", None),  # too many of trainer's keys start with it to name them all
])
def test_an_option_or_key_named_by_its_family_lists_the_members(override, meant):
    err = _refusal("recommend" if override.startswith("hw=") else "train", [override])
    assert (f"did you mean {meant}?" in str(err)) if meant else "did you mean" not in str(err), err


def test_every_wrong_group_option_of_a_command_is_named_at_once():
    """Hydra stops composing at the first missing option: a user with two would meet the second
    only at the next try."""
    err = _refusal("recommend", ["hw=a100_8x", "model=resnet", "data=firesmall"])
    assert str(err).startswith("hw=a100_8x is not an option of hw") and "; model=resnet is not an option of model" in str(err), err
    assert "data=" not in str(err)


def test_what_each_entry_point_takes_is_not_refused_as_the_others():
    from ddlx.config_check import other_entry_problem

    for key in ("trainer.precision", "trainer.max_epochs", "model", "data.batch_size", "optim.lr", "logger.experiment_name",
                "paths.root", "cpu_allocator", "seed", "hydra.run.dir"):
        assert other_entry_problem(key, "recommend") is None and other_entry_problem(key, "train") is None, key
    for key in ("strategy", "strategy.processes", "trainer.accelerator", "ckpt_path", "checkpoint.save", "compile.enable"):
        assert other_entry_problem(key, "train") is None, key
    for key in ("hw", "mode", "compare", "candidates.pipe.chunks", "max_epoch_s"):
        assert other_entry_problem(key, "recommend") is None, key


def test_the_schema_types_and_bounds_every_strategys_knobs():
    with pytest.raises(ConfigError, match=r"strategy.processes=0: expected a value >= 1"):
        check_config(compose_config(["strategy=cpu_mp", "strategy.processes=0"]))
    with pytest.raises(ConfigError, match=r"strategy.comm_hook=zip: expected one of none, fp16, bf16, powersgd"):
        check_config(compose_config(["strategy=ddp_gloo", "strategy.comm_hook=zip"]))
    with pytest.raises(ConfigError, match=r"strategy.checkpoint=sometimes: expected one of never, except_last, always"):
        check_config(compose_config(["strategy=pipe", "strategy.checkpoint=sometimes"]))
    with pytest.raises(ConfigError, match=r"strategy.timeout_s=0.0: expected a value > 0"):
        check_config(compose_config(["strategy=hybrid", "strategy.timeout_s=0"]))
    for name in STRATEGY_CONFIGS:
        check_config(compose_config([f"strategy={name}"]))  # every default is within its bounds


@pytest.mark.parametrize("override", ["optim.lr=nan", "optim.lr=inf", "data.val_fraction=nan",
                                      "measure.monitor_interval_s=-inf", "strategy=hybrid strategy.timeout_s=inf"])
def test_a_number_that_is_not_finite_is_refused_by_its_key(override):
    """NaN passes every range (each comparison with it is false): an lr of nan trained a FINISHED run of nan losses."""
    key, value = override.split()[-1].split("=")
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}={value}: expected a finite number"):
        check_config(compose_config(override.split()))


@pytest.mark.parametrize("value,refused", [("10", True), ("1.5", True), ("00:00:10:00", False), ("{minutes:10}", False)])
def test_max_time_is_taken_in_lightnings_forms_and_a_bare_number_refused(value, refused):
    """A bare number has no unit (Lightning failed on it with an AttributeError once the run had opened)."""
    from ddlx.preflight import check_before_torch

    cfg = typed_config(compose_config([f"trainer.max_time={value}"]))
    if refused:
        with pytest.raises(ConfigError, match=rf"trainer.max_time={value}: expected days:hours:minutes:seconds"):
            check_before_torch(cfg)
    else:
        check_before_torch(cfg)


@pytest.mark.parametrize("warmup,epochs", [(0, 0), (2, 0), (1, 1), (5, 3)])
def test_a_warm_up_that_leaves_no_epoch_is_answered_with_a_warm_up_and_three_timed_epochs(warmup, epochs):
    """The fix offered is accepted and is the thesis' measure (with no warm-up it offered 4 epochs, all timed).
    No epoch at all is named as the command set it, not as the default warm-up's doing."""
    from ddlx.preflight import consistency_problems

    cfg = typed_config(compose_config([f"measure.warmup_epochs={warmup}", f"trainer.max_epochs={epochs}"]))
    (problem,) = consistency_problems(cfg)
    assert problem.startswith("trainer.max_epochs=0 trains no epoch") if epochs == 0 else \
        f"measure.warmup_epochs={warmup} with trainer.max_epochs={epochs}" in problem
    offered = re.search(r"e\.g\. (trainer\.max_epochs=\d+) (measure\.warmup_epochs=\d+)", problem).groups()
    fixed = typed_config(compose_config(list(offered)))
    assert consistency_problems(fixed) == []
    assert fixed.measure.warmup_epochs >= 1 and fixed.trainer.max_epochs - fixed.measure.warmup_epochs == 3


@pytest.mark.parametrize("overrides,said", [
    (["data.num_images=10"], r"^the training split has 8 images \(10 images, data.val_fraction=0.2\) but "
                             r"data.batch_size=32: lower data.batch_size to at most 8 or raise data.num_images$"),
    (["data.num_images=10", "strategy=cpu_mp"], r"data.batch_size=32 over 2 processes: lower data.batch_size to at most 16 "),
    (["data.num_images=20", "data.batch_per=worker", "strategy=cpu_mp"],
     r"data.batch_size=32 per worker \(data.batch_per=worker\): lower data.batch_size to at most 16 "),
    (["data.num_images=2"], r"^data.num_images=2: a synthetic dataset needs at least one image per class \(data.num_classes=3\)"),
    (["data.num_images=null"], r"^data.num_images=null .*synthetic set \(no data.root\).*give data.num_images=N$"),
    (["data.num_images=200", "trainer.val_check_interval=50"], r"^trainer.val_check_interval=50 batches, but an epoch trains 5 "),
])
def test_a_synthetic_set_too_small_for_its_job_is_refused_before_it_is_written(overrides, said):
    """Its count is the config's: the datamodule refused it once written and split, and Lightning
    at the first step, 7 s in, after Hydra had made the job's folder. The batch offered fits."""
    from ddlx.preflight import consistency_problems

    (problem,) = consistency_problems(typed_config(compose_config(overrides)))
    assert re.search(said, problem), problem
    if offered := re.search(r"lower data.batch_size to at most (\d+)", problem):
        assert consistency_problems(typed_config(compose_config([*overrides, f"data.batch_size={offered[1]}"]))) == []


def test_a_synthetic_set_over_ranks_a_launcher_starts_is_left_to_them():
    """mpi's ranks share a global batch known only once launched; a batch per process is not."""
    from ddlx.preflight import consistency_problems

    assert consistency_problems(typed_config(compose_config(["strategy=mpi", "data.num_images=10"]))) == []
    (uneven,) = consistency_problems(typed_config(compose_config(["strategy=ddp_gloo", "strategy.processes=99"])))
    assert "must split evenly over the 99 processes" in uneven, "said once, as a batch that does not split"
    (problem,) = consistency_problems(typed_config(compose_config(["strategy=mpi", "data.num_images=10", "data.batch_per=worker"])))
    assert "data.batch_size=32 per worker" in problem


@pytest.mark.parametrize("overrides,said", [
    (["data.mean=[0.5]"], r"^data.mean=\[0.5\] has 1 value\(s\) for data.channels=3; give one per channel, e.g. "
                          r"data.mean=\[0.485,0.456,0.406\]$"),
    (["data.channels=1"], r"^data.mean=\[0.485, 0.456, 0.406\] has 3 value\(s\) for data.channels=1; .*e.g. data.mean=\[0.449\]; "
                          r"data.std=.*e.g. data.std=\[0.226\]$"),
    (["data.classes=[a,b]"], r"^data.classes lists 2 names but data.num_classes=3: .*data.classes=null"),
])
def test_a_data_config_at_odds_with_itself_is_refused_before_anything_loads(overrides, said):
    """Said 7 s in by the datamodule, after torch and Lightning, in words with no value to give
    ('data.mean/std have 3/3 values for 1 channels; give one per channel'). The values offered fit."""
    from ddlx.preflight import consistency_problems

    problems = consistency_problems(typed_config(compose_config(overrides)))
    assert re.search(said, "; ".join(problems)), problems
    offered = re.findall(r"e\.g\. (data\.\w+=\[[^\]]*\])", "; ".join(problems))
    assert consistency_problems(typed_config(compose_config([*overrides, *offered]))) == [] or not offered


def test_an_image_smaller_than_every_model_takes_is_refused_by_its_key():
    with pytest.raises(ConfigError, match=r"data.image_size=8: expected a value >= 16"):
        typed_config(compose_config(["data.image_size=8"]))


@pytest.mark.parametrize("overrides,said", [
    (["strategy=pipe", "strategy.chunks=100"], r"^strategy.chunks=100 is larger than the batch of 32 each pipeline gets "
                                               r"\(data.batch_size=32\): .*use strategy.chunks<=32$"),
    (["strategy=pipe", "strategy.engine=torch", "strategy.chunks=5"], r"^strategy.chunks=5 does not divide data.batch_size=32: "
                                                                     r".*e.g. strategy.chunks=4$"),
    (["strategy=hybrid", "strategy.local=pipe", "strategy.chunks=32"], r"the batch of 16 each pipeline gets \(data.batch_size=32 "
                                                                      r"over 2 pipelines \(16 each\)\).*strategy.chunks<=16$"),
    (["strategy=mpi", "strategy.local=pipe", "strategy.chunks=64", "data.batch_per=worker"],
     r"the batch of 32 each pipeline gets \(data.batch_size=32 per pipeline \(data.batch_per=worker\)\).*strategy.chunks<=32$"),
])
def test_micro_batches_a_pipelines_batch_cannot_fill_are_refused_before_anything_loads(overrides, said):
    """Said 6 s in, after torch, Lightning and the model, where the batch and the chunks tell it.
    The chunks offered are taken."""
    from ddlx.preflight import consistency_problems

    (problem,) = consistency_problems(typed_config(compose_config(overrides)))
    assert re.search(said, problem), problem
    offered = re.search(r"(strategy.chunks)(?:<=|=)(\d+)$", problem)
    assert consistency_problems(typed_config(compose_config([*overrides, f"{offered[1]}={offered[2]}"]))) == []


def test_a_config_edited_after_composing_is_checked_again():
    """train() checks what it is given (a rank's config file, an API caller's edits)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(compose_config([]), resolve=False))
    cfg.data.batchsize = 8
    with pytest.raises(ConfigError, match=r"data.batchsize is not a key of data"):
        check_config(cfg)


def test_every_trainer_argument_can_be_set_and_the_schema_follows_lightning():
    import pytorch_lightning as pl

    lightning = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    schema = {f for f in TrainerConfig.__dataclass_fields__}
    assert schema | (set(TRAINER_ARGS_SET_BY_DDLX) - {"ckpt_path"}) == lightning, "TrainerConfig lists Trainer's arguments"
    cfg = typed_config(compose_config(["trainer.precision=bf16-mixed", "trainer.accumulate_grad_batches=2",
                                       "trainer.gradient_clip_val=0.5"]))
    from ddlx.run import trainer_arguments

    args = trainer_arguments(cfg.trainer)
    assert (args["precision"], args["accumulate_grad_batches"], args["gradient_clip_val"]) == ("bf16-mixed", 2, 0.5)
    assert "inference_mode" not in args, "only values that differ from Lightning's defaults are passed"
    precision = inspect.signature(pl.Trainer.__init__).parameters["precision"].annotation
    from typing import get_args

    accepted = {str(v) for literal in get_args(precision) for v in get_args(literal)}
    from ddlx.config import PRECISIONS

    assert accepted - set(PRECISIONS) == {"transformer-engine", "transformer-engine-float16"}, \
        "the schema's precision choices are Lightning's, but Transformer Engine's"
    assert set(PRECISIONS) <= accepted
    with pytest.raises(ConfigError, match=r"trainer.precision=transformer-engine: expected one of .*bf16-mixed"):
        check_config(compose_config(["trainer.precision=transformer-engine"]))
    with pytest.raises(ConfigError, match=r"trainer.precision=bf17: expected one of .*bf16-mixed"):
        check_config(compose_config(["trainer.precision=bf17"]))


def test_ranks_that_composed_different_jobs_are_named_value_by_value():
    from ddlx.parallel.same_job import disagreements

    rank0 = {"optim.lr": "0.01", "data.num_images": "40", "paths.root": "/a", "ckpt_path": "/a/last.ckpt"}
    same_but_mounted_elsewhere = {**rank0, "paths.root": "/mnt/b"}
    requeue_marker_unseen = {**rank0, "ckpt_path": "None", "optim.lr": "0.02"}
    found = disagreements([rank0, same_but_mounted_elsewhere, requeue_marker_unseen], ["n0", "n1", "n2"])
    assert len(found) == 2 and all(f.startswith("rank 2 (n2): ") for f in found)
    assert any("ckpt_path=None where rank 0 (n0) has ckpt_path=/a/last.ckpt" in f for f in found)
    assert any("optim.lr=0.02" in f for f in found)


def test_an_unknown_key_of_an_untyped_config_is_named_without_an_empty_list():
    from ddlx.config_check import _unknown_key

    assert _unknown_key("foo", None) == "foo is not a key of the config"
    assert "(its keys: seed," in _unknown_key("foo", TrainConfig)


@pytest.mark.parametrize("folder", ["plain", "a,b", "run=2", "[x]", "it's", "null", "with space", "back\\slash,x",
                                    "${oc.env:HOME}", "it\\'s,x"])
def test_a_printed_resume_command_gives_hydra_the_checkpoint_path_meant(tmp_path, folder):
    """A folder with ``,`` would make the pasted command a sweep over the path's pieces; one with
    ``=`` or ``[`` would not parse; ``null`` would be no checkpoint; ``${...}`` would be resolved;
    a backslash is kept as it is."""
    from ddlx.command_line import resume_command

    checkpoint = tmp_path / folder / "last.ckpt"
    words = as_a_shell_reads(resume_command(["model=vgg11", "ckpt_path=old.ckpt"], checkpoint), cwd=tmp_path)
    assert words[:3] == ["python", "train.py", "model=vgg11"] and not any(w.startswith("ckpt_path=old") for w in words)
    assert compose_config(words[2:]).ckpt_path == str(checkpoint)


def test_the_keys_a_jobs_overrides_name_are_hydras_own(monkeypatch):
    """What the resume check takes as set by the command: each override's key or group, as Hydra
    parses it (a group's package, an append, a delete, a forced add, a value with '=' in it)."""
    from ddlx import command_line

    overrides = ["data@data=cifar10", "+trainer.x=1", "~trainer.gradient_clip_val", "++seed=3", "data.root='/a=b'"]
    monkeypatch.setattr(command_line, "task_overrides", lambda: overrides)
    assert command_line.task_override_keys() == {"data", "trainer.x", "trainer.gradient_clip_val", "seed", "data.root"}

    def outside_a_job():
        raise ValueError("HydraConfig was not set")

    monkeypatch.setattr(command_line, "task_overrides", outside_a_job)
    assert command_line.task_override_keys() is None
