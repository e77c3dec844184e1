"""Reference quantized Embedding and EmbeddingBag: lookups into the round-tripped table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant.nn._module_args import embedding_bag_args, embedding_options
from quantbridge.fx_quant.nn.reference._base import ReferenceQuantizedModule

__all__ = ["Embedding", "EmbeddingBag"]


class Embedding(nn.Embedding, ReferenceQuantizedModule):
    """Reference quantized Embedding (typically per_channel_affine_float_qparams, axis 0)."""

    _IS_REFERENCE = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        device: Any = None,
        dtype: Any = None,
        weight_qparams: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight,
            device=device,
            dtype=dtype,
        )
        self._init_weight_qparams(weight_qparams, device)

    def _get_name(self) -> str:
        return "QuantizedEmbedding(Reference)"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.embedding(input, self.get_weight(), *embedding_options(self))

    @classmethod
    def from_float(cls, mod: nn.Embedding, weight_qparams: Mapping[str, Any]) -> Embedding:
        """A reference Embedding sharing ``mod``'s table, with these qparams."""
        return cls(
            mod.num_embeddings,
            mod.embedding_dim,
            *embedding_options(mod),
            _weight=mod.weight,
            device=mod.weight.device,
            dtype=mod.weight.dtype,
            weight_qparams=weight_qparams,
        )


class EmbeddingBag(nn.EmbeddingBag, ReferenceQuantizedModule):
    """Reference quantized EmbeddingBag."""

    _IS_REFERENCE = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        device: Any = None,
        dtype: Any = None,
        weight_qparams: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            mode,
            sparse,
            _weight,
            include_last_offset,
            padding_idx,
            device=device,
            dtype=dtype,
        )
        self._init_weight_qparams(weight_qparams, device)

    def _get_name(self) -> str:
        return "QuantizedEmbeddingBag(Reference)"

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return F.embedding_bag(
            input,
            self.get_weight(),
            offsets,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.mode,
            self.sparse,
            per_sample_weights,
            self.include_last_offset,
            self.padding_idx,
        )

    @classmethod
    def from_float(cls, mod: nn.EmbeddingBag, weight_qparams: Mapping[str, Any]) -> EmbeddingBag:
        """A reference EmbeddingBag sharing ``mod``'s table, with these qparams."""
        args = embedding_bag_args(mod, mod.weight)
        return cls(
            *args, device=mod.weight.device, dtype=mod.weight.dtype, weight_qparams=weight_qparams
        )
