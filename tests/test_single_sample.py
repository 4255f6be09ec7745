"""A model with a batch norm over a 1x1 map (VGG's small variant at 16 px) cannot train on one image:
a job that would give a layer one (a batch, the epoch's last batch, a micro-batch, a thread's share)
is refused before training, with fixes that work; the strategies' pieces are the ones they cut."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddlx.config_check import typed_config
from ddlx.errors import ConfigError
from ddlx.models import build_model
from ddlx.single_sample import check_single_sample_batches, one_sample_pieces, trains_on_one_sample
from ddlx.strategies import STRATEGIES
from ddlx.strategies.parts.pipelines import smallest_micro_batch
from conftest import compose_config, runs


def meta_model(arch: str, image_size: int):
    with torch.device("meta"):
        return build_model(arch, 10, 3, image_size)


@pytest.mark.parametrize("arch,size,trains", [("vgg11", 16, False), ("vgg16", 16, False), ("vgg11", 17, True),
                                              ("vgg16", 32, True), ("resnet18", 16, True), ("mobilenet_v2", 16, True),
                                              ("alexnet", 16, True)])
def test_one_image_trains_unless_a_batch_norm_sees_one_value_per_channel(arch, size, trains):
    assert trains_on_one_sample(meta_model(arch, size), 3, size) is trains
    model = build_model(arch, 10, 3, size).train()
    try:
        model(torch.randn(1, 3, size, size))
        trained = True
    except ValueError:  # torch's batch norm refusing the batch
        trained = False
    assert trained is trains, "the meta check says what the real step does"


@pytest.mark.parametrize("batch", range(1, 13))
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5, 8])
def test_the_smallest_piece_is_the_one_the_strategy_cuts(batch, chunks):
    fairscale = SimpleNamespace(engine="fairscale", chunks=chunks, local="pipe")
    assert smallest_micro_batch(fairscale, batch) == min(len(c) for c in torch.empty(batch).chunk(chunks))
    assert STRATEGIES["hybrid"].smallest_piece(fairscale, batch) == smallest_micro_batch(fairscale, batch)
    assert STRATEGIES["hybrid"].smallest_piece(SimpleNamespace(local="split"), batch) == batch
    threads = SimpleNamespace(threads=chunks)
    assert STRATEGIES["threads"].smallest_piece(threads, batch) == \
        min(len(c) for c in torch.empty(batch).tensor_split(min(chunks, batch)))


def config(*overrides: str):
    return typed_config(compose_config(["model=vgg11", "data.image_size=16", *overrides]))


@pytest.mark.parametrize("overrides,processes,images,why", [
    (["data.batch_size=4"], 1, 9, r"the epoch ends in a batch of 1 \(9 training images in batches of 4\)"),
    (["data.batch_size=1"], 1, 9, r"data.batch_size=1 is a batch of 1"),
    (["data.batch_size=4", "strategy=pipe", "strategy.chunks=4"], 1, 8, r"strategy=pipe cuts a batch of 4 into pieces"),
    (["data.batch_size=4", "strategy=threads", "strategy.threads=3"], 1, 8, r"strategy=threads cuts a batch of 4"),
    (["data.batch_size=4", "strategy=ddp_gloo", "strategy.processes=2"], 2, 10,
     r"the epoch ends in a batch of 1 \(10 training images over 2 processes in batches of 2\)"),
    (["data.batch_size=4", "strategy=pipe", "strategy.engine=torch", "strategy.chunks=4"], 1, 18,
     r"strategy=pipe cuts the epoch's last batch of 2"),  # the fix a batch PyTorch's schedules take
    (["data.batch_size=8", "strategy=mpi", "strategy.local=threads", "strategy.threads=4"], 2, 16,
     r"strategy=mpi cuts a batch of 4 into pieces as small as 1"),
])
def test_a_job_giving_a_layer_one_image_is_refused_with_fixes_that_train(overrides, processes, images, why):
    cfg = config(*overrides)
    with pytest.raises(ConfigError, match=rf"model=vgg11 at data.image_size=16 .*{why}") as refused:
        check_single_sample_batches(cfg, meta_model("vgg11", 16), processes, images)
    fixes = str(refused.value).rsplit(": use ", 1)[1].split(" or ")
    assert fixes[0] == "data.image_size=17" and fixes[1].startswith("data.batch_size=")
    batch = int(fixes[1].split("=")[1])
    assert batch % processes == 0 and not one_sample_pieces(cfg, batch, processes, images), "the fix leaves no single image"
    assert STRATEGIES[cfg.strategy.name].takes_batch(cfg.strategy, batch // processes), "and the strategy takes it"


def test_a_batch_stated_per_worker_is_fixed_per_worker():
    cfg = config("data.batch_size=4", "strategy=ddp_gloo", "strategy.processes=2")  # 2 a worker, as batch_per=worker made it
    with pytest.raises(ConfigError, match=r"data.batch_size=3$"):  # 6 global: 5 images a process end in a batch of 2
        check_single_sample_batches(cfg, meta_model("vgg11", 16), 2, 10, per_worker=True)


def test_a_job_whose_every_piece_has_two_images_or_a_model_that_trains_on_one_is_taken():
    synced = config("data.batch_size=2", "strategy=ddp_gloo", "strategy.processes=2", "trainer.sync_batchnorm=true")
    check_single_sample_batches(synced, meta_model("vgg11", 16), 2, 10)  # SyncBatchNorm counts both ranks' values
    check_single_sample_batches(config("data.batch_size=4", "trainer.max_steps=2"), meta_model("vgg11", 16), 1, 9)
    check_single_sample_batches(config("data.batch_size=3"), meta_model("vgg11", 16), 1, 9)  # 3 batches of 3
    for limit in ("trainer.limit_train_batches=2", "trainer.limit_train_batches=0.5", "trainer.overfit_batches=1"):
        check_single_sample_batches(config("data.batch_size=4", limit), meta_model("vgg11", 16), 1, 9)  # never at the 1
    with pytest.raises(ConfigError, match="the epoch ends in a batch of 1"):
        check_single_sample_batches(config("data.batch_size=4", "trainer.limit_train_batches=3"), meta_model("vgg11", 16), 1, 9)
    resnet = typed_config(compose_config(["model=resnet18", "data.image_size=16", "data.batch_size=1"]))
    check_single_sample_batches(resnet, meta_model("resnet18", 16), 1, 9)


@pytest.mark.integration
def test_train_refuses_it_before_a_run_is_opened(tiny_config, tracking_uri, tmp_path):
    from ddlx.run import train

    cfg = tiny_config("model=vgg11", "data.image_size=16", "data.num_images=11", "data.batch_size=4",  # 9 = 4 + 4 + 1
                      "trainer.limit_train_batches=null")
    with pytest.raises(ConfigError, match=r"the epoch ends in a batch of 1.*data.image_size=17 or data.batch_size="):
        train(cfg, output_dir=tmp_path / "run")
    assert runs(tracking_uri) == [], "refused before a run was opened"
