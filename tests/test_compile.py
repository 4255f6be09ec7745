"""PyTorch 2's speed knobs: torch.compile (compile.enable), channels_last (model.memory_format) and
the optimizer step's implementation (optim.implementation): the same maths as eager, compile time
kept apart, refused where a strategy cannot take it."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import uuid

import pytest
import torch
from conftest import PROJECT_DIR, runs, subprocess_env
from test_strategies import SAME_MATHS, final_weights, train_here

from ddlx.compiling import CompileClock, compile_model, optimizer_flags, to_memory_format
from ddlx.models import build_model
from ddlx.parallel.balance import layer_times
from ddlx.module import ClassifierModule
from ddlx.records import MeasuredRun, usable, workload_of


def _steps(module: ClassifierModule, steps: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """``steps`` SGD steps of ``module`` on fixed random images: its parameters after them."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = module.configure_optimizers()
    for _ in range(steps):
        images, labels = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        optimizer.zero_grad()
        module.loss(module(images), labels).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def _module(**kwargs) -> ClassifierModule:
    torch.manual_seed(0)
    return ClassifierModule(build_model("resnet18", 3, 3, 32), 3, lr=0.01, momentum=0.9, **kwargs)


@pytest.mark.parametrize("implementation", ["for_loop", "foreach", "fused"])
def test_every_optimizer_implementation_takes_the_same_steps(implementation):
    assert set(optimizer_flags(implementation)) <= {"foreach", "fused"}
    want = _steps(_module())
    got = _steps(_module(implementation=implementation))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_channels_last_trains_the_same_weights():
    want = _steps(_module())
    module = _module(channels_last=True)
    module.model = to_memory_format(module.model, "channels_last")
    conv = next(m for m in module.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    got = _steps(module)
    for name in want:
        torch.testing.assert_close(got[name].contiguous(), want[name], rtol=1e-3, atol=1e-4, msg=name)  # NHWC kernels sum in another order


def test_compile_clock_counts_compiling_once_and_not_the_calls():
    clock = CompileClock()
    clock.install()
    try:
        f = torch.compile(lambda x: torch.relu(x) * 2, backend="eager")
        f(torch.randn(3))
        first = clock.seconds
        assert first > 0, "the first call traces the function"
        f(torch.randn(3))
        assert clock.seconds == first, "a call of a compiled graph is not compiling"
    finally:
        clock.remove()


COUNT_A_GRAPH_TWICE = """
import json, sys, torch
from torch._inductor import config
from ddlx.compiling import CompileClock
scale = float(sys.argv[1])
clock = CompileClock()
clock.install()
counts = []
with config.patch(fx_graph_cache=True):
    for _ in range(2):
        torch.compile(lambda x: torch.relu(x) * scale)(torch.randn(3))
        counts.append(clock.cache_counts())
        torch._dynamo.reset()
print(json.dumps(counts))
"""


def test_compile_clock_counts_graphs_compiled_and_graphs_taken_from_inductor_s_cache():
    """A graph the cache does not hold is compiled (a miss); compiled again after dynamo forgets
    it (a sweep's next job in the same process, a rerun), inductor takes it from its cache (a hit).
    The graph's constant is new to the cache (the machine's inductor cache, whose compiler
    set-up is warm: a folder of its own would compile that too, half a minute). In a process of
    its own: inductor leaves worker threads and pools behind, which a later test's fork would
    inherit."""
    scale = 1 + uuid.uuid4().int % 10**9 / 10**10
    out = subprocess.run([sys.executable, "-c", COUNT_A_GRAPH_TWICE, repr(scale)], capture_output=True, text=True,
                         timeout=300, env=subprocess_env(), cwd=PROJECT_DIR)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [[0, 1], [1, 1]]


def test_compiled_forward_keeps_the_state_dict_and_hooks_outside():
    """The forward is compiled, not the module: its keys stay those of an eager model (checkpoints
    of either resume the other), and each layer is compiled apart for strategies cutting by layers."""
    model = build_model("alexnet", 3, 3, 32)
    keys = list(model.state_dict())
    compile_model(model, "layer")
    assert list(model.state_dict()) == keys
    assert all("forward" in layer.__dict__ for layer in model.children()), "each layer's forward compiled"
    assert "forward" not in model.__dict__
    whole = build_model("alexnet", 3, 3, 32)
    compile_model(whole, "model")
    assert "forward" in whole.__dict__ and not any("forward" in layer.__dict__ for layer in whole.children())
    assert list(whole.state_dict()) == keys


@pytest.fixture
def eager_backend(monkeypatch):
    """torch.compile with dynamo's eager backend: the same frames and caching, without inductor's kernels."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real(fn, backend="eager", **kwargs))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_copy_of_a_compiled_model_runs_its_own_weights(eager_backend):
    model = build_model("alexnet", 3, 3, 32)
    compile_model(model, "layer")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    images = torch.randn(2, 3, 32, 32)
    assert torch.count_nonzero(twin(images)) == 0, "the copy ran the original's weights"
    assert torch.count_nonzero(model(images)) > 0


def test_a_pipeline_balanced_by_time_profiles_compiled_layers_eager(eager_backend):
    """balance=auto times a copy of each layer on a detached input: a compiled in-place ReLU of the
    original failed there ('a leaf Variable that requires grad is being used in an in-place
    operation'), so every compiled torch pipeline with balance=auto failed before its first step."""
    model = build_model("alexnet", 3, 3, 32)
    compile_model(model, "layer")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    times = layer_times(model, torch.randn(2, 3, 32, 32), rounds=1)
    assert len(times) == len(model) and all(t > 0 for t in times)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "the profile compiled nothing"
    assert all("forward" in layer.__dict__ for layer in model.children()), "the model itself stays compiled"


@pytest.mark.integration
@pytest.mark.parametrize("strategy, key", [
    (["strategy=pipe"], "strategy.engine=torch"),
    (["strategy=split"], "strategy=pipe strategy.engine=torch"),
    (["strategy=hybrid", "strategy.local=split"], "strategy.local=pipe"),
])
def test_a_strategy_that_cannot_take_compile_refuses_it_before_any_work(tmp_path, strategy, key):
    done = subprocess.run([sys.executable, str(PROJECT_DIR / "train.py"), f"paths.root={tmp_path}", *strategy,
                           "compile.enable=true"], capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "compile.enable=true" in lines[0] and key in lines[0]
    assert not (tmp_path / "mlflow.db").exists(), "refused before any run is opened"


def test_the_recommender_leaves_compiled_runs_out():
    params = {"model.name": "alexnet", "data.num_classes": "3", "data.channels": "3", "data.image_size": "32",
              "data.batch_size": "8", "measure.warmup_epochs": "1"}
    metrics = {"mean_epoch_time_s": 1.0, "mean_samples_per_s": 8.0, "measured_epochs": 2.0}

    def run(**extra):
        tags = {"strategy": "sequential", "host": "h", "accelerator": "cpu"}
        return MeasuredRun("r", "FINISHED", workload_of(params, tags), "cpu", "sequential", "sequential", 1.0,
                           params=params | extra, tags=tags, metrics=metrics)

    assert usable(run())
    assert not usable(run(**{"compile.enable": "True"}))
    assert not usable(run(**{"model.memory_format": "channels_last"}))
    assert not usable(run(**{"optim.implementation": "fused"}))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["strategy=sequential"], ["strategy=ddp_gloo", "strategy.processes=2"]])
def test_compiled_runs_end_with_the_eager_weights(tmp_path, strategy):
    """Compiled (inductor's kernels: another summation order) against eager after the same steps,
    within a tolerance; the compile seconds are their own metric, out of the epoch times."""
    data = tmp_path / "data"
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    common = [*SAME_MATHS, *strategy, f"paths.data_dir={data}", "checkpoint.save=full"]
    eager.mkdir(), compiled.mkdir()
    train_here(eager, *common)
    train_here(compiled, *common, "compile.enable=true")
    got, want = final_weights(compiled), final_weights(eager)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-5, msg=name)
    (run,) = runs(f"sqlite:///{compiled / 'mlflow.db'}")
    assert run.info.status == "FINISHED" and run.data.metrics["compile_s"] > 0
    assert run.data.metrics["epoch_time_s"] < run.data.metrics["compile_s"], "compiling is not in the epoch's time"
    assert run.data.metrics["compile_cache_hits"] + run.data.metrics["compile_cache_misses"] > 0, "inductor's graphs counted"


@pytest.mark.slow
def test_a_compiled_run_resumes_from_its_checkpoint_with_the_eager_maths(tmp_path):
    """One compiled epoch, stopped, resumed compiled for a second: the weights of two eager epochs,
    under the eager model's keys (the checkpoint loads into an eager model). A resume keeps the
    run's settings (compile.enable included): the MLflow run stays one run of one setup."""
    data = tmp_path / "data"
    common = [*[o for o in SAME_MATHS if not o.startswith("trainer.max_epochs")], f"paths.data_dir={data}",
              "checkpoint.save=full"]
    straight, first = tmp_path / "straight", tmp_path / "first"
    straight.mkdir(), first.mkdir()
    train_here(straight, *common, "trainer.max_epochs=2")
    train_here(first, *common, "trainer.max_epochs=1", "compile.enable=true")
    (ckpt,) = (first / "run" / "checkpoints").glob("*.ckpt")
    train_here(first, *common, "trainer.max_epochs=2", "compile.enable=true", f"ckpt_path={ckpt}")
    got, want = final_weights(first), final_weights(straight)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-5, msg=name)
    (run,) = runs(f"sqlite:///{first / 'mlflow.db'}")
    assert run.info.status == "FINISHED" and run.data.metrics["compile_s"] > 0
