"""The normalization statistics a folder's images get when the config gives none: ImageNet's,
and their mean over its three channels for grayscale images. Nothing here imports torch: the
checks before a job (``ddlx.preflight``) offer them as a fix."""
from __future__ import annotations

# Lerat et al. 2022, section 3.2.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GRAY_MEAN, GRAY_STD = (0.449,), (0.226,)


def standard_statistics(channels: int) -> tuple[list[float], list[float]]:
    """The mean and std for images of ``channels`` channels (1: grayscale, else RGB)."""
    return (list(GRAY_MEAN), list(GRAY_STD)) if channels == 1 else (list(IMAGENET_MEAN), list(IMAGENET_STD))
