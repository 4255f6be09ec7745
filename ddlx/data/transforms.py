"""The preprocessing of source 000, section 3.2."""
from __future__ import annotations

from collections.abc import Sequence

from torchvision import transforms as T

# Source 000, section 3.2 (the ImageNet statistics).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MASK64 = 2**64 - 1


def build_transform(image_size: int, mean: Sequence[float], std: Sequence[float]) -> T.Compose:
    """Crop/scale to ``image_size``, to tensor, normalize (the training flip: :func:`flips`).

    ``ToTensor`` runs before ``Normalize`` because torchvision normalizes tensors, not images.
    """
    return T.Compose([T.Resize(image_size), T.CenterCrop(image_size), T.ToTensor(), T.Normalize(mean=list(mean), std=list(std))])


def flips(seed: int, epoch: int, index: int) -> bool:
    """The random horizontal flip of sample ``index`` in ``epoch`` (half of them): a function of
    the three, not of a random number generator's state, so the same samples flip whichever
    process, loader worker or strategy loads them, and a resumed run flips what it would have
    (splitmix64 of the three)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return bool((z ^ (z >> 31)) & 1)
