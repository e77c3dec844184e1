"""Reference weight-only modules with per-group qparams (decoder LLMs).

A weight ``[rows, features]`` is stored as integer codes plus one scale (and zero point) per
group of ``group_size`` consecutive features of a row; the float weight is not kept. Forward
dequantizes (``(code - zero_point) * scale``, ``torch.ops.quantbridge.dequantize_per_channel``
over the groups) and runs the float op: the model a backend lowers to weight-only kernels.

Buffers (saved in state_dict): ``weight_codes`` (int8 for symmetric schemes, uint8 for
affine), ``weight_scale`` (float32 ``[rows, groups]``), ``weight_zero_point`` (int32
``[rows, groups]``); the scheme, group size and quant range travel as extra state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.qconfig import GROUP_SIZES, QScheme, canonical_qscheme

__all__ = ["GroupQuantizedEmbedding", "GroupQuantizedLinear", "GroupQuantizedWeight"]

_ops = torch.ops.quantbridge


class GroupQuantizedWeight(nn.Module):
    """Codes and per-group qparams of one weight; the base of the two modules below."""

    weight_codes: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor

    def __init__(
        self,
        rows: int,
        features: int,
        group_size: int,
        qscheme: object,
        quant_min: int,
        quant_max: int,
    ) -> None:
        super().__init__()
        where = type(self).__name__
        scheme = canonical_qscheme(qscheme, f"{where}: qscheme")
        if not scheme.is_per_group:
            raise FxQuantError(f"{where}: qscheme must be per_group_*, got {scheme.value}")
        if group_size not in GROUP_SIZES or features % group_size:
            raise FxQuantError(
                f"{where}: group_size {group_size!r} must be one of {list(GROUP_SIZES)} and "
                f"divide the {features} features"
            )
        dtype = torch.int8 if scheme is QScheme.PER_GROUP_SYMMETRIC else torch.uint8
        info = torch.iinfo(dtype)
        if not info.min <= quant_min <= 0 <= quant_max <= info.max or quant_min >= quant_max:
            raise FxQuantError(
                f"{where}: quant range [{quant_min}, {quant_max}] does not fit {dtype} or "
                "excludes 0"
            )
        self.group_size, self.qscheme = group_size, scheme
        self.quant_min, self.quant_max, self.code_dtype = quant_min, quant_max, dtype
        groups = features // group_size
        self.register_buffer("weight_codes", torch.zeros(rows, features, dtype=dtype))
        self.register_buffer("weight_scale", torch.ones(rows, groups))
        self.register_buffer("weight_zero_point", torch.zeros(rows, groups, dtype=torch.int32))

    @property
    def bits(self) -> int:
        return int(self.quant_max - self.quant_min).bit_length()

    def set_weight(
        self, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
    ) -> None:
        """Quantize ``weight`` with the observer's ``scale`` / ``zero_point`` ([rows, groups])."""
        rows, features = self.weight_codes.shape
        if tuple(weight.shape) != (rows, features):
            raise FxQuantError(
                f"{type(self).__name__}: weight shape {tuple(weight.shape)} != {(rows, features)}"
            )
        flat_scale, flat_zp = self._flat_qparams(scale, zero_point)
        with torch.no_grad():
            codes = _ops.quantize_per_channel(
                weight.detach().to(torch.float32).reshape(-1, self.group_size),
                flat_scale, flat_zp, 0, self.quant_min, self.quant_max, self.code_dtype,
            )  # fmt: skip
        self.set_codes(codes.reshape(rows, features), scale, zero_point)

    def set_codes(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        """Take ``codes`` ([rows, features], this module's code dtype and range) with their
        ``scale`` / ``zero_point`` ([rows, groups]) as they are (GPTQ chooses its own)."""
        rows, features = self.weight_codes.shape
        where = type(self).__name__
        if tuple(codes.shape) != (rows, features) or codes.dtype != self.code_dtype:
            raise FxQuantError(
                f"{where}: codes must be {self.code_dtype} {[rows, features]}, got "
                f"{codes.dtype} {list(codes.shape)}"
            )
        if bool((codes < self.quant_min).any() | (codes > self.quant_max).any()):
            raise FxQuantError(f"{where}: codes must lie in [{self.quant_min}, {self.quant_max}]")
        flat_scale, flat_zp = self._flat_qparams(scale, zero_point)
        with torch.no_grad():
            self.weight_codes.copy_(codes)
            self.weight_scale.copy_(flat_scale.reshape(self.weight_scale.shape))
            self.weight_zero_point.copy_(flat_zp.reshape(self.weight_zero_point.shape))

    def _flat_qparams(
        self, scale: torch.Tensor, zero_point: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``scale`` (float32) and ``zero_point`` (int32), checked to be [rows, groups], flat."""
        want = tuple(self.weight_scale.shape)
        if tuple(scale.shape) != want or tuple(zero_point.shape) != want:
            raise FxQuantError(
                f"{type(self).__name__}: qparams must be {list(want)}, got scale "
                f"{list(scale.shape)} and zero_point {list(zero_point.shape)}"
            )
        flat_scale = scale.detach().reshape(-1).to(torch.float32)
        return flat_scale, zero_point.detach().reshape(-1).to(torch.int32)

    def dequantized_rows(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float weight (or the ``rows`` of it), ``(code - zero_point) * scale``."""
        codes, scale, zp = self.weight_codes, self.weight_scale, self.weight_zero_point
        if rows is not None:
            codes, scale, zp = codes[rows], scale[rows], zp[rows]
        shape = codes.shape
        flat = _ops.dequantize_per_channel(
            codes.reshape(-1, self.group_size), scale.reshape(-1), zp.reshape(-1), 0,
            self.quant_min, self.quant_max, self.code_dtype,
        )  # fmt: skip
        result: torch.Tensor = flat.reshape(shape)
        return result

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "group_size": self.group_size,
            "qscheme": self.qscheme.value,
            "quant_min": self.quant_min,
            "quant_max": self.quant_max,
        }

    def set_extra_state(self, state: Any) -> None:
        expected = self.get_extra_state()
        if not isinstance(state, dict) or state != expected:
            raise FxQuantError(
                f"{type(self).__name__}: the state_dict was saved with {state!r}, this module "
                f"has {expected}; build the module with the same group size, scheme and range"
            )

    def _group_repr(self) -> str:
        return f"bits={self.bits}, group_size={self.group_size}, qscheme={self.qscheme.value}"


class GroupQuantizedLinear(GroupQuantizedWeight):
    """``nn.Linear`` with a weight-only per-group quantized weight (float activations)."""

    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group_size: int,
        qscheme: object,
        quant_min: int,
        quant_max: int,
    ) -> None:
        super().__init__(out_features, in_features, group_size, qscheme, quant_min, quant_max)
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_float(
        cls,
        linear: nn.Linear,
        observer: Any,
        fitted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> GroupQuantizedLinear:
        """From ``linear`` and its per-group weight observer (run here on the weight), or
        with ``fitted`` codes, scale and zero point chosen elsewhere (GPTQ) for that
        observer's scheme and range."""
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None,
            observer.group_size, observer.qscheme, observer.quant_min, observer.quant_max,
        )  # fmt: skip
        if fitted is None:
            observer(linear.weight.detach())
            scale, zero_point = observer.calculate_qparams()
            module.set_weight(linear.weight, scale, zero_point)
        else:
            module.to(fitted[0].device).set_codes(*fitted)
        if linear.bias is not None and module.bias is not None:
            with torch.no_grad():
                module.bias.copy_(linear.bias.detach())
        return module.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_rows().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {self._group_repr()}"
        )


