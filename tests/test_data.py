"""Datamodule: synthetic writer, counts, transforms, and clear errors for bad data."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import subprocess_env
from PIL import Image

from ddlx.allocator import keep_freed_possible
from ddlx.config import DataConfig
from ddlx.data.datamodule import ImageFolderDataModule, build_datamodule
from ddlx.data.synthetic import SyntheticSpec, ensure_synthetic_imagefolder
from ddlx.data.statistics import IMAGENET_MEAN, IMAGENET_STD
from ddlx.data.transforms import build_transform, flips
from ddlx.errors import ConfigError
from ddlx.process import wait_for

FIRE = ("fire", "nofire", "smoke")


def fire_module(tmp_path: Path, **overrides) -> ImageFolderDataModule:
    kwargs = dict(
        name="firesmall", num_classes=3, channels=3, image_size=32, batch_size=8, num_images=30,
        classes=FIRE, num_workers=0, synthetic_dir=str(tmp_path / "synthetic"), synthetic_size=[40, 90],
        mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD),
    )
    kwargs.update(overrides)
    return build_datamodule(DataConfig(**kwargs))


def test_synthetic_fire_set_has_the_requested_layout(tmp_path):
    dm = fire_module(tmp_path, num_images=31)
    dm.prepare_data()
    folder = dm.data_folder
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == list(FIRE)
    files = sorted(folder.rglob("*.jpg"))
    assert len(files) == 31
    sizes = set()
    for f in files:
        with Image.open(f) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            sizes.add(im.size)
            assert 40 <= min(im.size) and max(im.size) <= 90
    assert len(sizes) > 5, "original sizes should vary like real photos"
    counts = [len(list((folder / c).iterdir())) for c in FIRE]
    assert max(counts) - min(counts) <= 1, "classes are balanced"


def test_synthetic_set_is_written_once_and_reused(tmp_path):
    dm = fire_module(tmp_path)
    dm.prepare_data()
    marker = dm.data_folder / ".ddlx_synthetic.json"
    first = marker.stat().st_mtime_ns
    fire_module(tmp_path).prepare_data()
    assert marker.stat().st_mtime_ns == first
    # A different image count is a different dataset, not a silent reuse.
    other = fire_module(tmp_path, num_images=40)
    assert other.data_folder != dm.data_folder


def test_images_written_ahead_in_a_child_are_those_prepare_data_writes(tmp_path):
    """A probe writes its images in a child while it imports the training stack: the same files,
    which its own prepare_data then finds complete."""
    ahead = fire_module(tmp_path / "ahead")
    child = ahead.prepare_data_ahead()
    assert child is not None and child.pid != os.getpid()
    wait_for(child, timeout_s=60)
    assert child.exitcode == 0
    marker = ahead.data_folder / ".ddlx_synthetic.json"
    written = marker.stat().st_mtime_ns
    ahead.prepare_data()
    assert marker.stat().st_mtime_ns == written, "found complete, not written again"
    assert ahead.prepare_data_ahead() is None, "nothing left to write"
    direct = fire_module(tmp_path / "direct")
    direct.prepare_data()
    files = sorted(p.relative_to(direct.data_folder) for p in direct.data_folder.rglob("*.jpg"))
    assert files and files == sorted(p.relative_to(ahead.data_folder) for p in ahead.data_folder.rglob("*.jpg"))
    assert all((ahead.data_folder / f).read_bytes() == (direct.data_folder / f).read_bytes() for f in files)


def test_a_child_that_cannot_write_ahead_leaves_the_error_to_prepare_data(tmp_path):
    (tmp_path / "synthetic").write_text("a file where the folder should be")
    dm = fire_module(tmp_path)
    child = dm.prepare_data_ahead()
    wait_for(child, timeout_s=60)
    assert child.exitcode == 1
    with pytest.raises(OSError):
        dm.prepare_data()


def test_the_writers_of_a_killed_parent_do_not_hold_the_datasets_lock(tmp_path):
    """The writing processes are forked while the lock is held: each closes its copy and ends with
    its parent, so that writers of a parent killed mid-write (the out-of-memory killer) neither keep
    every later run waiting on the lock nor live on."""
    import fcntl

    dm = fire_module(tmp_path, num_images=400, synthetic_size=[300, 600])
    child = dm.prepare_data_ahead()
    lock = dm.data_folder.parent / f".{dm.data_folder.name}.lock"
    deadline = time.monotonic() + 60
    staging = dm.data_folder.parent / f"{dm.data_folder.name}.partial"
    while not any(staging.rglob("*.jpg")):  # its writers are at work
        assert time.monotonic() < deadline and child.is_alive(), "the child never started writing"
        time.sleep(0.01)
    writers = psutil.Process(child.pid).children()
    assert writers, "a pool of writers"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    _, alive = psutil.wait_procs(writers, timeout=30)
    for writer in alive:
        writer.kill()
    assert not alive, "the writers end with their parent"
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while a writer holds it
    dm.prepare_data()
    assert len(list(dm.data_folder.rglob("*.jpg"))) == 400


def test_interrupted_write_is_not_taken_as_complete(tmp_path):
    spec = SyntheticSpec(classes=FIRE, num_images=6, channels=3, min_size=32, max_size=40)
    folder = tmp_path / "set"
    (folder / "fire").mkdir(parents=True)  # leftovers without the completion marker
    ensure_synthetic_imagefolder(folder, spec, workers=1)
    assert len(list(folder.rglob("*.jpg"))) == 6


def test_split_counts_and_loaders(tmp_path):
    dm = fire_module(tmp_path, num_images=30, val_fraction=0.2)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 24 and len(dm.val_set) == 6
    train_paths = {p for p, _ in dm.train_set.samples}
    assert not train_paths & {p for p, _ in dm.val_set.samples}
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    assert labels.min() >= 0 and labels.max() <= 2


def test_a_strategy_shards_the_batches_and_may_skip_the_images(tmp_path):
    """The strategy says how the data is sharded (a pipeline's stages all read the whole batch)
    and whether this process reads the images (a pipeline's later stages need only the labels)."""
    from types import SimpleNamespace

    dm = fire_module(tmp_path, num_images=30, val_fraction=0.2, num_workers=2)
    dm.prepare_data()
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    labels = torch.cat([next(batches)[1], next(batches)[1]])
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1}, needs_inputs=False)
    dm.trainer = SimpleNamespace(strategy=strategy)
    loader = dm.train_dataloader()
    placeholders, second = next(iter(loader))
    assert placeholders.shape == (8, 0) and loader.num_workers == 0, "labels only: nothing decoded, no workers"
    assert second.tolist() == labels[1::2].tolist(), "rank 1 of 2 takes every other sample of the same global batch"


