"""The preprocessing of Lerat et al. 2022, section 3.2."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image

# torchvision is imported where it is used: its import takes seconds.
MASK64 = 2**64 - 1


class ImageTransform:
    """Crop/scale to ``image_size`` (:meth:`decode`: an image to its pixels, uint8 CHW, what
    :mod:`.cache` keeps), then to float in [0, 1] and normalize (:meth:`to_input`), as
    ``Resize, CenterCrop, ToTensor, Normalize`` do. The training flip: :func:`flips`."""

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float]) -> None:
        self.image_size = image_size
        self.mean, self.std = list(mean), list(std)
        from torchvision import transforms as T
        from torchvision.transforms import functional as TF

        self._scale = T.Compose([T.Resize(image_size), T.CenterCrop(image_size), T.PILToTensor()])
        self._normalize = TF.normalize

    def decode(self, image: Image.Image) -> torch.Tensor:
        return self._scale(image).contiguous()

    def to_input(self, pixels: torch.Tensor) -> torch.Tensor:
        return self._normalize(pixels.float().div(255), self.mean, self.std)  # ToTensor's division, then Normalize's

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.to_input(self.decode(image))


def build_transform(image_size: int, mean: Sequence[float], std: Sequence[float]) -> ImageTransform:
    return ImageTransform(image_size, mean, std)


def flips(seed: int, epoch: int, index: int) -> bool:
    """The random horizontal flip of sample ``index`` in ``epoch`` (half of them): a function of
    the three, not of a random number generator's state, so the same samples flip whichever
    process, loader worker or strategy loads them, and a resumed run flips what it would have
    (splitmix64 of the three)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return bool((z ^ (z >> 31)) & 1)
