"""AlexNet: torchvision's for ImageNet-sized inputs, a CIFAR-style variant for small images."""
from __future__ import annotations

from torch import nn

from .layered import LayeredModel, conv_cut_points, flatten_children


def build_alexnet(num_classes: int, in_channels: int, small_input: bool, dropout: float = 0.5) -> LayeredModel:
    from torchvision import models as tvm  # here: torchvision takes seconds to import, the recommender rarely builds

    if small_input:
        # Small images cannot survive the 11x11/stride-4 stem; keep AlexNet's five convolutions
        # and three-layer classifier with 3x3 kernels (the usual CIFAR-10 adaptation).
        features = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, ceil_mode=True),
            nn.Conv2d(64, 192, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, ceil_mode=True),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, ceil_mode=True),
        )
        pool = nn.AdaptiveAvgPool2d((2, 2))
        classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 2 * 2, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )
    else:
        net = tvm.alexnet(weights=None, num_classes=num_classes, dropout=dropout)
        if in_channels != 3:
            old = net.features[0]
            net.features[0] = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, old.stride, old.padding)
        features, pool, classifier = net.features, net.avgpool, net.classifier
    feature_layers = flatten_children(features)
    layers = [*feature_layers, pool, nn.Flatten(1), *flatten_children(classifier)]
    cuts = conv_cut_points(feature_layers)
    # The Lerat et al. entry, section 2.4: AlexNet is split after its 4th convolution.
    return LayeredModel(layers, cuts, split_point="after_conv4", arch="alexnet", small_input=small_input)