def test_grayscale_dataset(tmp_path):
    dm = fire_module(
        tmp_path, name="mnist", num_classes=10, classes=[str(i) for i in range(10)], channels=1, image_size=28,
        num_images=40, mean=(0.1307,), std=(0.3081,), synthetic_size=(28, 28), synthetic_format="png",
    )
    dm.prepare_data()
    dm.setup()
    image, _ = dm.train_set[0]
    assert image.shape == (1, 28, 28)


def test_transform_follows_the_paper():
    """Crop/scale to the size, ToTensor, normalize with the ImageNet statistics; in training half
    of the samples flip, each the same way wherever and whenever it is loaded."""
    image = Image.new("RGB", (120, 60), (124, 116, 104))  # 0.485/0.456/0.406 * 255, roughly
    transform = build_transform(32, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    out = transform(image)
    assert out.shape == (3, 32, 32)
    assert out.abs().max() < 0.02, "mean-coloured image normalizes to ~0"
    coins = [flips(7, epoch, index) for epoch in range(4) for index in range(100)]
    assert 160 < sum(coins) < 240
    assert coins == [flips(7, epoch, index) for epoch in range(4) for index in range(100)]
    assert [flips(7, 0, i) for i in range(100)] != [flips(7, 1, i) for i in range(100)], "a new draw each epoch"


def test_a_training_sample_flips_by_seed_epoch_and_index(tmp_path):
    from ddlx.data.image_data import ImageFileDataset

    dm = fire_module(tmp_path, num_images=30)
    dm.prepare_data()
    dm.setup()
    index = next(i for i in range(len(dm.train_set)) if flips(dm.data.seed, 3, i))
    unflipped, _ = ImageFileDataset(dm.train_set.samples, dm.train_set.transform, dm.train_set.mode)[index]
    assert torch.equal(dm.train_set[(index, 3)][0], unflipped.flip(-1))
    assert torch.equal(dm.val_set[(index, 3)][0], dm.val_set[index][0]), "validation never flips"


def test_missing_root_says_how_to_fix(tmp_path):
    dm = fire_module(tmp_path, root=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"data.root=.*nowhere does not exist.*data.root=null"):
        dm.setup()


def _real_folder(tmp_path: Path, per_class: int = 12) -> Path:
    root = tmp_path / "real"
    for c in FIRE:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (50, 40), (i * 10, 0, 0)).save(root / c / f"{i}.jpg")
    return root


