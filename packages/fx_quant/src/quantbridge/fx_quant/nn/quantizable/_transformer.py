"""Traceable equivalents of torch's transformer layers and containers.

torch's ``forward`` methods branch on tensor properties (mask dtypes, fast paths, nested
tensors), which torch.fx cannot trace; these run the same computation (torch's slow path)
with no control flow on their inputs. ``from_float`` shares the float module's submodules
(``self_attn``, ``linear1``, norms, dropouts, the activation, ``layers``, ...) under the same
names, so QConfigMapping module-name rules keep applying; ``prepare_fx`` and
``prepare_qat_fx`` then swap each ``nn.MultiheadAttention`` and nested layer on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

from torch import Tensor, nn

from quantbridge.fx_quant._errors import FxQuantError
from quantbridge.fx_quant.nn.quantizable._activation import MultiheadAttention

__all__ = [
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]


def _check_type(mod: nn.Module, expected: type[nn.Module], cls: type) -> None:
    if type(mod) is not expected:
        raise FxQuantError(
            f"{cls.__name__}.from_float expects an nn.{expected.__name__}, got {type(mod).__name__}"
        )


def _share_children(new: nn.Module, mod: nn.Module) -> None:
    """Register ``mod``'s children on ``new`` under the same names (the same objects)."""
    for name, child in mod.named_children():
        setattr(new, name, child)


_L = TypeVar("_L", bound="_Layer")
_S = TypeVar("_S", bound="_Stack")


class _Layer(nn.Module):
    """What the encoder and decoder layers share: construction and the self-attention block."""

    _float_cls: ClassVar[type[nn.Module]]

    self_attn: nn.Module
    linear1: nn.Module
    linear2: nn.Module
    norm1: nn.Module
    norm2: nn.Module
    dropout: nn.Module
    dropout1: nn.Module
    activation: Callable[[Tensor], Tensor]

    def __init__(self, norm_first: bool = False) -> None:
        super().__init__()
        self.norm_first = norm_first

    @classmethod
    def from_float(
        cls: type[_L], mod: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer
    ) -> _L:
        """Share ``mod``'s submodules and activation (prepare swaps the attentions separately)."""
        _check_type(mod, cls._float_cls, cls)
        new = cls(mod.norm_first)
        _share_children(new, mod)
        if "activation" not in new._modules:
            new.activation = mod.activation  # a function, not a submodule
        new.training = mod.training
        return new

    def _sa_block(
        self, x: Tensor, mask: Tensor | None, padding: Tensor | None, is_causal: bool
    ) -> Tensor:
        out = self.self_attn(
            x,
            x,
            x,
            attn_mask=mask,
            key_padding_mask=padding,
            need_weights=False,
            is_causal=is_causal,
        )[0]
        result: Tensor = self.dropout1(out)
        return result

    def _feed_forward(self, x: Tensor) -> Tensor:
        """The feed-forward block without its closing dropout (each layer names that one)."""
        result: Tensor = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return result


class TransformerEncoderLayer(_Layer):
    """``nn.TransformerEncoderLayer``'s computation, traceable; built by :meth:`from_float`."""

    _float_cls = nn.TransformerEncoderLayer

    dropout2: nn.Module

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        out: Tensor = self.norm2(x + self._ff_block(x))
        return out

    def _ff_block(self, x: Tensor) -> Tensor:
        result: Tensor = self.dropout2(self._feed_forward(x))
        return result


class TransformerDecoderLayer(_Layer):
    """``nn.TransformerDecoderLayer``'s computation, traceable; built by :meth:`from_float`."""

    _float_cls = nn.TransformerDecoderLayer

    multihead_attn: nn.Module
    norm3: nn.Module
    dropout2: nn.Module
    dropout3: nn.Module

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(
                self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal
            )
            return x + self._ff_block(self.norm3(x))
        x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = self.norm2(
            x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal)
        )
        out: Tensor = self.norm3(x + self._ff_block(x))
        return out

    def _mha_block(
        self,
        x: Tensor,
        memory: Tensor,
        mask: Tensor | None,
        padding: Tensor | None,
        is_causal: bool,
    ) -> Tensor:
        out = self.multihead_attn(
            x,
            memory,
            memory,
            attn_mask=mask,
            key_padding_mask=padding,
            is_causal=is_causal,
            need_weights=False,
        )[0]
        result: Tensor = self.dropout2(out)
        return result

    def _ff_block(self, x: Tensor) -> Tensor:
        result: Tensor = self.dropout3(self._feed_forward(x))
        return result


