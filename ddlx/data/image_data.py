"""The train and validation sets and loaders over an ImageFolder tree, real or synthetic, without
Lightning: train.py's datamodule (:mod:`.datamodule`) adds Lightning's hooks to them, and
recommend.py's loading probe times them in a process that need not import Lightning (3 s here)."""
from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from ..allocator import release_free_heap
from ..errors import ConfigError
from ..epoch_batches import epoch_trained
from ..job import batch_split_problems, split_too_small, synthetic_count_problem, validation_images
from ..parallel.data_replicas import data_replicas
from ..preflight import data_problems
from ..process import launch_rank
from .folder import scan_imagefolder
from .synthetic import SyntheticSpec, ensure_synthetic_imagefolder, write_ahead
from .cache import keep_decoded
from .spanning import SpanningBatches, one_epoch
from .transforms import ImageTransform, build_transform, flips

log = logging.getLogger(__name__)
# Left to the training process; SIGTERM, also one of them, is ended by it (_obey_sigterm_from).
STOP_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class ImageFileDataset(Dataset):
    """(path, label) pairs loaded as ``mode`` images and transformed; errors name the file.

    Indexed by ``(index, epoch)`` (what :class:`ResumableSampler` yields) or a plain index (epoch
    0). With ``flip_seed``, a sample is flipped horizontally when :func:`flips` says so. With
    ``cache`` (:mod:`.cache`), its decoded pixels are read from there instead of the file.
    """

    def __init__(self, samples: Sequence[tuple[str, int]], transform: ImageTransform, mode: str,
                 flip_seed: int | None = None) -> None:
        self.samples = list(samples)
        self.transform = transform
        self.mode = mode
        self.flip_seed = flip_seed
        self.cache: torch.Tensor | None = None  # [images, channels, size, size] uint8, set by cache.keep_decoded

    def __len__(self) -> int:
        return len(self.samples)

    def decode(self, index: int) -> torch.Tensor:
        """Sample ``index``'s pixels, scaled to the image size (uint8 CHW)."""
        path = self.samples[index][0]
        try:
            with Image.open(path) as image:
                image = to_mode(image, self.mode)
        except (OSError, UnidentifiedImageError) as err:
            raise RuntimeError(f"cannot read image {path}: {err}") from err
        return self.transform.decode(image)

    def __getitem__(self, key: int | tuple[int, int]):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        pixels = self.cache[index] if self.cache is not None else self.decode(index)
        tensor = self.transform.to_input(pixels)
        if self.flip_seed is not None and flips(self.flip_seed, epoch, index):
            tensor = tensor.flip(-1)
        return tensor, self.samples[index][1]


class LabelsOnly(Dataset):
    """A dataset's labels, each with an empty tensor for its image: for the processes that never
    read the images (a pipeline's later stages, which need only the loss's labels)."""

    def __init__(self, dataset: ImageFileDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | tuple[int, int]):
        index = key[0] if isinstance(key, tuple) else key
        return torch.zeros(0), self.dataset.samples[index][1]


def to_mode(image: Image.Image, mode: str) -> Image.Image:
    """``image`` as ``mode`` (RGB or L) whatever it was saved as: grayscale, RGB(A), CMYK, or a
    palette, whose transparency PIL wants taken through RGBA first."""
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    return image.convert(mode)


