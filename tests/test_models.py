"""Builders: shapes, parameter counts, cut points, equivalence with torchvision's models."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision import models as tvm

from ddlx.errors import ConfigError
from ddlx.models import ARCHITECTURES, LayeredModel, build_model


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("num_classes", [1000, 3])
def test_imagenet_variants_match_torchvision_parameter_counts(arch, num_classes):
    with torch.device("meta"):
        ours = build_model(arch, num_classes, 3, 224)
        reference = getattr(tvm, arch)(weights=None, num_classes=num_classes)
    assert _params(ours) == _params(reference)


# Jansen's thesis, Appendix A: small-image models (CIFAR-10 counts as in the reference implementations
# the thesis used: 10 classes).
@pytest.mark.parametrize(
    "arch,expected",
    [("resnet18", 11_173_962), ("resnet50", 23_520_842), ("vgg16", 14_728_266), ("vgg11", 9_231_114)],
)
def test_cifar_variants_parameter_counts(arch, expected):
    with torch.device("meta"):
        assert _params(build_model(arch, 10, 3, 32)) == expected


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("size,channels,classes", [(32, 3, 10), (28, 1, 10), (224, 3, 3), (512, 3, 1000)])
def test_output_shape(arch, size, channels, classes):
    with torch.device("meta"):
        model = build_model(arch, classes, channels, size)
        out = model(torch.empty(2, channels, size, size))
    assert isinstance(model, LayeredModel)
    assert tuple(out.shape) == (2, classes)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_flattened_model_computes_torchvision_function(arch):
    """Same weights, same outputs: flattening into layers changed nothing."""
    torch.manual_seed(0)
    reference = getattr(tvm, arch)(weights=None, num_classes=5).eval()
    ours = build_model(arch, 5, 3, 224).eval()
    with torch.no_grad():
        for dst, src in zip(ours.parameters(), reference.parameters(), strict=True):
            dst.copy_(src)
        for dst, src in zip(ours.buffers(), reference.buffers(), strict=True):
            dst.copy_(src)
        x = torch.randn(2, 3, 64, 64)
        torch.testing.assert_close(ours(x), reference(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", [a if a != "resnet152" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHITECTURES])
@pytest.mark.parametrize("size", [32, pytest.param(96, marks=pytest.mark.slow)])
def test_every_cut_point_composes_to_the_whole_model(arch, size):
    """(ResNet-152, 50 cut points, each a whole forward, is in the slow suite; ResNet-50 has the same blocks.)"""
    torch.manual_seed(0)
    model = build_model(arch, 4, 3, size).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        whole = model(x)
        assert model.cut_points, f"{arch} exposes no cut points"
        for name in model.cut_points:
            head, tail = model.cut(name)
            assert len(head) + len(tail) == len(model)
            torch.testing.assert_close(tail(head(x)), whole)


@pytest.mark.parametrize("arch,convs_before_split", [("alexnet", 4), ("vgg16", 8)])
def test_paper_split_points(arch, convs_before_split):
    """The Lerat et al. entry, section 2.4: AlexNet splits after its 4th convolution, VGG16 after its 8th."""
    for size in (224, 32):
        with torch.device("meta"):
            model = build_model(arch, 3, 3, size)
        head, tail = model.cut(model.split_point)
        assert sum(isinstance(m, nn.Conv2d) for m in head.modules()) == convs_before_split
        assert isinstance(tail[0], nn.Conv2d), "the second half starts with the next convolution"


def test_bad_requests_are_clear():
    with pytest.raises(ConfigError, match="unknown model 'vgg19'.*alexnet"):
        build_model("vgg19", 3)
    with pytest.raises(ConfigError, match=r"data.image_size=8: expected a value >= 16"):
        build_model("alexnet", 3, 3, 8)
    with pytest.raises(KeyError, match="no cut point 'nope'"):
        build_model("resnet18", 3, 3, 32).cut("nope")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_model_is_profiled_at_the_smallest_image_size_it_takes(arch):
    """train.py and recommend.py count the profile (one sample, on the meta device) before any
    work; VGG's last batch norm at 16 px sees one value per channel, which training mode refuses."""
    from ddlx.costmodel.profile import _count_profile
    from ddlx.models import MIN_IMAGE_SIZE

    profile = _count_profile(arch, 3, 3, MIN_IMAGE_SIZE)
    assert profile.image_size == MIN_IMAGE_SIZE and all(layer.forward_flops >= 0 for layer in profile.layers)
    assert sum(layer.forward_flops for layer in profile.layers) > 0