def test_real_imagefolder_is_used(tmp_path):
    dm = fire_module(tmp_path, root=str(_real_folder(tmp_path)), num_images=None)
    dm.prepare_data()
    dm.setup()
    assert not dm.is_synthetic
    assert len(dm.train_set) + len(dm.val_set) == 36
    assert not (tmp_path / "synthetic").exists(), "no synthetic data written when real data is given"


def test_empty_class_folder_is_named(tmp_path):
    root = _real_folder(tmp_path)
    for f in (root / "smoke").iterdir():
        f.unlink()
    with pytest.raises(ConfigError, match=r"class folder .*smoke has no images"):
        fire_module(tmp_path, root=str(root)).setup()


def test_unreadable_image_is_named(tmp_path):
    root = _real_folder(tmp_path)
    (root / "fire" / "broken.jpg").write_bytes(b"not a jpeg at all")
    with pytest.raises(ConfigError, match=r"unreadable image .*broken\.jpg"):
        fire_module(tmp_path, root=str(root), num_images=None).setup()


def test_fewer_images_than_one_batch(tmp_path):
    with pytest.raises(ConfigError, match=r"training split has 4 images.*data.batch_size=8"):
        dm = fire_module(tmp_path, num_images=5)
        dm.prepare_data()
        dm.setup()


def test_class_count_mismatch(tmp_path):
    with pytest.raises(ConfigError, match=r"has 3 class folders.*data.num_classes=5"):
        fire_module(tmp_path, root=str(_real_folder(tmp_path)), num_classes=5, classes=None).setup()


def test_bad_knobs_fail_before_any_work(tmp_path):
    """(Each knob's own range is the schema's: tests/test_config.py.)"""
    with pytest.raises(ConfigError, match=r"data.mean=\[0.485, 0.456, 0.406\] has 3 value\(s\) for data.channels=1"):
        fire_module(tmp_path, channels=1)
    with pytest.raises(ConfigError, match="data.num_images=2: .*at least one image per class"):
        fire_module(tmp_path, num_images=2)
    assert not os.path.exists(tmp_path / "synthetic")


def test_decoded_images_kept_in_memory_load_the_same_samples(tmp_path):
    """data.cache=auto decodes every image once before training; a sample read from there is the
    tensor decoding the file gives, to the bit, flipped as it would be, for training and
    validation alike; none keeps nothing."""
    kept, decoded = fire_module(tmp_path), fire_module(tmp_path, cache="none")
    for dm in (kept, decoded):
        dm.prepare_data()
        dm.setup("fit")
    assert kept.cached and decoded.cached is False and decoded.train_set.cache is None
    assert kept.train_set.cache.shape == (len(kept.train_set), 3, 32, 32) and kept.train_set.cache.dtype == torch.uint8
    for key in [(i, epoch) for i in range(len(kept.train_set)) for epoch in (0, 1)]:
        got, label = kept.train_set[key]
        want, want_label = decoded.train_set[key]
        assert torch.equal(got, want) and label == want_label, key
    for i in range(len(kept.val_set)):
        assert torch.equal(kept.val_set[i][0], decoded.val_set[i][0])
    batch, _ = next(iter(kept.train_dataloader()))
    assert torch.equal(batch, next(iter(decoded.train_dataloader()))[0]), "the loader's batches too"


def test_decoded_images_stay_on_disk_where_memory_is_short(tmp_path, monkeypatch, caplog):
    """auto keeps them only in a quarter of the available RAM (and where /dev/shm has room)."""
    import logging
    from types import SimpleNamespace

    from ddlx.data import cache

    monkeypatch.setattr(cache.psutil, "virtual_memory", lambda: SimpleNamespace(available=4 * 3 * 32 * 32 * 10))
    dm = fire_module(tmp_path)
    dm.prepare_data()
    with caplog.at_level(logging.INFO, logger="ddlx.data.cache"):
        dm.setup("fit")
    assert dm.cached is False and dm.train_set.cache is None
    assert "take more than 25% of the available RAM" in caplog.text
    assert dm.train_set[0][0].shape == (3, 32, 32), "decoded from the file every time"


