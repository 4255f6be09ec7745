"""The preprocessing of source 000, section 3.2."""
from __future__ import annotations

from collections.abc import Sequence

from torchvision import transforms as T

# Source 000, section 3.2 (the ImageNet statistics).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def build_transform(image_size: int, mean: Sequence[float], std: Sequence[float], train: bool, random_flip: bool = True) -> T.Compose:
    """Crop/scale to ``image_size``, random horizontal flip (training only), to tensor, normalize.

    ``ToTensor`` runs before ``Normalize`` because torchvision normalizes tensors, not images.
    """
    steps: list = [T.Resize(image_size), T.CenterCrop(image_size)]
    if train and random_flip:
        steps.append(T.RandomHorizontalFlip())
    steps += [T.ToTensor(), T.Normalize(mean=list(mean), std=list(std))]
    return T.Compose(steps)
