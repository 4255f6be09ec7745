"""What every registered strategy owes the rest of ddlx, checked for each spec the registry finds
(a new strategy file is checked without a line here): it plans on a meta-device model, the tags
of its plan read back to the setup it was asked for, its candidates come out for every described
machine, and each candidate's predicted time and memory are finite."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ddlx.entry import register_config
from ddlx.errors import ConfigError
from ddlx.job import Job
from ddlx.predict.hw_files import DEFAULT_HW_DIR, hw_file
from ddlx.predict.prediction import Predictor
from ddlx.run import layered_model_meta
from ddlx.strategies import STRATEGIES, build_strategy
from ddlx.strategies.parts.replicas import ParallelDims
from ddlx.tracking import flatten_config

ROOT = Path(__file__).resolve().parents[1]
HW_FILES = sorted(p.stem for p in DEFAULT_HW_DIR.glob("*.yaml") if p.stem != "schema")
JOB = Job("resnet18", "firesmall", 3, 3, 32, 32, 640)
NAMES = sorted(STRATEGIES)


def composed(overrides: list[str]):
    register_config(ROOT)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=["model=resnet18", "data.image_size=32", "data.batch_size=32",
                                                       "data.num_images=640", *overrides])


def test_the_registry_finds_every_strategy_file():
    files = {p.stem for p in (ROOT / "ddlx" / "strategies").glob("*.py")} - {"__init__", "spec"}
    found = {type(spec).__module__.rsplit(".", 1)[-1] for spec in STRATEGIES.values()}
    assert found == files


def test_no_strategy_file_imports_another():
    """Composites compose the shared parts (ddlx/strategies/parts/), not each other's files."""
    files = {p.stem for p in (ROOT / "ddlx" / "strategies").glob("*.py")} - {"__init__", "spec"}
    for name in files:
        tree = ast.parse((ROOT / "ddlx" / "strategies" / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert not imported & files, (name, imported & files)


@pytest.mark.parametrize("name", NAMES)
def test_candidates_on_every_described_machine_have_a_finite_time_and_memory(name):
    spec, predicted = STRATEGIES[name], 0
    for hw_name in HW_FILES:
        hw = hw_file(hw_name, DEFAULT_HW_DIR)
        setups = [s for s in spec.candidates(hw, JOB) if spec.accepts(s, JOB)]
        assert all(s.strategy == name for s in setups)
        for p in Predictor(hw, []).recommend(JOB, setups=setups).predictions:
            assert math.isfinite(p.epoch_s) and p.epoch_s > 0, (hw_name, p.setup.label)
            assert math.isfinite(p.memory.per_device_gb) and p.memory.per_device_gb > 0, (hw_name, p.setup.label)
            predicted += 1
    assert predicted, f"strategy={name} is a candidate on none of {HW_FILES}"


def planned(name: str, overrides: list[str]):
    """(the plan on this CPU, the setup its tags read back to), or None where it is refused by name."""
    cfg = composed(overrides)
    try:
        plan = build_strategy(cfg.strategy, "cpu", layered_model_meta(cfg), cfg.data)
    except ConfigError as err:  # GPUs or more cores than here: refused by name, before any work
        assert name in str(err), str(err)
        return None
    params = flatten_config(OmegaConf.to_container(cfg, resolve=True))
    return plan, STRATEGIES[name].setup_of_run(params, plan.tags)


def test_parallel_dims_name_what_does_not_divide():
    dims = ParallelDims(8, 2, 4)
    assert (dims.replicas, dims.replicas_per_node) == (4, 2)
    with pytest.raises(ConfigError, match=r"strategy=mpi .* 3 on this node; start an even number"):
        ParallelDims(6, 2, 3).check("mpi", "start an even number")


def test_mpi_pipelines_on_an_odd_number_of_ranks_per_node_are_refused_with_the_launch_that_works(monkeypatch):
    import ddlx.parallel.mpi_ranks as mpi

    monkeypatch.setattr(mpi, "mpi_layout", lambda: (3, 3, 1))
    monkeypatch.setattr(mpi, "set_rank_threads", lambda local_size: 1)
    cfg = composed(["strategy=mpi", "strategy.local=pipe", "strategy.engine=torch"])
    with pytest.raises(ConfigError, match=r"strategy=mpi .*mpirun -np 2 --map-by ppr:2:node"):
        build_strategy(cfg.strategy, "cpu", layered_model_meta(cfg), cfg.data)


@pytest.mark.parametrize("name", NAMES)
def test_a_plan_s_tags_read_back_to_the_setup_it_was_asked_for(name):
    """Its default, and its candidates on CPU machines that start without a launcher (mpirun and
    srun set what they start, e.g. mpi's ranks, which a plan here cannot see)."""
    spec = STRATEGIES[name]
    default = planned(name, [f"strategy={name}"])
    setups = [default[1]] if default else []
    for hw_name in ("cpu_2core_cluster", "local"):
        hw = hw_file(hw_name, DEFAULT_HW_DIR)
        setups += [s for s in spec.candidates(hw, JOB) if not spec.launcher(s, hw)]
    read_back = 0
    for setup in dict.fromkeys(setups):
        again = planned(name, STRATEGIES[name].overrides(setup).split())
        if again is not None:
            assert again[1] == setup, (STRATEGIES[name].overrides(setup), again[0].tags)
            read_back += 1
    if name != "ddp_nccl":  # NCCL: GPUs only
        assert read_back, f"no setup of strategy={name} planned on this CPU"


@pytest.mark.parametrize("name", NAMES)
def test_candidates_are_setups_as_the_spec_builds_them(name):
    """Each candidate's knobs in its spec's order and without those its fields leave out (so its
    label reads as a measured run's setup does)."""
    spec = STRATEGIES[name]
    for hw_name in HW_FILES:
        for setup in spec.candidates(hw_file(hw_name, DEFAULT_HW_DIR), JOB):
            assert setup.knobs == spec.setup(**dict(setup.knobs)).knobs, (hw_name, setup.label)


def test_a_setup_is_its_spec_s_frozen_dataclass_of_typed_knobs():
    """Typed fields in the spec's order, equal whatever order the knobs come in or whether a knob
    its role leaves out was given; frozen; a knob its models do not read refused by name."""
    import dataclasses

    pipe = STRATEGIES["pipe"]
    given = pipe.setup(devices=["cpu", "cpu"], chunks=4, schedule="1f1b")  # schedule: only with engine=torch
    built = pipe.setup(chunks=4, devices=("cpu", "cpu"))
    assert type(given) is pipe.setup_type and given == built and hash(given) == hash(built)
    assert (built.chunks, built.devices, built.engine, built.schedule) == (4, ("cpu", "cpu"), "fairscale", "gpipe")
    assert built.label == "pipe chunks=4 devices=[cpu,cpu]" and pipe.with_knobs(built, chunks=8).chunks == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.chunks = 8
    with pytest.raises(AttributeError):
        built.chunk  # a misspelt knob is an error, not a silent default
    with pytest.raises(ValueError, match="timeout_s"):
        pipe.setup(chunks=4, timeout_s=60.0)  # not a knob its models read
    assert STRATEGIES["ddp_gloo"].setup(processes=2) != STRATEGIES["ddp_nccl"].setup(processes=2)
    assert STRATEGIES["sequential"].setup(trainer="gpu", threads=4).knobs == (("trainer", "gpu"),)
    with pytest.raises(ValueError, match="trainer=cpu"):
        STRATEGIES["sequential"].setup(trainer="cpu")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_spec_s_setup_type_resolves_its_types_and_survives_pickling(name):
    """Its types as the config's module declares them; a setup sent to another process (a pool,
    a launcher) comes back equal, though its class is made at run time."""
    import pickle
    import typing

    spec = STRATEGIES[name]
    assert set(typing.get_type_hints(spec.setup_type)) == {"strategy", *spec.launcher_knobs, *spec.setup_fields(),
                                                            *(knob for knob, _, _ in spec.extra_setup_knobs)}
    setup = spec.setup()
    assert pickle.loads(pickle.dumps(setup)) == setup


def test_a_run_s_setup_is_read_from_its_fields_roles():
    """The resolved tag first, then the param, then what a run from before the knob used; a knob
    at a default its setup leaves out, or without the knob values it needs, is left out."""
    cpu_mp, ddp, pipe, fsdp = (STRATEGIES[n] for n in ("cpu_mp", "ddp_gloo", "pipe", "fsdp"))
    assert cpu_mp.setup_of_run({"strategy.processes": "2"}, {}).knobs == (("processes", 2), ("split_linear", "never"))
    assert cpu_mp.setup_of_run({"strategy.processes": "2", "strategy.split_linear": "auto"}, {}).knobs == (("processes", 2),)
    assert ddp.setup_of_run({"strategy.processes": "2", "strategy.bucket_cap_mb": "25.0"}, {}).knobs == (("processes", 2),)
    assert ddp.setup_of_run({"strategy.processes": "2"}, {"bucket_cap_mb": "5"}).bucket_cap_mb == 5.0
    fairscale = {"strategy.chunks": "4", "strategy.devices": "auto", "strategy.engine": "fairscale", "strategy.schedule": "1f1b"}
    assert pipe.setup_of_run(fairscale, {}) == pipe.setup(chunks=4, devices=("cpu", "cpu")), "devices: the plan's, not auto"
    assert pipe.setup_of_run({**fairscale, "strategy.engine": "torch"}, {"devices": "cuda:0,cuda:1"}).knobs == (
        ("chunks", 4), ("devices", ("cuda:0", "cuda:1")), ("engine", "torch"), ("schedule", "1f1b"))
    hybrid = {"strategy.processes": "4", "strategy.sharding": "hybrid", "strategy.shard_size": "None"}
    assert fsdp.setup_of_run(hybrid, {"shard_size": "2"}).shard_size == 2
    assert fsdp.setup_of_run({**hybrid, "strategy.sharding": "full"}, {}).shard_size is None


def test_a_run_s_label_shows_its_tags_but_quiet_defaults_and_its_set_params():
    from ddlx.records import setup_label

    pipe = {"strategy": "pipe", "chunks": "4", "devices": "cpu,cpu", "balance": "[7, 7]", "checkpoint": "never"}
    assert setup_label(pipe, {"strategy.balance": "None"}) == "pipe chunks=4 devices=cpu,cpu"
    assert setup_label({**pipe, "engine": "torch", "schedule": "gpipe"}, {"strategy.balance": "[3, 11]"}) == \
        "pipe chunks=4 devices=cpu,cpu balance=[3, 11] engine=torch"
    hybrid = {"strategy": "hybrid", "processes": "2", "local": "pipe", "chunks": "2", "checkpoint": "always", "engine": "torch"}
    assert setup_label(hybrid, {}) == "hybrid processes=2 local=pipe chunks=2 checkpoint=always engine=torch"
    assert setup_label({"strategy": "mpi", "ranks": "4", "nodes": "2", "local": "sequential", "backend": "gloo"}, {}) == \
        "mpi ranks=4 nodes=2 local=sequential backend=gloo"


@pytest.mark.parametrize("name", NAMES)
def test_each_setup_knob_can_be_tried_on_every_described_machine(name):
    """recommend.py's ``candidates.<strategy>.<knob>=[...]``: each knob it accepts builds the
    strategy's setups at that value on every machine (a GPU's sequential, named by its trainer, too)."""
    from ddlx.predict.setups import candidates

    spec = STRATEGIES[name]
    tried = {k: f.default for k, f in spec.setup_fields().items() if f.default not in (None, "auto")}
    for hw_name in HW_FILES:
        for setup in candidates(hw_file(hw_name, DEFAULT_HW_DIR), JOB, tries={name: {k: [v] for k, v in tried.items()}}):
            if setup.strategy == name and getattr(setup, "trainer", None) is None:
                assert all(getattr(setup, k) == v for k, v in tried.items()), (hw_name, setup.label)


def test_a_knob_left_unset_is_left_out_of_the_command_and_shown_as_null():
    """recommend.py printed strategy.shard_size=None for a tried fsdp sharding=hybrid, which train.py refuses."""
    spec = STRATEGIES["fsdp"]
    setup = spec.setup(processes=2, sharding="hybrid", shard_size=None)
    assert spec.overrides(setup) == "strategy=fsdp strategy.processes=2 strategy.sharding=hybrid"
    assert "shard_size=null" in setup.label
    from ddlx.config_check import check_config

    check_config(composed(spec.overrides(setup).split()))  # a command train.py takes
