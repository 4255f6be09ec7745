"""Synthetic stand-ins for datasets that cannot be downloaded here.

Written once, on first use, as an ImageFolder tree (one sub-folder per class) on local disk, the
way the thesis wrote synthetic copies of its datasets to each node (Jansen's thesis, section 3.4).
Each class has its own colour, stripe orientation and stripe frequency, with per-image jitter,
noise and distractor blobs, so that a model can learn the classes but must look at the image.
"""
from __future__ import annotations

import colorsys
import fcntl
import json
import logging
import math
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

MARKER = ".ddlx_synthetic.json"
# Bytes per pixel after compression, for the disk-space check before writing.
_BYTES_PER_PIXEL = {"jpg": 0.35, "png": 1.2}


@dataclass(frozen=True)
class SyntheticSpec:
    classes: tuple[str, ...]
    num_images: int
    channels: int
    min_size: int  # shortest side of the written images, pixels
    max_size: int  # longest side
    image_format: str = "jpg"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.image_format not in _BYTES_PER_PIXEL:
            raise ValueError(f"image_format={self.image_format!r}; expected one of {sorted(_BYTES_PER_PIXEL)}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels={self.channels}; expected 1 (grayscale) or 3 (RGB)")
        if not 0 < self.min_size <= self.max_size:
            raise ValueError(f"need 0 < min_size <= max_size, got {self.min_size}, {self.max_size}")

    def folder_name(self, name: str) -> str:
        return f"{name}-n{self.num_images}-s{self.min_size}-{self.max_size}-seed{self.seed}"

    def estimated_bytes(self) -> int:
        mean_side = (self.min_size + self.max_size) / 2
        return int(self.num_images * mean_side**2 * self.channels / 3 * _BYTES_PER_PIXEL[self.image_format]) + 4096 * self.num_images


def class_signature(index: int) -> tuple[float, float, float]:
    """(hue, stripe angle in [0, pi/2], stripe cycles per image) of a class.

    Angles stay within [0, pi/2] so a horizontal flip (angle -> pi - angle) never turns one
    class's stripes into another's.
    """
    hue = (index * 0.618033988749895) % 1.0
    angle = (math.pi / 2) * ((index * 3) % 5) / 4
    cycles = 2.0 + (index % 7)
    return hue, angle, cycles


def render_image(class_index: int, width: int, height: int, channels: int, rng: np.random.Generator) -> Image.Image:
    hue, angle, cycles = class_signature(class_index)
    angle += rng.normal(0, 0.05)
    hue = (hue + rng.normal(0, 0.02)) % 1.0
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    side = max(width, height)
    phase = rng.uniform(0, 2 * math.pi)
    stripes = np.sin(2 * math.pi * cycles * (xs * math.cos(angle) + ys * math.sin(angle)) / side + phase)
    shade = 0.55 + 0.35 * stripes
    # Distractor blobs of random colour: the model cannot rely on every pixel.
    for _ in range(rng.integers(1, 4)):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        radius = rng.uniform(0.05, 0.2) * side
        blob = np.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (2 * radius**2))
        shade = shade * (1 - 0.5 * blob) + 0.5 * blob * rng.uniform(0, 1)
    noise = rng.normal(0, 0.06, size=(height, width)).astype(np.float32)
    if channels == 1:
        pixels = np.clip(shade + noise, 0, 1)[..., None]
    else:
        rgb = np.array(colorsys.hsv_to_rgb(hue, 0.75, 0.95), dtype=np.float32)
        pixels = np.clip(shade[..., None] * rgb[None, None, :] + noise[..., None], 0, 1)
    array = (pixels * 255).astype(np.uint8)
    return Image.fromarray(array[..., 0] if channels == 1 else array, mode="L" if channels == 1 else "RGB")


def _write_chunk(args: tuple[Path, SyntheticSpec, int, int]) -> None:
    folder, spec, start, stop = args
    suffix = "jpg" if spec.image_format == "jpg" else "png"
    for i in range(start, stop):
        rng = np.random.default_rng([spec.seed, i])
        class_index = i % len(spec.classes)
        width, height = (int(v) for v in rng.integers(spec.min_size, spec.max_size + 1, size=2))
        image = render_image(class_index, width, height, spec.channels, rng)
        path = folder / spec.classes[class_index] / f"{spec.classes[class_index]}_{i:07d}.{suffix}"
        if suffix == "jpg":
            image.save(path, quality=90)
        else:
            image.save(path)


def _writer_start(lock_fd: int) -> None:
    """A writing process, forked while its parent holds the dataset's lock: it closes its copy and
    ends with its parent, so that writers of a parent killed mid-write (the out-of-memory killer)
    neither keep every later writer waiting on the lock nor live on, idle."""
    from ..process import end_with_parent

    os.close(lock_fd)
    end_with_parent()


def _is_complete(folder: Path, spec: SyntheticSpec) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == json.loads(json.dumps(asdict(spec)))
    except (OSError, ValueError):
        return False


def ensure_synthetic_imagefolder(folder: Path, spec: SyntheticSpec, workers: int | None = None) -> Path:
    """Write the synthetic dataset to ``folder`` unless a complete copy is already there.

    Safe against concurrent callers (DDP ranks, parallel sweep jobs): a file lock serialises
    writers, and the tree is written to a temporary folder and renamed into place, so an
    interrupted write never leaves a half dataset that looks complete.
    """
    folder = Path(folder)
    if _is_complete(folder, spec):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(folder, spec):
            return folder
        free = shutil.disk_usage(folder.parent).free
        need = spec.estimated_bytes()
        if need > 0.9 * free:
            from ..errors import ConfigError

            raise ConfigError(
                f"writing {spec.num_images} synthetic images to {folder} needs about {need / 2**30:.1f} GiB, "
                f"but only {free / 2**30:.1f} GiB is free there; lower data.num_images or point "
                f"data.synthetic_dir at a larger disk"
            )
        staging = folder.with_name(folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        for name in spec.classes:
            (staging / name).mkdir(parents=True)
        workers = workers or min(os.cpu_count() or 1, 8)
        chunk = max(1, math.ceil(spec.num_images / (workers * 4)))
        jobs = [(staging, spec, s, min(s + chunk, spec.num_images)) for s in range(0, spec.num_images, chunk)]
        log.info("writing %d synthetic images (%d classes) to %s", spec.num_images, len(spec.classes), folder)
        if workers > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(workers, initializer=_writer_start, initargs=(lock.fileno(),)) as pool:
                list(pool.map(_write_chunk, jobs))
        else:
            for job in jobs:
                _write_chunk(job)
        (staging / MARKER).write_text(json.dumps(asdict(spec)))
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    return folder


def write_ahead(folder: Path, spec: SyntheticSpec):
    """Start :func:`ensure_synthetic_imagefolder` in a forked child, for a caller with other work
    to do meanwhile (a probe importing the training stack): the child to join
    (:func:`~ddlx.process.wait_for`) before the caller's own call, which then finds the images
    written. None where they are already there or there is no fork. The child only writes:
    whatever stops it, the caller's own call writes the rest and says what is wrong."""
    from ..process import forked

    if _is_complete(Path(folder), spec):
        return None
    return forked(_write_in_child, (folder, spec), "ddlx-write-ahead", daemon=False)  # its writers are its children


def _write_in_child(folder: Path, spec: SyntheticSpec) -> None:
    try:
        ensure_synthetic_imagefolder(folder, spec)
    except BaseException:  # noqa: BLE001 - Ctrl-C, a full disk: the caller writes again and says so
        os._exit(1)
    os._exit(0)
