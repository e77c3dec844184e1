"""A BERT-shaped encoder written the way Hugging Face's ``BertModel`` computes it (eager
attention): q/k/v Linears, ``matmul(q, k^T) / sqrt(d) + mask``, ``softmax(dim=-1)``,
``matmul(p, v)``, output Linear, ``LayerNorm(x + residual)``, GELU feed-forward; the additive
mask is ``(1 - attention_mask) * finfo.min`` broadcast as ``[B, 1, 1, S]``. Traceable by
torch.fx as written (no data-dependent control flow)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.act = nn.GELU()
        self.output = nn.Linear(intermediate, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)

    def _heads(self, t: torch.Tensor, b: int, s: int) -> torch.Tensor:
        return t.view(b, s, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self._heads(self.query(x), b, s)
        k = self._heads(self.key(x), b, s)
        v = self._heads(self.value(x), b, s)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = F.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous().view(b, s, h)
        x = self.attention_norm(self.attention_output(ctx) + x)
        out: torch.Tensor = self.output_norm(self.output(self.act(self.intermediate(x))) + x)
        return out


class BertEncoder(nn.Module):
    """``layers`` BertLayers over embeddings ``x`` [B, S, hidden] with ``attention_mask``
    [B, S] (1 = token, 0 = padding)."""

    def __init__(
        self, layers: int = 6, hidden: int = 384, heads: int = 12, intermediate: int = 1536
    ) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hidden, heads, intermediate) for _ in range(layers))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(torch.float32).min
        for layer in self.layer:
            x = layer(x, mask)
        return x


def encoder_inputs(
    batch: int, seq: int = 128, hidden: int = 384, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings-like input and a padding mask (sequence lengths spread over [seq/4, seq])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hidden, generator=g)
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.float32)
    return x, mask
