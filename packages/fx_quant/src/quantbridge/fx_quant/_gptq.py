"""GPTQ (Frantar et al. 2022) for per-group weight-only Linears.

Round-to-nearest (the min/max observer) rounds every weight on its own. GPTQ quantizes a
Linear's weight ``W [rows, features]`` one input feature (column) at a time and moves each
column's rounding error onto the columns not yet quantized, so that the layer's outputs on
its calibration inputs ``X`` change as little as it can: it minimises ``||(W - Q) X^T||`` one
column at a time, with ``H = X^T X`` (summed over the calibration tokens) saying how the
features' errors add up. With ``U`` the upper Cholesky factor of ``H^-1``, quantizing column
``j`` to ``q_j`` updates every later column ``k`` by ``-(w_j - q_j) / U_jj * U_jk``; the
updates of a block of 128 columns reach the columns after it in one matrix product.

Groups: the qparams of a group of ``group_size`` consecutive features are the observer's
min/max rule on the group's weights as GPTQ has updated them when it reaches the group's
first column (a block of 128 holds whole groups, as every group size divides 128). With
``act_order`` the columns go in order of decreasing ``H_jj`` and each group's qparams are
computed first, from the weights before any update ("static groups": the qparams still
belong to contiguous groups, the layout the kernels pack).

Dead inputs (``H_jj = 0``: the feature was 0 on every calibration token) are handled as the
paper's code does: ``H_jj = 1`` and the weights of that feature set to 0 before quantizing.
``H`` is accumulated in float32 (one ``[features, features]`` matrix per Linear, summed with
``addmm``); the damping, the Cholesky factorizations and the error updates run in float64,
the rounding itself in float32 with the reference module's own quantize op; the module takes
the codes as they are (``GroupQuantizedLinear.from_float(..., fitted)``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn.reference._grouped import GroupQuantizedLinear

__all__ = ["BLOCK_SIZE", "HessianRecorder", "gptq_linear", "gptq_quantize"]

_ops = torch.ops.quantbridge

# columns per lazy batch update (the paper's B); every group size (32, 64, 128) divides it
BLOCK_SIZE = 128


class HessianRecorder:
    """``sum x x^T`` over the rows of a Linear's inputs (float32), as a forward pre-hook."""

    def __init__(self, features: int) -> None:
        self.features = features
        self.hessian: torch.Tensor | None = None
        self.tokens = 0

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
            return
        rows = x.detach().reshape(-1, self.features).to(torch.float32)
        if self.hessian is None:
            self.hessian = torch.zeros(
                self.features, self.features, dtype=torch.float32, device=rows.device
            )
        self.hessian.addmm_(rows.T, rows)
        self.tokens += rows.shape[0]


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    observer: Any,
    where: str,
    *,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ codes ``[rows, features]`` and their per-group ``scale`` (float32) and
    ``zero_point`` (int32), each ``[rows, features // group_size]``, for ``weight`` given the
    input Hessian ``hessian`` (``sum x x^T``, any positive scaling) and the per-group observer
    (its group size, scheme, range, ``damp`` and ``act_order``). ``where`` starts the errors.
    """
    rows, features = weight.shape
    group = int(observer.group_size)
    if features % group or block_size % group:
        raise FxQuantError(
            f"{where}: GPTQ needs group_size {group} to divide the {features} features and "
            f"the block of {block_size} columns"
        )
    if tuple(hessian.shape) != (features, features):
        raise FxQuantError(
            f"{where}: the input Hessian is {tuple(hessian.shape)}, expected {(features, features)}"
        )
    damp = float(getattr(observer, "damp", 0.01))
    act_order = bool(getattr(observer, "act_order", False))
    qmin, qmax = int(observer.quant_min), int(observer.quant_max)
    code_dtype = torch.int8 if observer.qscheme.is_symmetric else torch.uint8

    w = weight.detach().to(torch.float64).clone()
    h = hessian.detach().to(torch.float64).clone()
    if not bool(torch.isfinite(h).all()):
        raise FxQuantError(
            f"{where}: its calibration inputs hold NaN or inf, so GPTQ has no Hessian to "
            "work with; check the calibration data (or use method='minmax' for this module)"
        )
    if not bool(torch.isfinite(w).all()):
        raise FxQuantError(f"{where}: its weight holds NaN or inf")
    diagonal = torch.diagonal(h)  # a view: writes go to h
    dead = diagonal == 0
    diagonal[dead] = 1.0
    w[:, dead] = 0.0

    groups = features // group
    scale = torch.empty(rows, groups, dtype=torch.float32, device=w.device)
    zero_point = torch.empty(rows, groups, dtype=torch.int32, device=w.device)
    order = None
    if act_order:
        # static groups: every group's qparams from the weights before any update
        all_scale, all_zp = _qparams(observer, w)
        scale.copy_(all_scale)
        zero_point.copy_(all_zp)
        order = torch.argsort(diagonal, descending=True, stable=True)
        w = w[:, order]
        h = h[order][:, order]
    torch.diagonal(h).add_(damp * float(torch.diagonal(h).mean()))
    upper = _inverse_cholesky_upper(h, where, damp)
    features_of = order.tolist() if order is not None else list(range(features))

    codes = torch.empty(rows, features, dtype=code_dtype, device=w.device)
    for start in range(0, features, block_size):
        end = min(start + block_size, features)
        block = w[:, start:end]  # a view: updated in place
        errors = torch.empty(rows, end - start, dtype=torch.float64, device=w.device)
        u_block = upper[start:end, start:end]
        for i in range(end - start):
            column = start + i
            g = features_of[column] // group
            if order is None and column % group == 0:
                s, z = _qparams(observer, block[:, i : i + group])
                scale[:, g] = s[:, 0]
                zero_point[:, g] = z[:, 0]
            s_col, z_col = scale[:, g], zero_point[:, g]
            q = _ops.quantize_per_channel(
                block[:, i : i + 1].to(torch.float32), s_col, z_col, 0, qmin, qmax, code_dtype
            )
            dq = _ops.dequantize_per_channel(q, s_col, z_col, 0, qmin, qmax, code_dtype)
            codes[:, column] = q[:, 0]
            error = (block[:, i] - dq[:, 0].to(torch.float64)) / u_block[i, i]
            block[:, i:] -= error[:, None] * u_block[i, i:][None, :]
            errors[:, i] = error
        if end < features:
            w[:, end:] -= errors @ upper[start:end, end:]
    if order is not None:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(features, device=order.device)
        codes = codes[:, inverse]
    return codes, scale, zero_point


def _inverse_cholesky_upper(h: torch.Tensor, where: str, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``h^-1``."""
    lower, info = torch.linalg.cholesky_ex(h)
    if int(info) == 0:
        upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
        if int(info) == 0:
            result: torch.Tensor = upper
            return result
    raise FxQuantError(
        f"{where}: its input Hessian (damped by damp={damp}) is not positive definite, so "
        "GPTQ cannot invert it; use a larger damp (PerGroupGPTQObserver.with_args(damp=...)), "
        "more calibration data, or method='minmax' for this module"
    )


def _qparams(observer: Any, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The observer's min/max qparams of ``weights`` (whole groups), ``[rows, groups]``."""
    observer.reset_min_max_vals()
    observer(weights.to(torch.float32))
    scale, zero_point = observer.calculate_qparams()
    return scale.to(torch.float32), zero_point.to(torch.int32)


def gptq_linear(
    linear: nn.Linear, observer: Any, recorder: HessianRecorder, where: str
) -> GroupQuantizedLinear:
    """The ``GroupQuantizedLinear`` of ``linear`` with GPTQ's codes (from the Hessian
    ``recorder`` collected in the calibration pass) and per-group qparams."""
    if recorder.hessian is None or recorder.tokens == 0:
        raise FxQuantError(
            f"{where}: it received no input in the calibration pass, so GPTQ has nothing to "
            "fit; check that calibration_data runs it, or give it method='minmax' (or None)"
        )
    hessian = recorder.hessian / recorder.tokens
    fitted = gptq_quantize(linear.weight, hessian, observer, where)
    return GroupQuantizedLinear.from_float(linear, observer, fitted)