# A process on keep_freed frees 256 MB, starts a loader with one worker, then writes the same
# amount again, into the freed heap: the memory the two processes hold (PSS summed, MB).
WORKER_KEEPS_FREED_HEAP = textwrap.dedent("""
    import os, sys
    import torch
    from torch.utils.data import DataLoader
    from ddlx.allocator import apply_allocator
    from ddlx.data.image_data import ForkingLoader

    class Pid(torch.utils.data.Dataset):
        def __len__(self): return 4
        def __getitem__(self, i): return torch.tensor(os.getpid())

    def pss_mb(pid):
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1]) // 1024

    apply_allocator("keep_freed")
    freed = torch.ones(64 << 20); del freed  # 256 MB back to the heap, kept there
    loader = (ForkingLoader if sys.argv[1] == "forking" else DataLoader)(Pid(), num_workers=1, persistent_workers=True)
    worker = int(next(iter(loader))[0])
    reused = torch.full((64 << 20,), 2.0)
    print(pss_mb(os.getpid()) + pss_mb(worker))
""")


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux") or not keep_freed_possible(), reason="glibc's heap on Linux")
def test_loader_workers_do_not_keep_the_training_process_freed_heap():
    def held_mb(kind: str) -> int:
        proc = subprocess.run([sys.executable, "-c", WORKER_KEEPS_FREED_HEAP, kind], capture_output=True, text=True,
                              timeout=120, env=subprocess_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        return int(proc.stdout.split()[-1])

    plain, forking = held_mb("plain"), held_mb("forking")
    # Half the freed 256 MB: the PSS of the pages the two processes share swings by tens of MB from run to run.
    assert forking < plain - 128, f"parent and worker hold {forking} MB, with a plain loader {plain} MB (256 MB freed)"


def test_more_loader_workers_than_cores_are_said_once_a_job_on_rank_0(tmp_path, monkeypatch, caplog, recwarn):
    """A rank pinned to one core with two loader workers (cpu_mp's defaults on two cores): torch
    warned of it twice in every rank, of a freeze; ddlx says it once a job, with the setting that
    avoids it. A later job of a sweep in the same process is told again."""
    for name in ("DDLX_RANK_WORKER", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})

    def a_job() -> list[str]:
        caplog.clear()
        dm = fire_module(tmp_path, num_workers=2)
        dm.prepare_data()
        dm.setup("fit")
        for loader in (dm.train_dataloader(), dm.val_dataloader()):
            assert len(list(loader)) > 0
        dm.end_workers()
        return [r.getMessage() for r in caplog.records if "data.num_workers=" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="ddlx.data.image_data"):
        for _ in range(2):
            said = a_job()
            assert len(said) == 1 and "data.num_workers=2 " in said[0] and "1 core" in said[0] \
                and "data.num_workers=0" in said[0], said
        assert not [w for w in recwarn if "worker" in str(w.message)], [str(w.message) for w in recwarn]
        monkeypatch.setenv("RANK", "1")
        assert a_job() == [], "the other ranks leave it to rank 0"
        monkeypatch.delenv("RANK")
        from ddlx.predict.sequential_time import probe_batches

        caplog.clear()
        assert len(probe_batches(fire_module(tmp_path, num_workers=2).data, "resnet18")(1)) == 1
        assert not [r for r in caplog.records if "data.num_workers=" in r.getMessage()], "recommend.py's probes: train.py's line"


def test_the_loading_probe_times_the_loaders_without_importing_lightning(tmp_path):
    """recommend.py's first call on a machine times loading in its own process, which trains
    nothing: the probe's loaders are train.py's, without Lightning (3 s of that call to import)."""
    program = f"""
import sys
from ddlx.config import DataConfig
from ddlx.data.statistics import IMAGENET_MEAN, IMAGENET_STD
from ddlx.predict.sequential_time import probe_loading
data = DataConfig(name="firesmall", num_classes=3, channels=3, image_size=32, batch_size=8, num_images=40,
                  classes={FIRE!r}, num_workers=2, synthetic_dir={str(tmp_path)!r}, synthetic_size=[40, 90],
                  mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD))
per_sample = probe_loading(data)()
print(per_sample > 0, sorted(m for m in ("pytorch_lightning", "lightning_fabric", "torchmetrics") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "True []", done.stdout
