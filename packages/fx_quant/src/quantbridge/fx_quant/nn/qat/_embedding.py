"""QAT Embedding and EmbeddingBag: lookups read a fake-quantized table.

The weight fake-quant must use ``per_channel_affine_float_qparams`` (one float scale and zero
point per row), as torch.ao requires.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn._module_args import (
    copy_parameters,
    embedding_bag_args,
    embedding_options,
)
from quantbridge.fx_quant.nn.qat._common import (
    build_weight_fake_quant,
    float_module_qconfig,
    require_qconfig,
)
from quantbridge.qconfig import QScheme, canonical_qscheme

__all__ = ["Embedding", "EmbeddingBag"]


def _check_float_qparams(qconfig: Any, where: str) -> None:
    qscheme = getattr(qconfig.weight(), "qscheme", None)
    try:
        ok = canonical_qscheme(qscheme) is QScheme.PER_CHANNEL_AFFINE_FLOAT_QPARAMS
    except ValueError:
        ok = False
    if not ok:
        raise FxQuantError(
            f"{where}: embedding weights need qscheme per_channel_affine_float_qparams, got "
            f"{qscheme}; use e.g. quantbridge.qconfig.default_embedding_qat_qconfig"
        )


class Embedding(nn.Embedding):
    """QAT Embedding."""

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
        qconfig: Any = None,
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
        require_qconfig(qconfig, "qat.Embedding")
        _check_float_qparams(qconfig, "qat.Embedding")
        self.qconfig = qconfig
        self.weight_fake_quant = build_weight_fake_quant(qconfig, device, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.embedding(input, self.weight_fake_quant(self.weight), *embedding_options(self))

    @classmethod
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> Embedding:
        """The QAT module for float ``mod`` (sharing its table), using ``mod.qconfig``."""
        qconfig = float_module_qconfig(mod, (nn.Embedding,), "qat.Embedding")
        assert isinstance(mod, nn.Embedding)
        return cls(
            mod.num_embeddings,
            mod.embedding_dim,
            *embedding_options(mod),
            mod.weight,
            qconfig=qconfig,
        )

    def to_float(self) -> nn.Embedding:
        """A plain nn.Embedding with a copy of the table."""
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, *embedding_options(self), None)
        copy_parameters(emb, self, ("weight",))
        emb.train(self.training)
        return emb


class EmbeddingBag(nn.EmbeddingBag):
    """QAT EmbeddingBag."""

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
        qconfig: Any = None,
        device: Any = None,
        dtype: Any = None,
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
        require_qconfig(qconfig, "qat.EmbeddingBag")
        _check_float_qparams(qconfig, "qat.EmbeddingBag")
        self.qconfig = qconfig
        self.weight_fake_quant = build_weight_fake_quant(qconfig, device, dtype)

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return F.embedding_bag(
            input,
            self.weight_fake_quant(self.weight),
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
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> EmbeddingBag:
        """The QAT module for float ``mod`` (sharing its table), using ``mod.qconfig``."""
        qconfig = float_module_qconfig(mod, (nn.EmbeddingBag,), "qat.EmbeddingBag")
        assert isinstance(mod, nn.EmbeddingBag)
        return cls(*embedding_bag_args(mod, mod.weight), qconfig=qconfig)

    def to_float(self) -> nn.EmbeddingBag:
        """A plain nn.EmbeddingBag with a copy of the table."""
        bag = nn.EmbeddingBag(*embedding_bag_args(self, None))
        copy_parameters(bag, self, ("weight",))
        bag.train(self.training)
        return bag
