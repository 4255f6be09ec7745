"""The per-layer GPU time model: the kernels a step runs, how the units and the memory price them,
and its parameters fitted to published one-GPU training throughputs (each figure cited)."""
from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
from conftest import CONF_DIR

from ddlx.costmodel.gpu_reference import (
    DEFAULT_HW_DIR,
    fit,
    fitted_model,
    fitted_steps,
    leave_one_out,
    load_reference,
    predicted_images_per_s,
)
from ddlx.costmodel.gpu_time import BOUNDS, step_time
from ddlx.costmodel.hardware import hw_file
from ddlx.costmodel.kernels import kernel_profile


def test_a_step_s_kernels_are_traced_per_layer_and_pass():
    """A convolution's backward is two products the size of its forward (the first layer's one:
    training never needs the image's gradient); under autocast the same products move fewer bytes."""
    fp32, mixed = (kernel_profile("vgg11", 10, 3, 64, m) for m in (False, True))
    forward = [sum(p.flops for p in layer.forward.products) for layer in fp32.layers]
    backward = [sum(p.flops for p in layer.backward.products) for layer in fp32.layers]
    assert backward[0] == pytest.approx(forward[0])
    convolutions = [i for i, f in enumerate(forward) if f and i > 0]
    assert all(backward[i] == pytest.approx(2 * forward[i]) for i in convolutions)
    assert all(layer.forward.kernels >= len(layer.forward.products) for layer in fp32.layers)
    bytes_of = lambda k: sum(p.bytes for layer in k.layers for ps in (layer.forward, layer.backward) for p in ps.products)  # noqa: E731
    assert bytes_of(mixed) < 0.6 * bytes_of(fp32)
    winograd = [p.winograd for layer in fp32.layers for p in layer.forward.products if p.kind == "convolution"]
    assert winograd and all(w == 1.0 for w in winograd), "VGG's 3x3 stride-1 convolutions"


def test_the_units_and_the_batch_set_a_step_s_time():
    """Small batches leave the units idle (images/s rises with the batch, then levels off); the
    same step is faster on a GPU with more of what bounds it."""
    model = fitted_model(DEFAULT_HW_DIR)
    v100 = hw_file("v100_8x", CONF_DIR / "hw")
    kernels = kernel_profile("resnet50", 1000, 3, 224, True)
    rate = [b / step_time(kernels, b, v100, model.params).total_s for b in (1, 8, 64, 256)]
    assert rate == sorted(rate) and rate[-1] / rate[-2] < rate[1] / rate[0]
    faster = replace(v100, memory_bandwidth_gb_s=2 * v100.memory_bandwidth_gb_s,
                     peak_tflops_by_type={**v100.peak_tflops_by_type, "fp16": 2 * v100.peak_tflops_by_type["fp16"]})
    assert step_time(kernels, 256, faster, model.params).total_s < step_time(kernels, 256, v100, model.params).total_s


def test_every_published_figure_names_its_source_and_every_left_out_one_why():
    figures = load_reference()
    fitted = [f for f in figures if f.fit]
    assert len(fitted) >= 40 and {f.hw for f in fitted} >= {"titanrtx_4x", "v100_8x", "h100_1x", "a100_sxm4_80gb_8x"}
    assert all(f.source.count("@") == 1 and f.batch > 0 and (CONF_DIR / "hw" / f"{f.hw}.yaml").is_file() for f in fitted)
    assert all(f.excluded_because for f in figures if not f.fit)


def test_the_model_fitted_to_the_published_figures_predicts_them():
    """Fitted to every cited figure (in-sample): the median error and the worst stated in
    docs/validation.md; each parameter within what the hardware allows."""
    steps = fitted_steps(DEFAULT_HW_DIR)
    params = fitted_model(DEFAULT_HW_DIR).params
    assert all(low <= value <= high for value, (low, high) in zip(params.as_tuple(), BOUNDS))
    errors = [abs(predicted_images_per_s(step, f.batch, params) / f.images_per_s - 1) for step, f in steps]
    assert statistics.median(errors) < 0.10 and max(errors) < 0.40
    assert sum(e <= 0.15 for e in errors) >= 0.7 * len(errors)


@pytest.mark.slow
def test_each_published_figure_is_predicted_from_the_others():
    """Leave-one-out: the model fitted without a figure predicts it (~5 min: one fit per figure)."""
    errors = [abs(predicted / f.images_per_s - 1) for f, predicted in leave_one_out(fitted_steps(DEFAULT_HW_DIR))]
    assert statistics.median(errors) < 0.10 and max(errors) < 0.40
    assert sum(e <= 0.15 for e in errors) >= 0.7 * len(errors)


def test_a_fit_recovers_the_parameters_it_was_made_from():
    """Figures made by the model itself at known parameters are fitted back to the same images/s."""
    steps = fitted_steps(DEFAULT_HW_DIR)[:12]
    truth = fitted_model(DEFAULT_HW_DIR).params
    made = [(step, replace(f, images_per_s=predicted_images_per_s(step, f.batch, truth))) for step, f in steps]
    again = fit(made)
    for step, figure in made:
        assert predicted_images_per_s(step, figure.batch, again) == pytest.approx(figure.images_per_s, rel=0.02)