class _Stack(nn.Module):
    """What the encoder and decoder share: the float module's layers (a new list) and norm."""

    _float_cls: ClassVar[type[nn.Module]]

    layers: nn.ModuleList
    norm: nn.Module | None

    @classmethod
    def from_float(cls: type[_S], mod: nn.TransformerEncoder | nn.TransformerDecoder) -> _S:
        _check_type(mod, cls._float_cls, cls)
        new = cls()
        _share_children(new, mod)
        new.layers = nn.ModuleList(list(mod.layers))  # a new list: the float model keeps its own
        if "norm" not in new._modules:
            new.norm = None
        new.training = mod.training
        return new


class TransformerEncoder(_Stack):
    """``nn.TransformerEncoder`` without its nested-tensor fast path, traceable.

    The layers run in order and ``norm`` (if any) follows; the layers are the float
    module's own (the swap then makes each one traceable).
    """

    _float_cls = nn.TransformerEncoder

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        output = src
        # torch's layers need a bool; None (torch: "detect a causal mask") computes the same
        # as False, since a causal hint only ever stands for the causal mask it came with.
        is_causal = False if is_causal is None else is_causal
        for layer in self.layers:
            output = layer(
                output,
                src_mask=mask,
                is_causal=is_causal,
                src_key_padding_mask=src_key_padding_mask,
            )
        if self.norm is not None:
            output = self.norm(output)
        return output


class TransformerDecoder(_Stack):
    """``nn.TransformerDecoder``, traceable (layers in order, then ``norm`` if any)."""

    _float_cls = nn.TransformerDecoder

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        output = tgt
        tgt_is_causal = False if tgt_is_causal is None else tgt_is_causal  # as in the encoder
        for layer in self.layers:
            output = layer(
                output,
                memory,
                tgt_mask=tgt_mask,
                memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask,
                tgt_is_causal=tgt_is_causal,
                memory_is_causal=memory_is_causal,
            )
        if self.norm is not None:
            output = self.norm(output)
        return output


class Transformer(nn.Module):
    """``nn.Transformer`` (encoder, then decoder on its memory), traceable.

    torch's shape checks on ``src``/``tgt`` are not repeated (they branch on tensor sizes);
    mismatched inputs fail inside the attention instead.
    """

    encoder: nn.Module
    decoder: nn.Module

    def __init__(self, d_model: int, nhead: int, batch_first: bool) -> None:
        super().__init__()
        self.d_model = d_model
        self.nhead = nhead
        self.batch_first = batch_first

    @classmethod
    def from_float(cls, mod: nn.Transformer) -> Transformer:
        _check_type(mod, nn.Transformer, cls)
        new = cls(mod.d_model, mod.nhead, mod.batch_first)
        _share_children(new, mod)
        new.training = mod.training
        return new

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        memory = self.encoder(
            src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal
        )
        result: Tensor = self.decoder(
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
            memory_is_causal=memory_is_causal,
        )
        return result


# The traceable class (built with its ``from_float``) for each float class it replaces.
FLOAT_TO_TRACEABLE: dict[type[nn.Module], type[nn.Module]] = {
    nn.MultiheadAttention: MultiheadAttention,
    nn.TransformerEncoderLayer: TransformerEncoderLayer,
    nn.TransformerDecoderLayer: TransformerDecoderLayer,
    nn.TransformerEncoder: TransformerEncoder,
    nn.TransformerDecoder: TransformerDecoder,
    nn.Transformer: Transformer,
}
