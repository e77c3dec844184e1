"""A BERT-style encoder written the Hugging Face way (random init), and its token batches.

BertSelfAttention with the extended attention mask ``(1 - mask[:, None, None, :]) *
torch.finfo(dtype).min`` added to the scores, a GELU feed-forward, ``LayerNorm(x + residual)``
after each block, and mean pooling over the real tokens. ``outliers`` scales a few hidden
channels of the embeddings up (and the weights reading them down after each LayerNorm), as
real pretrained transformers have them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class BertSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_size = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def _split(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor) -> Tensor:
        q = self._split(self.query(hidden_states))
        k = self._split(self.key(hidden_states))
        v = self._split(self.value(hidden_states))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(self.head_size)
        scores = scores + attention_mask
        probs = nn.functional.softmax(scores, dim=-1)
        context = torch.matmul(probs, v)
        b, _, s, _ = context.shape
        return context.permute(0, 2, 1, 3).reshape(b, s, self.heads * self.head_size)


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.attention = BertSelfAttention(hidden, heads)
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.act = nn.GELU()
        self.output = nn.Linear(intermediate, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        a = self.attention_output(self.attention(x, attention_mask))
        x = self.attention_norm(a + x)
        h = self.output(self.act(self.intermediate(x)))
        return self.output_norm(h + x)


class BertEncoder(nn.Module):
    """input_ids [B, S] int64, attention_mask [B, S] (1 real, 0 padding) -> pooled [B, H]."""

    def __init__(
        self,
        vocab: int = 1000,
        hidden: int = 64,
        heads: int = 4,
        intermediate: int = 256,
        layers: int = 2,
        max_len: int = 64,
    ) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_len, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(hidden, heads, intermediate) for _ in range(layers))
        self.dtype = torch.float32

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_norm(self.word(input_ids) + self.position(positions))
        # as transformers' get_extended_attention_mask (dtype: the model's, fixed so fx traces)
        extended = attention_mask[:, None, None, :].to(self.dtype)
        extended = (1.0 - extended) * torch.finfo(self.dtype).min
        for layer in self.layers:
            x = layer(x, extended)
        weights = attention_mask.to(self.dtype).unsqueeze(-1)
        return (x * weights).sum(1) / weights.sum(1)


def add_outliers(
    model: BertEncoder, channels: tuple[int, ...] = (3, 17), factor: float = 30.0
) -> None:
    """Make a few hidden channels large after every LayerNorm but the last (its weight and
    bias scaled up) and scale down the q/k/v and intermediate weights reading them: the
    Linears' inputs get outlier channels, as in pretrained transformers, while the pooled
    output stays on the last LayerNorm's ordinary scale."""
    idx = list(channels)
    with torch.no_grad():
        norms = [model.embed_norm] + [
            n for layer in model.layers for n in (layer.attention_norm, layer.output_norm)
        ]
        norms = norms[:-1]
        for norm in norms:
            norm.weight[idx] *= factor
            norm.bias[idx] *= factor
        for layer in model.layers:
            for linear in (
                layer.attention.query,
                layer.attention.key,
                layer.attention.value,
                layer.intermediate,
            ):
                linear.weight[:, idx] /= factor


def token_batches(
    count: int, batch: int = 4, seq: int = 32, vocab: int = 1000, seed: int = 0
) -> list[tuple[Tensor, Tensor]]:
    """Random token ids with random padding lengths (at least 4 real tokens per row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        lengths = torch.randint(4, seq + 1, (batch,), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.int64)
        out.append((ids * mask, mask))
    return out
