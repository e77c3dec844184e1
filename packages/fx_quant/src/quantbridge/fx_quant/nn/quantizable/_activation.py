"""A traceable ``nn.MultiheadAttention`` whose projections are ordinary ``nn.Linear`` modules.

torch's ``nn.MultiheadAttention`` keeps its query/key/value projections in one packed
parameter and calls them from ``F.multi_head_attention_forward``, so the quantization tracer
sees one opaque module and nothing inside it is quantized. Here the four projections are
``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` (plain ``nn.Linear``, quantized by the
normal flow), and everything between them (head split, masks, softmax, dropout, head merge)
is :class:`AttentionCore`, one leaf module that stays float.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quantbridge.fx_quant._errors import FxQuantError

__all__ = ["AttentionCore", "MultiheadAttention"]


def _float_mask(mask: Tensor | None, name: str, dtype: torch.dtype) -> Tensor | None:
    """A bool mask as an additive float mask (True -> -inf); float masks unchanged."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise FxQuantError(
            f"MultiheadAttention: {name} has dtype {mask.dtype}; pass a bool mask (True = "
            "not attended) or a float mask (added to the attention scores)"
        )
    return mask


def _pad_key_column(mask: Tensor | None) -> Tensor | None:
    """One more (unmasked) key position at the end, for bias_k or the zero key."""
    return None if mask is None else F.pad(mask, (0, 1))


class AttentionCore(nn.Module):
    """Scaled dot-product attention over already projected q, k, v, with torch's options.

    Takes and returns tensors in the caller's layout: batched ``(N, L, E)`` when
    ``batch_first`` else ``(L, N, E)``, or unbatched ``(L, E)``. Applies ``bias_k``/``bias_v``,
    the zero key (``add_zero_attn``), ``attn_mask`` and ``key_padding_mask`` (bool or
    float), the ``is_causal`` hint exactly as ``F.multi_head_attention_forward`` does, and
    dropout on the attention weights in training mode. Returns ``(output, weights)`` with
    ``weights`` None unless ``need_weights``.

    It is a leaf for the quantization tracer and no BackendConfig pattern matches it, so it
    stays float: only the projections around it are quantized.
    """

    def __init__(self, num_heads: int, dropout: float, batch_first: bool, add_zero_attn: bool):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn

    def _to_batch_major(self, x: Tensor, batched: bool) -> Tensor:
        if not batched:
            return x.unsqueeze(0)
        return x if self.batch_first else x.transpose(0, 1)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias_k: Tensor | None = None,
        bias_v: Tensor | None = None,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        batched = q.dim() == 3
        if q.dim() not in (2, 3) or k.dim() != q.dim() or v.dim() != q.dim():
            raise FxQuantError(
                f"MultiheadAttention: query, key and value must all be 3-D (batched) or all "
                f"2-D (unbatched), got {q.dim()}-D, {k.dim()}-D and {v.dim()}-D"
            )
        q, k, v = (self._to_batch_major(x, batched) for x in (q, k, v))
        n, tgt_len, embed_dim = q.shape
        heads = self.num_heads
        head_dim = embed_dim // heads

        kpm = _float_mask(key_padding_mask, "key_padding_mask", q.dtype)
        if kpm is not None and not batched:
            kpm = kpm.unsqueeze(0)
        if is_causal and attn_mask is None:
            raise FxQuantError(
                "MultiheadAttention: is_causal=True needs attn_mask (torch requires it too); "
                "pass the causal mask, e.g. nn.Transformer.generate_square_subsequent_mask(L)"
            )
        # As torch: the causal hint replaces attn_mask only when nothing else is merged into it.
        causal = bool(is_causal) and kpm is None and not need_weights
        mask = None if causal else _float_mask(attn_mask, "attn_mask", q.dtype)
        if mask is not None:
            src_len = k.shape[1]
            expected = (tgt_len, src_len) if mask.dim() == 2 else (n * heads, tgt_len, src_len)
            if mask.dim() not in (2, 3) or tuple(mask.shape) != expected:
                raise FxQuantError(
                    f"MultiheadAttention: attn_mask has shape {tuple(mask.shape)}; expected "
                    f"{(tgt_len, src_len)} or {(n * heads, tgt_len, src_len)} "
                    "(batch * num_heads, target length, source length)"
                )
            mask = mask.unsqueeze(0) if mask.dim() == 2 else mask

        if bias_k is not None and bias_v is not None:
            k = torch.cat([k, bias_k.reshape(1, 1, -1).expand(n, 1, -1)], dim=1)
            v = torch.cat([v, bias_v.reshape(1, 1, -1).expand(n, 1, -1)], dim=1)
            mask, kpm = _pad_key_column(mask), _pad_key_column(kpm)

        # (N, S, E) -> (N, heads, S, head_dim)
        q = q.reshape(n, tgt_len, heads, head_dim).transpose(1, 2)
        k = k.reshape(n, k.shape[1], heads, head_dim).transpose(1, 2)
        v = v.reshape(n, v.shape[1], heads, head_dim).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(n, heads, 1, head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(n, heads, 1, head_dim)], dim=2)
            mask, kpm = _pad_key_column(mask), _pad_key_column(kpm)
        src_len = k.shape[2]

        if mask is not None:
            mask = mask.reshape(-1, heads if mask.shape[0] > 1 else 1, tgt_len, src_len)
        if kpm is not None:
            if tuple(kpm.shape) != (n, src_len):
                raise FxQuantError(
                    f"MultiheadAttention: key_padding_mask has shape {tuple(kpm.shape)} "
                    f"(after bias_k / zero-key columns); expected {(n, src_len)}"
                )
            kpm = kpm.reshape(n, 1, 1, src_len)
            mask = kpm if mask is None else mask + kpm
        if causal:
            keep = torch.ones(tgt_len, src_len, dtype=torch.bool, device=q.device).tril()
            mask = torch.zeros(tgt_len, src_len, dtype=q.dtype, device=q.device)
            mask = mask.masked_fill_(~keep, float("-inf"))

        scores = torch.matmul(q * math.sqrt(1.0 / head_dim), k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if self.training and self.dropout > 0.0:
            weights = F.dropout(weights, p=self.dropout)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(n, tgt_len, embed_dim)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)

        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return out, weights if batched else weights.squeeze(0)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}, add_zero_attn={self.add_zero_attn}"
        )


class MultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with separate ``nn.Linear`` projections (traceable by fx).

    Same constructor arguments, forward signature and results as torch's module (to float
    rounding); ``prepare_fx``/``prepare_qat_fx`` swap torch's module for this one with
    :meth:`from_float`. State-dict keys differ: ``q_proj``/``k_proj``/``v_proj`` ``.weight``
    and ``.bias`` instead of ``in_proj_weight``/``in_proj_bias`` (or
    ``q_proj_weight``/...); ``out_proj``, ``bias_k`` and ``bias_v`` keep their names.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise FxQuantError(
                f"MultiheadAttention: embed_dim ({embed_dim}) must be a positive multiple of "
                f"num_heads ({num_heads})"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.bias_k: Tensor | None = None
        self.bias_v: Tensor | None = None
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.zeros(1, 1, embed_dim, device=device, dtype=dtype))
            self.bias_v = nn.Parameter(torch.zeros(1, 1, embed_dim, device=device, dtype=dtype))
        self.attention = AttentionCore(num_heads, dropout, batch_first, add_zero_attn)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        # No Python control flow on the arguments: this forward is traced by torch.fx.
        result = self.attention(
            self.q_proj(query),
            self.k_proj(key),
            self.v_proj(value),
            self.bias_k,
            self.bias_v,
            attn_mask,
            key_padding_mask,
            need_weights,
            average_attn_weights,
            is_causal,
        )
        return self.out_proj(result[0]), result[1]

    @classmethod
    def from_float(cls, mod: nn.MultiheadAttention) -> MultiheadAttention:
        """The equivalent of ``mod``: its parameters split into the four projections.

        ``out_proj``, ``bias_k``, ``bias_v`` and separate ``q/k/v_proj_weight`` parameters are
        shared with ``mod``; slices of the packed ``in_proj_weight``/``in_proj_bias`` are
        copied (a slice cannot be a parameter of its own).
        """
        if not isinstance(mod, nn.MultiheadAttention):
            raise FxQuantError(
                f"MultiheadAttention.from_float expects an nn.MultiheadAttention, got "
                f"{type(mod).__name__}"
            )
        weight = mod.out_proj.weight
        new = cls(
            mod.embed_dim,
            mod.num_heads,
            dropout=mod.dropout,
            bias=mod.in_proj_bias is not None,
            add_bias_kv=mod.bias_k is not None,
            add_zero_attn=mod.add_zero_attn,
            kdim=mod.kdim,
            vdim=mod.vdim,
            batch_first=mod.batch_first,
            device=weight.device,
            dtype=weight.dtype,
        )
        e = mod.embed_dim
        projections = (new.q_proj, new.k_proj, new.v_proj)
        packed: Tensor | None = getattr(mod, "in_proj_weight", None)
        if packed is not None:
            for i, linear in enumerate(projections):
                linear.weight = _copied(packed[i * e : (i + 1) * e])
        else:
            separate = (mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight)
            for linear, w in zip(projections, separate, strict=True):
                linear.weight = w
        if mod.in_proj_bias is not None:
            for i, linear in enumerate(projections):
                linear.bias = _copied(mod.in_proj_bias[i * e : (i + 1) * e])
        new.out_proj.weight = mod.out_proj.weight
        new.out_proj.bias = mod.out_proj.bias
        new.bias_k = mod.bias_k
        new.bias_v = mod.bias_v
        new.train(mod.training)
        return new


def _copied(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
