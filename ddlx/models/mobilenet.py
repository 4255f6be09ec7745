"""MobileNetV2: torchvision's for ImageNet-sized inputs, Jansen's thesis Tables A.4/A.7 for small images."""
from __future__ import annotations

from torch import nn

from .layered import LayeredModel

# (t, c, n, s) per bottleneck sequence; torchvision's defaults are the ImageNet table (A.10).
IMAGENET_SETTING = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]
# Tables A.4/A.7: stem stride 1 and the second sequence at stride 1 for 28x28/32x32 inputs.
SMALL_SETTING = [[1, 16, 1, 1], [6, 24, 2, 1], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]


def build_mobilenet_v2(num_classes: int, in_channels: int, small_input: bool, dropout: float = 0.2) -> LayeredModel:
    from torchvision import models as tvm  # here: torchvision takes seconds to import, the recommender rarely builds
    from torchvision.ops.misc import Conv2dNormActivation

    setting = SMALL_SETTING if small_input else IMAGENET_SETTING
    net = tvm.mobilenet_v2(weights=None, num_classes=num_classes, inverted_residual_setting=setting, dropout=dropout)
    if small_input or in_channels != 3:
        stride = 1 if small_input else 2
        net.features[0] = Conv2dNormActivation(in_channels, 32, stride=stride, activation_layer=nn.ReLU6)
    layers: list[nn.Module] = [net.features[0]]
    cuts: dict[str, int] = {}
    block_index = 1
    for seq, (_, _, n, _) in enumerate(setting, start=1):
        layers.extend(net.features[block_index : block_index + n])
        block_index += n
        cuts[f"after_bottleneck{seq}"] = len(layers)
    layers.append(net.features[block_index])  # final 1x1 conv to 1280 channels
    layers += [nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), *net.classifier.children()]
    # After the 4th bottleneck sequence (64 channels) the forward FLOPs are roughly halved.
    return LayeredModel(layers, cuts, split_point="after_bottleneck4", arch="mobilenet_v2", small_input=small_input)
