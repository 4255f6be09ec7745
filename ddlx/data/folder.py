"""A user's ImageFolder, read before anything is built: ``data=imagefolder`` takes its classes,
their count, the number of images, the channels and its name from the folder; a named dataset
(``firesmall``, ``mnist``, ...) given a ``data.root`` is checked against what the folder holds."""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ..errors import ConfigError, missing_data_root, unset_data_root
from .statistics import standard_statistics

log = logging.getLogger(__name__)

# Modes PIL opens single-channel images in (grayscale, 1-bit, 16/32-bit integer or float pixels).
GRAYSCALE_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"})
# Images whose mode decides the channels: a seeded sample, so a large folder is not opened twice.
CHANNEL_SAMPLE = 256


@dataclass(frozen=True)
class FolderContents:
    root: Path
    classes: tuple[str, ...]
    samples: tuple[tuple[str, int], ...]  # (path, class index), sorted by class then file name
    channels: int  # 1 when every sampled image is single-channel, else 3 (colour, alpha or palette)


def scan_imagefolder(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Classes (sorted sub-folder names) and (path, class index) samples; clear errors for bad layouts."""
    if not root.is_dir():
        raise ConfigError(missing_data_root(root))
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(classes) < 2:
        found = f"one class sub-folder ({classes[0]})" if classes else "no class sub-folders"
        raise ConfigError(f"data.root={root} has {found}; a classifier needs an ImageFolder with one sub-folder "
                          f"per class and at least two classes: add the other classes' folders")
    samples: list[tuple[str, int]] = []
    from torchvision.datasets.folder import IMG_EXTENSIONS  # here: torchvision takes seconds to import

    for index, name in enumerate(classes):
        # Sub-folders too, in torchvision ImageFolder's order (folders walked sorted, files sorted in each).
        files = [os.path.join(folder, file) for folder, _, names in sorted(os.walk(root / name, followlinks=True))
                 for file in sorted(names) if os.path.splitext(file)[1].lower() in IMG_EXTENSIONS]
        if not files:
            raise ConfigError(
                f"class folder {root / name} has no images (expected files ending in "
                f"{', '.join(IMG_EXTENSIONS)}); remove the folder or add its images"
            )
        samples += [(f, index) for f in files]
    return classes, samples


def read_folder(root: str | Path) -> FolderContents:
    if not str(root).strip():  # Path("") would be the current folder
        raise ConfigError(missing_data_root(root))
    root = Path(root).expanduser()
    classes, samples = scan_imagefolder(root)
    sample = random.Random(0).sample(samples, min(CHANNEL_SAMPLE, len(samples)))
    return FolderContents(root, tuple(classes), tuple(samples), 1 if all(_mode(p) in GRAYSCALE_MODES for p, _ in sample) else 3)


def _mode(path: str) -> str:
    try:
        with Image.open(path) as image:
            return image.mode
    except (OSError, UnidentifiedImageError) as err:
        raise ConfigError(f"unreadable image {path} ({err}); delete or replace it") from err


def complete_data_config(data) -> FolderContents | None:
    """Fill the ``data`` keys left null (``data=imagefolder``) from the folder at ``data.root``, or,
    for a named dataset given a folder, check that the folder holds that dataset's classes.
    ``data`` is the composed (typed) ``data`` config; it is changed in place. Returns what the
    folder holds (None without ``data.root``)."""
    if data.root is None:
        if problem := unset_data_root(data):
            raise ConfigError(problem)
        return None
    folder = read_folder(data.root)
    if data.name is not None:
        _check_named_dataset(data, folder)
    data.name = data.name or _name_of(folder.root)
    given = {key: getattr(data, key) for key in ("classes", "num_classes", "channels") if getattr(data, key) is not None}
    if data.classes is None:
        data.classes = list(folder.classes)
    if data.num_classes is None:
        data.num_classes = len(folder.classes)
    if data.channels is None:
        data.channels = folder.channels
    if data.mean is None or data.std is None:
        data.mean, data.std = standard_statistics(data.channels)
    if given.get("num_classes", len(folder.classes)) != len(folder.classes):
        raise ConfigError(f"data.num_classes={given['num_classes']} but {folder.root} holds {len(folder.classes)} class "
                          f"folders: leave data.num_classes out (data=imagefolder reads it)")
    log.info("data=%s: %d classes (%s), %d images, %d channel(s)%s, read from %s", data.name, len(folder.classes),
             _listing(folder.classes), len(folder.samples), data.channels,
             "" if "channels" in given else (" (every sampled image single-channel)" if folder.channels == 1
                                             else " (colour images among them; grayscale ones are converted)"),
             folder.root)
    return folder


def _check_named_dataset(data, folder: FolderContents) -> None:
    """A named dataset's config pointed at a folder: its classes must be the folder's."""
    expected = list(data.classes) if data.classes is not None else None
    if expected is not None and sorted(expected) == list(folder.classes):
        return
    if expected is None and data.num_classes == len(folder.classes):
        return
    described = f"[{_listing(expected)}]" if expected is not None else f"{data.num_classes} classes"
    raise ConfigError(
        f"data.root={folder.root} holds {len(folder.classes)} classes ({_listing(folder.classes)}), but "
        f"data={data.name} expects {described}: for your own folder use data=imagefolder data.root={folder.root} "
        f"(its classes, their count, the image count and channels are read from it)"
    )


def _name_of(root: Path) -> str:
    return root.resolve().name or "imagefolder"


def _listing(names, shown: int = 10) -> str:
    names = list(names)
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")