class GroupQuantizedEmbedding(GroupQuantizedWeight):
    """``nn.Embedding`` with a weight-only per-group quantized table (rows dequantized on
    lookup). ``padding_idx`` is kept; ``max_norm`` and sparse gradients are not supported."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group_size: int,
        qscheme: object,
        quant_min: int,
        quant_max: int,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, group_size, qscheme, quant_min, quant_max)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx

    @classmethod
    def from_float(cls, embedding: nn.Embedding, observer: Any) -> GroupQuantizedEmbedding:
        """From ``embedding`` and its per-group weight observer (run here on the table)."""
        if embedding.max_norm is not None or embedding.sparse:
            raise FxQuantError(
                "GroupQuantizedEmbedding: max_norm and sparse embeddings are not supported; "
                "keep this embedding float (qconfig None)"
            )
        observer(embedding.weight.detach())
        scale, zero_point = observer.calculate_qparams()
        module = cls(
            embedding.num_embeddings, embedding.embedding_dim, observer.group_size,
            observer.qscheme, observer.quant_min, observer.quant_max, embedding.padding_idx,
        )  # fmt: skip
        module.set_weight(embedding.weight, scale, zero_point)
        return module.to(embedding.weight.device)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if indices.dtype not in (torch.int32, torch.int64):
            raise FxQuantError(
                f"GroupQuantizedEmbedding: indices must be int32 or int64, got {indices.dtype}"
            )
        if indices.numel() and (
            int(indices.min()) < 0 or int(indices.max()) >= self.num_embeddings
        ):
            raise FxQuantError(
                f"GroupQuantizedEmbedding: indices must lie in [0, {self.num_embeddings}), got "
                f"[{int(indices.min())}, {int(indices.max())}]"
            )
        flat = indices.reshape(-1).to(torch.int64)
        rows = self.dequantized_rows(flat)
        return rows.reshape(*indices.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"{self._group_repr()}"
        )
