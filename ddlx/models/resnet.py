"""ResNet-18/50/152: torchvision's for ImageNet-sized inputs, Jansen's thesis Tables A.2/A.5 for small images."""
from __future__ import annotations

from torch import nn

from .layered import LayeredModel

ARCHS = ("resnet18", "resnet50", "resnet152")
STAGES = ("layer1", "layer2", "layer3", "layer4")
# The paper names the stages conv2_x..conv5_x (ImageNet tables); cut points follow that naming.
STAGE_NAMES = ("conv2_x", "conv3_x", "conv4_x", "conv5_x")


def build_resnet(arch: str, num_classes: int, in_channels: int, small_input: bool) -> LayeredModel:
    from torchvision import models as tvm  # here: torchvision takes seconds to import, the recommender rarely builds

    if arch not in ARCHS:
        raise ValueError(f"unknown ResNet variant {arch!r}; expected one of {list(ARCHS)}")
    net = getattr(tvm, arch)(weights=None, num_classes=num_classes)
    if small_input:
        # Tables A.2/A.5: a 3x3 stride-1 stem and no max pool, so 32x32 (28x28) inputs reach
        # the last stage at 4x4.
        stem = [nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False), net.bn1, net.relu]
    else:
        if in_channels != 3:
            net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        stem = [net.conv1, net.bn1, net.relu, net.maxpool]
    layers: list[nn.Module] = list(stem)
    cuts: dict[str, int] = {}
    for stage, name in zip(STAGES, STAGE_NAMES):
        blocks = list(getattr(net, stage).children())
        for k, block in enumerate(blocks, start=1):
            layers.append(block)
            cuts[f"{name}_block{k}"] = len(layers)
        cuts[f"after_{name}"] = len(layers)
    layers += [net.avgpool, nn.Flatten(1), net.fc]
    # Stages carry roughly equal FLOPs, so two of four stages is the balanced two-device cut.
    return LayeredModel(layers, cuts, split_point="after_conv3_x", arch=arch, small_input=small_input)
