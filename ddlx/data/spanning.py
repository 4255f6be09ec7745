"""The training loader's batches without a stall at each epoch's start (``data.num_workers > 0``).

A DataLoader's workers, persistent or not, begin an epoch's batches only when the loop asks for
the epoch: the first batch then waits for one worker to load all of it, and the next for the
rest to catch up. On one H200, ResNet-50 in bf16-mixed at 224 px with 15 workers waited 0.6-1.0 s
at the start of each 50-step epoch, 10-17% of it (docs/gpu.md, section 4). Here the index
sampler never ends: it hands the workers the next epoch's batches as soon as this epoch's last
ones are handed out, so they are loaded while this epoch trains and validates, as timm's
``MultiEpochsDataLoader`` does. The loader still yields one epoch per ``iter()``, the same
batches in the same order: an epoch's permutation and flips follow from the seed and the epoch
number alone (:class:`.image_data.ResumableSampler`), whenever they are drawn.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from torch.utils.data import BatchSampler, Sampler


class SpanningBatches(Sampler[list]):
    """Batches of ``sampler``'s epochs, one epoch after another without end; ``len`` is one epoch's.

    ``handed`` holds (epoch, batch number) for each batch given to the workers and not yet taken
    from the loader, oldest first: the loader reads from it which epoch the next batch belongs to.
    The first epoch is the one ``sampler`` is at when iteration starts (Lightning's
    ``set_epoch``, or a checkpoint's resume); the next ones are drawn with
    ``sampler.samples_of(epoch)``, which leaves the sampler's own epoch where Lightning set it.
    """

    def __init__(self, sampler, batch_size: int) -> None:
        self.sampler = sampler  # where Lightning's set_epoch and the loader's resume find it
        self.batch_size = batch_size
        self.handed: deque[tuple[int, int]] = deque()

    def __len__(self) -> int:
        return len(BatchSampler(self.sampler, self.batch_size, drop_last=False))

    def __iter__(self) -> Iterator[list]:
        # A generator: the sampler is read at the first next(), not at iter(). A DataLoader
        # iterator calls iter() twice when it starts, and a resume must be taken once.
        handed = self.handed = deque()
        if not len(self.sampler):
            return
        samples = iter(self.sampler)  # from the epoch set, or where a resume starts
        epoch = self.sampler.epoch
        while True:
            for number, batch in enumerate(BatchSampler(samples, self.batch_size, drop_last=False)):
                handed.append((epoch, number))
                yield batch
            epoch += 1
            samples = self.sampler.samples_of(epoch)


def one_epoch(loader, restart: Callable[[], Iterator]) -> Iterator:
    """The batches of the epoch the loader's sampler is at, from the workers' endless iteration.

    That iteration goes on only when its next batch is this epoch's first: the previous epoch was
    taken to its end and nothing of this one yet. Otherwise (the first epoch, a resume, an epoch
    Lightning cut short with ``limit_train_batches``, the same epoch asked for again, an error in
    a worker) ``restart()`` begins a new one at the sampler's epoch, as a plain DataLoader does at
    every ``iter()``: those epochs start with the wait as before.
    Looked at lazily, at the loop's first ``next()``: Lightning's first ``iter()`` of a fit comes
    before it sets the epoch (and restores a checkpoint's position).
    """
    batches: SpanningBatches = loader.batch_sampler
    samples = batches.sampler
    going_on = (loader._iterator is not None and not samples.resume_pending()
                and batches.handed and batches.handed[0] == (samples.epoch, 0))
    iterator = loader._iterator if going_on else restart()
    handed = batches.handed  # a restart made a new one
    if not handed:
        return
    epoch = handed[0][0]
    while handed and handed[0][0] == epoch:
        try:
            batch = next(iterator)
        except StopIteration:  # workers shut down under it: the epoch ends, as a plain loader's would
            handed.clear()
            return
        except BaseException:  # a worker's error: the batch is gone but counted; the next iter() restarts
            handed.clear()
            raise
        handed.popleft()
        yield batch
