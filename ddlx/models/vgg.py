"""VGG-11/16: torchvision's for ImageNet-sized inputs, Jansen's thesis Tables A.3/A.6 for small images."""
from __future__ import annotations

from torch import nn

from .layered import LayeredModel, conv_cut_points, flatten_children

# torchvision's configurations ("M" = 2x2 max pool)
CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}
# The Lerat et al. entry, section 2.4: VGG16 is split after its 8th convolution; VGG11 at the same
# place in its structure (end of the 4th block's first half: after its 6th convolution).
SPLIT_POINTS = {"vgg11": "after_conv6", "vgg16": "after_conv8"}


def _small_features(config: list, in_channels: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    channels = in_channels
    for item in config:
        if item == "M":
            # ceil_mode keeps 28x28 (MNIST) inputs at >= 1x1 through all five pools.
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=True))
        else:
            layers += [nn.Conv2d(channels, item, kernel_size=3, padding=1), nn.BatchNorm2d(item), nn.ReLU(inplace=True)]
            channels = item
    return nn.Sequential(*layers)


def build_vgg(arch: str, num_classes: int, in_channels: int, small_input: bool, dropout: float = 0.5) -> LayeredModel:
    from torchvision import models as tvm  # here: torchvision takes seconds to import, the recommender rarely builds

    if arch not in CONFIGS:
        raise ValueError(f"unknown VGG variant {arch!r}; expected one of {sorted(CONFIGS)}")
    if small_input:
        # Tables A.3/A.6: the conv stacks, then average pool and a single fc layer.
        features = _small_features(CONFIGS[arch], in_channels)
        head = [nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), nn.Linear(512, num_classes)]
    else:
        net = getattr(tvm, arch)(weights=None, num_classes=num_classes, dropout=dropout)
        if in_channels != 3:
            old = net.features[0]
            net.features[0] = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, old.stride, old.padding)
        features = net.features
        head = [net.avgpool, nn.Flatten(1), *flatten_children(net.classifier)]
    feature_layers = flatten_children(features)
    cuts = conv_cut_points(feature_layers)
    return LayeredModel([*feature_layers, *head], cuts, SPLIT_POINTS[arch], arch=arch, small_input=small_input)
