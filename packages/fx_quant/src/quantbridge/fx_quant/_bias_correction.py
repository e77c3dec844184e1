"""Bias correction: fold the mean output error of weight quantization into each bias.

Quantizing a weight ``W`` to ``W_q`` (quantize -> dequantize) shifts the layer's output by
``(W - W_q) x``; its mean over the calibration data is, per output channel,
``E[(W - W_q) x]`` (for a linear layer exactly ``(W - W_q) E[x]``). Adding it to the bias
makes the quantized layer's mean output equal the float layer's on that data (Nagel et al.,
"Data-Free Quantization", section 4.2, here measured on calibration data).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn.reference import Conv1d, Conv2d, Conv3d, Linear

__all__ = ["bias_correction"]

_SUPPORTED = (Linear, Conv1d, Conv2d, Conv3d)


class _Mean:
    """Running per-output-channel sum of ``(W - W_q) x`` and the number of positions."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.delta = (module.weight - module.get_weight()).detach()
        self.total = torch.zeros(self.delta.shape[0], dtype=torch.float64)
        self.count = 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach()
        if isinstance(self.module, Linear):
            error = F.linear(x, self.delta)
            per_channel = error.reshape(-1, error.shape[-1])
        else:
            error = self.module._conv_forward(x, self.delta, None)
            per_channel = error.transpose(0, 1).reshape(error.shape[1], -1).T
        self.total += per_channel.double().sum(0).cpu()
        self.count += per_channel.shape[0]


def _run(model: nn.Module, item: Any) -> None:
    if isinstance(item, torch.Tensor):
        model(item)
    elif isinstance(item, dict):
        model(**item)
    elif isinstance(item, (tuple, list)):
        model(*item)
    else:
        raise FxQuantError(
            f"bias_correction: a data item is a {type(item).__name__}; give tensors, tuples "
            "of positional arguments or dicts of keyword arguments"
        )


def bias_correction(
    reference_model: nn.Module,
    data: Iterable[Any],
    *,
    module_names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Correct the biases of ``reference_model``'s quantized Linear and Conv1d/2d/3d layers
    (reference modules, from :func:`convert_to_reference_fx`) for the mean output error of
    their weight quantization, measured on ``data`` (each item a tensor, a tuple of
    positional arguments or a dict of keyword arguments, as for :func:`calibrate`).

    All layers are measured in one pass over ``data`` through the uncorrected reference
    model (so each layer sees its quantized inputs), then every bias ``b`` becomes
    ``b + E[(W - W_q) x]``; a layer without a bias gets one. ``module_names`` limits the
    correction to those modules. The model is changed in place; lower it afterwards
    (``get_backend(name).lower(reference_model)``). Returns the correction added to each
    module's bias, by module name.
    """
    if not isinstance(reference_model, nn.Module):
        raise FxQuantError(
            f"bias_correction: reference_model must be an nn.Module, got "
            f"{type(reference_model).__name__}"
        )
    layers = {
        name: module
        for name, module in reference_model.named_modules()
        if isinstance(module, _SUPPORTED) and module.weight_qscheme is not None
    }
    if module_names is not None:
        wanted = list(module_names)
        unknown = [n for n in wanted if n not in layers]
        if unknown:
            raise FxQuantError(
                f"bias_correction: {unknown} are not quantized Linear/Conv reference modules "
                f"of the model; choose among {sorted(layers)}"
            )
        layers = {n: layers[n] for n in wanted}
    if not layers:
        raise FxQuantError(
            "bias_correction: the model has no quantized Linear/Conv reference module; pass "
            "the result of convert_to_reference_fx (a lowered model's weights are packed "
            "already: correct the reference model, then lower it). Only module layers are "
            "corrected: a functional linear (F.linear, or Hugging Face's Conv1D in GPT-2, "
            "which torch.export turns into addmm) keeps no float weight to correct from"
        )
    means = {name: _Mean(module) for name, module in layers.items()}
    handles = [layers[name].register_forward_pre_hook(mean) for name, mean in means.items()]
    was_training = reference_model.training
    reference_model.eval()
    try:
        with torch.no_grad():
            for item in data:
                _run(reference_model, item)
    finally:
        for handle in handles:
            handle.remove()
        reference_model.train(was_training)
    corrections: dict[str, torch.Tensor] = {}
    for name, mean in means.items():
        if mean.count == 0:
            raise FxQuantError(
                f"bias_correction: module {name!r} saw no data; give calibration data that "
                "runs through every corrected layer (or leave it out with module_names)"
            )
        module: Any = layers[name]
        weight = module.weight
        correction = (mean.total / mean.count).to(dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            if module.bias is None:
                module.bias = nn.Parameter(correction.clone())
            else:
                module.bias.add_(correction)
        corrections[name] = correction
    return corrections
