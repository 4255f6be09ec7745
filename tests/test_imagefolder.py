"""data=imagefolder on real images: scikit-learn's handwritten digits (1,797 8x8 scans of 10
digits, shipped inside the package) written as an ImageFolder at test time, some of them saved
as RGB, RGBA, palette and CMYK files beside the grayscale ones."""
from __future__ import annotations

import dataclasses

import logging
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import runs
from PIL import Image

from ddlx.config_check import typed_config
from ddlx.data.folder import complete_data_config
from ddlx.errors import ConfigError
from ddlx.data.datamodule import build_datamodule
from ddlx.run import train

datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn ships the real digit images (pip install -e .[dev])")

MODES = ("RGB", "RGBA", "P", "CMYK")  # every 7th image of a class, in turn, saved in one of these


def write_digits(root, mixed_modes: bool = False, per_class: int | None = None):
    digits = datasets.load_digits()
    pixels = (digits.images * (255 / 16)).astype(np.uint8)  # 0-16 grey levels as 8-bit
    counts: dict[int, int] = {}
    for i, (image, label) in enumerate(zip(pixels, digits.target)):
        n = counts[label] = counts.get(label, 0) + 1
        if per_class is not None and n > per_class:
            continue
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        gray = Image.fromarray(image, mode="L")
        if mixed_modes and n % 7 == 0:
            mode = MODES[(n // 7) % len(MODES)]
            converted = gray.convert("RGB").convert(mode)
            if mode == "P":
                converted.info["transparency"] = 0
            converted.save(folder / f"{i}.{'jpg' if mode == 'CMYK' else 'png'}")
        else:
            gray.save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    return write_digits(tmp_path_factory.mktemp("imgs") / "digits")


def test_the_folder_gives_classes_counts_channels_and_name(digits_dir, tiny_config):
    cfg = typed_config(tiny_config("data=imagefolder", f"data.root={digits_dir}", "data.num_images=null"))
    complete_data_config(cfg.data)
    assert cfg.data.name == "digits"
    assert list(cfg.data.classes) == [str(d) for d in range(10)] and cfg.data.num_classes == 10
    assert cfg.data.channels == 1 and len(cfg.data.mean) == 1
    dm = build_datamodule(cfg.data)
    dm.setup()
    assert len(dm.train_set) + len(dm.val_set) == 1797  # every image, not an inherited count


def test_grayscale_rgba_palette_and_cmyk_files_all_load(tmp_path, tiny_config):
    root = write_digits(tmp_path / "mixed", mixed_modes=True, per_class=30)
    cfg = typed_config(tiny_config("data=imagefolder", f"data.root={root}", "data.num_images=null"))
    complete_data_config(cfg.data)
    assert cfg.data.channels == 3  # colour files among them: grayscale ones are converted
    dm = build_datamodule(cfg.data)
    dm.setup()
    seen = set()
    for dataset in (dm.train_set, dm.val_set):
        for k, (path, _) in enumerate(dataset.samples):
            with Image.open(path) as image:
                seen.add(image.mode)
            tensor, _ = dataset[k]
            assert tuple(tensor.shape) == (3, 32, 32)
    assert {"L", "RGB", "RGBA", "P", "CMYK"} <= seen


def test_a_subset_says_how_many_of_how_many(digits_dir, tiny_config, caplog):
    cfg = typed_config(tiny_config("data=imagefolder", f"data.root={digits_dir}", "data.num_images=100"))
    complete_data_config(cfg.data)
    with caplog.at_level(logging.INFO, logger="ddlx.data.image_data"):
        build_datamodule(cfg.data).setup()
    assert "100 of the 1797 images" in caplog.text


def test_a_named_dataset_on_another_folder_points_to_imagefolder(digits_dir, tiny_config):
    cfg = tiny_config("data=firesmall", f"data.root={digits_dir}")
    with pytest.raises(ConfigError, match=r"data=imagefolder data.root="):
        complete_data_config(cfg.data)


def test_one_class_or_no_root_is_refused_with_the_fix(tmp_path, tiny_config):
    (tmp_path / "only" / "cats").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "only" / "cats" / "a.png")
    with pytest.raises(ConfigError, match=r"data.root=.*one class sub-folder \(cats\).*at least two classes"):
        complete_data_config(tiny_config("data=imagefolder", f"data.root={tmp_path / 'only'}").data)
    with pytest.raises(ConfigError, match=r"data.root is not set.*data.root=DIR"):
        complete_data_config(tiny_config("data=imagefolder", "data.root=null").data)
    with pytest.raises(ConfigError, match=r"data.root='' does not exist.*data.root=null"):  # not the current folder
        complete_data_config(tiny_config("data=imagefolder", "data.root=").data)


@pytest.mark.integration
def test_train_on_the_folder_records_its_name_and_counts(digits_dir, tiny_config, tracking_uri, tmp_path):
    train(tiny_config("data=imagefolder", f"data.root={digits_dir}", "data.num_images=null", "model=resnet18"),
          tmp_path / "out")
    (run,) = runs(tracking_uri)
    assert run.info.status == "FINISHED"
    assert run.data.tags["data"] == "digits"
    assert run.data.params["data.num_classes"] == "10" and run.data.params["data.channels"] == "1"


@pytest.mark.parametrize("num_images", ["null", "500"])
def test_recommend_counts_the_training_images_train_py_would(tmp_path, tiny_config, num_images):
    """The recommender's epoch is train.py's: as many images as the folder holds where fewer than
    data.num_images, and at least one held out where data.val_fraction > 0 rounds to none."""
    from hydra import compose, initialize_config_dir
    from ddlx.predict.cli import job_from_config

    root = write_digits(tmp_path / "few", per_class=2)  # 20 images: 2% of them rounds to 0
    data = ["data=imagefolder", f"data.root={root}", f"data.num_images={num_images}", "data.val_fraction=0.02",
            "data.batch_size=4"]
    cfg = typed_config(tiny_config(*data))
    complete_data_config(cfg.data)
    module = build_datamodule(cfg.data)
    module.setup()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        asked = compose(config_name="recommend", overrides=data)
    assert job_from_config(asked).train_samples == len(module.train_set) == 19


@pytest.mark.parametrize("overrides, fix", [
    (["data.batch_size=32"], "at most 16 or add images to the folder"),  # 20 images: none to add by a knob
    (["data.batch_size=18"], "at most 16 or lower data.val_fraction"),  # 20 images would fill it
    (["data.batch_size=12", "data.num_images=10"], "at most 8 or raise data.num_images (the folder holds 20)"),
    (["data.batch_size=18", "data.num_images=10"],  # the folder's 16 of 20 would not
     "at most 8 or lower data.val_fraction and raise data.num_images (the folder holds 20)")])
def test_a_batch_larger_than_a_folders_split_names_a_fix_the_folder_allows(tmp_path, tiny_config, overrides, fix):
    """A folder of the user's cannot be made larger by data.num_images (a synthetic set can): the
    refusal offered that fix for a folder whose images were all in use. Each fix offered gives a
    split that fills the batch."""
    root = write_digits(tmp_path / "few", per_class=2)
    cfg = typed_config(tiny_config("data=imagefolder", f"data.root={root}", "data.num_images=null", *overrides))
    complete_data_config(cfg.data)
    with pytest.raises(ConfigError, match=r"data.batch_size=\d+: lower data.batch_size to " + re.escape(fix) + "$"):
        build_datamodule(cfg.data).setup()


def test_a_split_too_small_is_said_in_the_global_batch_over_the_data_parallel_processes():
    """train.py checked a process's share of the batch but named it data.batch_size and, with the
    largest batch that fits, gave one batch of that process: 4 processes, batch 64, 10 training
    images were told 'data.batch_size=16: ... at most 10'."""
    from ddlx.job import split_too_small

    assert split_too_small(13, 0.2, 64, folder_holds=13, data_parallel=4) == (
        "the training split has 10 images (13 images, data.val_fraction=0.2) but data.batch_size=64 over 4 processes: "
        "lower data.batch_size to at most 40 or add images to the folder")
    assert split_too_small(13, 0.2, 40, folder_holds=13, data_parallel=4) is None
    assert split_too_small(1, 0.5, 8) == ("the training split has 0 images (1 images, data.val_fraction=0.5) but "
                                          "data.batch_size=8: raise data.num_images"), "no batch of at most 0"


def test_a_split_too_small_for_a_batch_per_process_is_said_in_the_batch_as_stated(tmp_path, tiny_config):
    """data.batch_per=worker: the user's data.batch_size is each process's; the refusal named the
    global batch it had become and offered a fix at most the batch already given ('data.batch_size=64
    over 2 processes: lower data.batch_size to at most 32' where 32 was given)."""
    from ddlx.job import split_too_small

    assert split_too_small(20, 0.2, 32, data_parallel=2, per_worker=True) == (
        "the training split has 16 images (20 images, data.val_fraction=0.2) but data.batch_size=32 per worker "
        "(data.batch_per=worker): lower data.batch_size to at most 16 or raise data.num_images")
    assert split_too_small(20, 0.2, 16, data_parallel=2, per_worker=True) is None
    root = write_digits(tmp_path / "few", per_class=2)  # 20 images, 16 to train on
    cfg = typed_config(tiny_config("data=imagefolder", f"data.root={root}", "data.num_images=null", "data.batch_size=36"))
    complete_data_config(cfg.data)  # (36 per process over 2: ddlx.run.batch_of_workers makes it 72)
    with pytest.raises(ConfigError, match=r"data.batch_size=36 per worker \(data.batch_per=worker\): lower "
                                          r"data.batch_size to at most 16 or add images to the folder$"):
        build_datamodule(dataclasses.replace(cfg.data, batch_size=72), 2, per_worker=True).setup()


def test_images_in_a_class_folders_sub_folders_are_its_own_as_torchvision_finds_them(tmp_path):
    """torchvision's ImageFolder walks each class folder: a nested image was left out without a word."""
    from torchvision.datasets import ImageFolder

    from ddlx.data.folder import scan_imagefolder

    root = write_digits(tmp_path / "digits", per_class=3)
    nested = root / "0" / "scans" / "late"
    nested.mkdir(parents=True)
    Image.new("L", (8, 8)).save(nested / "extra.png")
    (root / "1" / "notes.txt").write_text("not an image")
    classes, samples = scan_imagefolder(root)
    theirs = ImageFolder(str(root))
    assert classes == theirs.classes and samples == [(str(Path(p)), i) for p, i in theirs.samples]
    assert (str(nested / "extra.png"), 0) in samples
