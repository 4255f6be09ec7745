"""Datamodules, synthetic dataset writers and the paper's transforms."""
from .datamodule import ImageFolderDataModule
from .synthetic import SyntheticSpec, ensure_synthetic_imagefolder
from .transforms import IMAGENET_MEAN, IMAGENET_STD, build_transform, flips

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "ImageFolderDataModule", "SyntheticSpec", "build_transform", "ensure_synthetic_imagefolder", "flips"]