def check_readable(samples: Sequence[tuple[str, int]]) -> None:
    """Open every image's header before training so a corrupt file is named up front."""
    for path, _ in samples:
        try:
            with Image.open(path) as image:
                image.verify()
        except (OSError, UnidentifiedImageError, SyntaxError) as err:
            raise ConfigError(f"unreadable image {path} ({err}); delete or replace it") from err


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that yields ``(index, epoch)`` (the epoch decides the sample's flip)
    and, once after :meth:`resume_at`, starts its epoch after the batches already trained."""

    def __init__(self, dataset, *, batch_size: int, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.batch_size = batch_size
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, batches_done: int) -> None:
        self._resume = (epoch, batches_done)

    def resume_pending(self) -> bool:
        return self._resume is not None

    def samples_of(self, epoch: int) -> Iterator[tuple[int, int]]:
        """Epoch ``epoch``'s samples, drawn ahead of Lightning's ``set_epoch`` for it (the epoch
        it set stays): DistributedSampler draws an epoch's whole permutation when asked."""
        current, self.epoch = self.epoch, epoch
        try:
            indices = super().__iter__()
        finally:
            self.epoch = current
        return ((index, epoch) for index in indices)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        skip = 0
        if self._resume is not None:  # before Lightning's set_epoch: loader workers read indices at once
            (self.epoch, skip), self._resume = self._resume, None
        epoch = self.epoch
        indices = itertools.islice(super().__iter__(), skip * self.batch_size, None)
        return ((index, epoch) for index in indices)


class ForkingLoader(DataLoader):
    """A loader whose workers, forked from the training process, do not inherit its free heap:
    under cpu_allocator=keep_freed that heap holds what the process freed before (cpu_mp's own
    copy of the weights, a previous epoch's activations), and a worker would keep its own copy of
    every such page the process then reuses (figures: docs/strategies.md, cpu_mp measured)."""

    def _get_iterator(self):
        if self.num_workers > 0:  # about to fork (once, with persistent workers)
            release_free_heap()
        return super()._get_iterator()

    def check_worker_number_rationality(self) -> None:
        pass  # torch's warning, twice in every rank (the loader made, then iterated): the data module says it once


class ResumableLoader(ForkingLoader):
    """The training loader, stateful in Lightning's sense: its state in a checkpoint is the epoch
    and the number of its batches trained (``position()``); restored before the loader's
    iteration starts, so a resumed epoch trains, in order, the samples the stopped one had not.
    With workers, they load the next epoch's first batches while this one ends (:mod:`.spanning`)."""

    def __init__(self, dataset, *, position: Callable[[], tuple[int, int]], **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self._position = position

    def __iter__(self):
        if isinstance(self.batch_sampler, SpanningBatches):
            return one_epoch(self, restart=super().__iter__)
        return super().__iter__()

    def state_dict(self) -> dict[str, int]:
        epoch, done = self._position()
        return {"epoch": epoch, "batches_done": done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batch_sampler.sampler.resume_at(int(state["epoch"]), int(state["batches_done"]))


def say_workers_beyond_cores(workers: int) -> None:
    """On rank 0: more loader workers than the cores this process may use (a rank pinned to its
    share of them: cpu_mp, fsdp and pipe engine=torch on CPU) share those cores with its training."""
    cores = len(os.sched_getaffinity(0))
    if workers > cores and launch_rank() == 0:
        log.info("data.num_workers=%d loader workers per training process, which may use %d core(s): they take their "
                 "time from its training there; data.num_workers=0 loads between steps in the training process, "
                 "which can be faster when data.cache holds the decoded images (docs/strategies.md, loader workers)",
                 workers, cores)


def _quiet_worker(worker_id: int) -> None:
    """A loader worker leaves stop signals to the training process (which stops after the step
    and shuts its workers down); otherwise a Ctrl-C, ``timeout`` or SLURM's signal to the whole
    process group kills the worker, and the step fails instead of stopping. A SIGTERM from the
    training process itself (multiprocessing ends leftover workers so at exit, then waits for
    them) still ends it, and so does the training process's death (kill -9, the OOM killer).
    Seeded as Lightning seeds them, named for ps and top."""
    from lightning_fabric.utilities.seed import pl_worker_init_function

    from ..process import end_with_parent, name_process

    pl_worker_init_function(worker_id)
    name_process("ddlx-loader")  # in ps and top (a forked process keeps its parent's command line)
    if not end_with_parent():
        os._exit(1)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _obey_sigterm_from(os.getppid())


def _obey_sigterm_from(parent: int) -> None:
    """SIGTERM ends this process when ``parent`` sent it, and is ignored from anyone else: the
    signal is blocked and taken by a thread that reads its sender (a handler cannot see it)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # before any other thread: they inherit it

    def wait() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=wait, name="ddlx-sigterm", daemon=True).start()


class ImageFolderData:
    """Train/validation loaders over an ImageFolder tree.

    ``root=None`` trains on a synthetic stand-in with the dataset's image count, classes, format
    and size range, written once under ``synthetic_dir`` and reused.
    """

    trainer = None  # the Lightning Trainer training from it (set by Lightning on the datamodule)

    def __init__(self, data, batch_size: int, per_worker: bool = False) -> None:
        """``data``: the typed data config (:class:`ddlx.config.DataConfig`: the keys, their types,
        ranges and defaults); ``batch_size``: this process's share of ``data.batch_size``;
        ``per_worker``: the user stated it (``data.batch_per=worker``), and is told of it so."""
        super().__init__()
        problems = data_problems(data)  # (train.py's and recommend.py's checks said them already)
        if data.root is None and (problem := synthetic_count_problem(data.num_images, data.num_classes)):
            problems.append(problem)
        if problems:
            raise ConfigError("; ".join(problems))
        self.data = data
        self.batch_size = batch_size
        self.per_worker = per_worker
        self.root = Path(data.root) if data.root is not None else None
        self.class_names = tuple(data.classes) if data.classes is not None else tuple(f"class_{i:04d}" for i in range(data.num_classes))
        self.mean, self.std = tuple(data.mean), tuple(data.std)
        self.synthetic_dir = Path(data.synthetic_dir)
        self.synthetic_spec = SyntheticSpec(
            classes=self.class_names,
            num_images=int(data.num_images or 0),
            channels=data.channels,
            min_size=int(data.synthetic_size[0]),
            max_size=int(data.synthetic_size[1]),
            image_format=data.synthetic_format,
            seed=data.seed,
        )
        self.cached: bool | None = None  # whether the images are decoded in memory (None: not decided yet)
        self.train_set: ImageFileDataset | None = None
        self.val_set: ImageFileDataset | None = None
        self._loaders: list[DataLoader] = []  # made for the trainer: their workers end with the run (end_workers)
        self.workers_to_say = True  # say_workers_beyond_cores, once a job (a probe's loaders: not at all)

    @classmethod
    def of_process(cls, data, data_parallel: int = 1, per_worker: bool = False):
        """One process's share from the typed ``data`` config: ``data.batch_size`` is the global
        batch, split evenly over ``data_parallel`` processes; ``per_worker``: the user stated the
        share (``data.batch_per=worker``, made global by ``ddlx.run.batch_of_workers``)."""
        problems = batch_split_problems(data.batch_size, data_parallel)  # mpi's ranks: known only now
        if problems:
            raise ConfigError(problems[0])
        return cls(data, data.batch_size // data_parallel, per_worker)

    @property
    def data_folder(self) -> Path:
        if self.root is not None:
            return self.root
        return self.synthetic_dir / self.synthetic_spec.folder_name(self.data.name)

    @property
    def is_synthetic(self) -> bool:
        return self.root is None

    def prepare_data(self) -> None:
        if self.is_synthetic:
            ensure_synthetic_imagefolder(self.data_folder, self.synthetic_spec)

    def prepare_data_ahead(self):
        """:meth:`prepare_data` started in a forked child (:func:`~.synthetic.write_ahead`): the
        child to join before this process's own call; None where there is nothing to write."""
        return write_ahead(self.data_folder, self.synthetic_spec) if self.is_synthetic else None

    def setup(self, stage: str | None = None) -> None:
        """The splits (:meth:`build_sets`) and, once every process of the job calls it (Lightning
        does, with the process group up), the decoded images kept in memory (``data.cache``)."""
        self.build_sets()
        if self.cached is None:
            self.cached = keep_decoded([self.train_set, self.val_set], self.data.cache, self.data.channels, self.data.image_size)

    def build_sets(self) -> None:
        """The train and validation splits of the folder, every error in it named: what can be
        checked before any process starts (train.py does, then Lightning calls :meth:`setup`)."""
        if self.train_set is not None:
            return
        classes, samples = scan_imagefolder(self.data_folder)
        if len(classes) != self.data.num_classes:
            fix = (f"set data.num_classes={len(classes)}" if self.is_synthetic
                   else f"for your own folder use data=imagefolder data.root={self.data_folder}")
            raise ConfigError(f"{self.data_folder} has {len(classes)} class folders ({', '.join(classes[:10])}"
                              f"{'...' if len(classes) > 10 else ''}) but data.num_classes={self.data.num_classes}; {fix}")
        generator = torch.Generator().manual_seed(self.data.seed)
        order = torch.randperm(len(samples), generator=generator).tolist()
        if self.data.num_images and self.data.num_images < len(samples):
            order = order[: self.data.num_images]
            log.info("%s: training on %d of the %d images in %s (data.num_images=%d; data.num_images=null uses all)",
                     self.data.name, self.data.num_images, len(samples), self.data_folder, self.data.num_images)
        elif self.data.num_images and self.data.num_images > len(samples):
            log.warning("data.num_images=%d but %s holds %d images: using all of them", self.data.num_images, self.data_folder, len(samples))
        chosen = [samples[i] for i in order]
        if not self.is_synthetic:
            check_readable(chosen)
        n_val = validation_images(len(chosen), self.data.val_fraction)
        train, val = chosen[n_val:], chosen[:n_val]
        folder_holds = None if self.is_synthetic else len(samples)
        data_parallel = self.data.batch_size // self.batch_size  # of_process: this process's share
        stated = self.batch_size if self.per_worker else self.data.batch_size
        if problem := split_too_small(len(chosen), self.data.val_fraction, stated, folder_holds, data_parallel, self.per_worker):
            raise ConfigError(problem)
        mode = "L" if self.data.channels == 1 else "RGB"
        transform = build_transform(self.data.image_size, self.mean, self.std)
        self.train_set = ImageFileDataset(train, transform, mode, flip_seed=self.data.seed if self.data.random_flip else None)
        self.val_set = ImageFileDataset(val, transform, mode)
        log.info(
            "%s: %d train / %d val images, %d classes, from %s%s",
            self.data.name, len(train), len(val), len(classes), self.data_folder, " (synthetic)" if self.is_synthetic else "",
        )

    def _loader(self, dataset: ImageFileDataset, shuffle: bool, resumable: bool = False) -> DataLoader:
        """One seeded DistributedSampler for every strategy (one replica when not distributed).

        Rank r of P takes every P-th sample of the epoch's permutation, so the union of the
        ranks' k-th batches is the sequential run's k-th global batch: all strategies see the
        same global batches, shuffled or not. (Lightning's own sampler injection always shuffles
        training data and is switched off with ``use_distributed_sampler=False``.)
        """
        replicas, rank = data_replicas(getattr(self.trainer, "strategy", None))  # a pipeline's stages: one replica
        images = getattr(getattr(self.trainer, "strategy", None), "needs_inputs", True)
        workers = self.data.num_workers if images else 0  # labels alone: nothing to decode
        if workers and self.workers_to_say:  # once a job (its process's cores are set by then: pinned or not)
            self.workers_to_say = False
            say_workers_beyond_cores(workers)
        if not images:
            dataset = LabelsOnly(dataset)
        # Lightning's overfit_batches trains the same first batches every epoch: in order, and
        # without reading ahead (each epoch stops after them).
        overfit = getattr(self.trainer, "overfit_batches", 0)
        sampler = ResumableSampler(
            dataset,
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle and not overfit,
            seed=self.data.seed,
            batch_size=self.batch_size,
        )
        # The sampler inside a batch sampler, where Lightning's overfit_batches does not swap it for
        # a SequentialSampler (which could not resume, and would give every rank the same samples):
        # the DataLoader's own ``sampler`` is then a sequential stand-in, taken as not shuffling.
        read_ahead = resumable and workers > 0 and not overfit  # (persistent workers, below)
        batches = SpanningBatches(sampler, self.batch_size) if read_ahead else \
            BatchSampler(sampler, self.batch_size, drop_last=False)
        kwargs = dict(
            batch_sampler=batches,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=self.data.pin_memory,
            worker_init_fn=_quiet_worker if workers > 0 else None,
            # Its workers' seeds from its own generator: loading draws nothing from the training
            # process's random state (dropout's), which a checkpoint keeps and a resume restores.
            generator=torch.Generator().manual_seed(self.data.seed),
        )
        loader = ResumableLoader(dataset, position=self._training_position, **kwargs) if resumable \
            else ForkingLoader(dataset, **kwargs)
        self._loaders.append(loader)
        return loader

    def end_workers(self, of: type = DataLoader) -> None:
        """End the workers of every loader made (of type ``of``), and wait for them: Lightning does
        at the end of training, but not when training is stopped during validation (its teardown
        then takes another loop for the active one), and at exit multiprocessing would wait for them."""
        ending = [made for made in self._loaders if isinstance(made, of)]
        if not ending:  # (Lightning's import is left to the processes that made loaders)
            return
        from pytorch_lightning.utilities.combined_loader import _shutdown_workers_and_reset_iterator

        for loader in ending:
            _shutdown_workers_and_reset_iterator(loader)
            self._loaders.remove(loader)

    def _training_position(self) -> tuple[int, int]:
        """(epoch, its batches trained) when a checkpoint is written; after an epoch's last batch,
        the next epoch from its start."""
        trainer = self.trainer
        if epoch_trained(trainer):
            return trainer.current_epoch + 1, 0
        return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def train_dataloader(self) -> DataLoader:
        # A training loader asked for again (trainer.reload_dataloaders_every_n_epochs) replaces the
        # last: end its workers, which hold the batches they read ahead.
        self.end_workers(of=ResumableLoader)
        return self._loader(self.train_set, shuffle=self.data.shuffle, resumable=True)

    def val_dataloader(self) -> DataLoader | list:
        # data.val_fraction=0: no validation loop (Lightning skips an empty list), an epoch is all the images
        return self._loader(self.val_set, shuffle=False) if len(self.val_set) else []

