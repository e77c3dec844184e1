"""A BERT-style encoder written the Hugging Face way (random init), and its token batches.

BertSelfAttention with the extended attention mask ``(1 - mask[:, None, None, :]) *
torch.finfo(dtype).min`` added to the scores, a GELU feed-forward, ``LayerNorm(x + residual)``
after each block, and mean pooling over the real tokens. ``add_outliers`` scales a few hidden
channels of the embeddings up (and the weights reading them down after each LayerNorm).
``add_trained_outliers`` gives an encoder (this one or transformers' ``BertModel``) the
activation statistics of a trained one, which is what static quantization depends on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class EncoderBlock:
    """The parts of one post-norm encoder layer that ``add_trained_outliers`` changes."""

    query: nn.Linear
    key: nn.Linear
    value: nn.Linear
    attention_output: nn.Linear
    attention_norm: nn.LayerNorm
    intermediate: nn.Linear
    output: nn.Linear
    output_norm: nn.LayerNorm


def zoo_parts(model: BertEncoder) -> tuple[nn.LayerNorm, nn.Embedding, list[EncoderBlock]]:
    """(embedding LayerNorm, position embeddings, blocks) of this module's encoder."""
    blocks = [
        EncoderBlock(
            layer.attention.query,
            layer.attention.key,
            layer.attention.value,
            layer.attention_output,
            layer.attention_norm,
            layer.intermediate,
            layer.output,
            layer.output_norm,
        )
        for layer in model.layers
    ]
    return model.embed_norm, model.position, blocks


def hf_bert_parts(bert: Any) -> tuple[nn.LayerNorm, nn.Embedding, list[EncoderBlock]]:
    """The same parts of a transformers ``BertModel``."""
    blocks = [
        EncoderBlock(
            layer.attention.self.query,
            layer.attention.self.key,
            layer.attention.self.value,
            layer.attention.output.dense,
            layer.attention.output.LayerNorm,
            layer.intermediate.dense,
            layer.output.dense,
            layer.output.LayerNorm,
        )
        for layer in bert.encoder.layer
    ]
    return bert.embeddings.LayerNorm, bert.embeddings.position_embeddings, blocks


def _norm_input_stats(
    model: nn.Module, norm: nn.LayerNorm, batches: Sequence[tuple[Any, ...]]
) -> Tensor:
    """Per-channel robust spread of ``norm``'s normalized input over ``batches``
    (the median magnitude / 0.6745: the standard deviation of a normal channel, unmoved by
    the few tokens that are outliers)."""
    seen: list[Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, unbiased=False, keepdim=True)
        seen.append((x - mean) / torch.sqrt(var + norm.eps))

    handle = norm.register_forward_pre_hook(hook)
    with torch.no_grad():
        for batch in batches:
            model(*batch)
    handle.remove()
    return torch.cat(seen).abs().median(0).values / 0.6745


def _output_std(model: nn.Module, linear: nn.Linear, batches: Sequence[tuple[Any, ...]]) -> float:
    seen: list[Tensor] = []
    handle = linear.register_forward_hook(lambda m, a, out: seen.append(out.detach().flatten()))
    with torch.no_grad():
        for batch in batches:
            model(*batch)
    handle.remove()
    return float(torch.cat(seen).std())


def add_trained_outliers(
    model: nn.Module,
    parts: tuple[nn.LayerNorm, nn.Embedding, list[EncoderBlock]],
    batches: Sequence[tuple[Any, ...]],
    *,
    dims: int | None = None,
    magnitude: float = 20.0,
    massive: float = 200.0,
    attention_spread: float = 3.0,
    seed: int = 0,
) -> list[int]:
    """Give a random-init post-norm encoder (BERT) the activation statistics of a trained
    one, in place; returns the outlier dimensions. ``parts``: ``zoo_parts(model)`` or
    ``hf_bert_parts(model)``; ``batches``: inputs of ``model`` (its statistics are settled on
    them, as BN statistics are on data).

    What the literature reports of trained BERTs (Kovaleva et al. 2021, "BERT Busters";
    Bondarenko et al. 2021; Dettmers et al. 2022, LLM.int8(); Sun et al. 2024, "Massive
    activations"), built here:

    * outlier dimensions: a few hidden channels (``dims``, default 1 in 128) where every
      LayerNorm but the last has a large weight and bias, so its output (the input of q, k, v
      and the feed-forward) carries them at ~``magnitude`` times the other channels, on every
      token; the Linears reading them have small weights there;
    * massive activations: the first token (``[CLS]``, the attention sink) gets one more
      dimension of size ``massive`` from its position embedding; in every layer one
      feed-forward neuron fires only on it (a GELU output of ~``massive``) and writes it back
      into the residual stream through the output projection, so the FFN's inner activation
      and output are hundreds of times larger on that token than on the others;
    * FFN outlier neurons: a few intermediate neurons (1 in 256) with larger outputs;
    * peaked attention: query and key scaled so the scores spread over ~``attention_spread``.

    Each LayerNorm is then settled on ``batches`` so that its ordinary channels come out at
    unit scale (the last one's every channel: the model's output is on an ordinary scale).
    """
    first_norm, positions, blocks = parts
    hidden = first_norm.normalized_shape[0]
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(hidden, generator=g).tolist()
    count = max(2, hidden // 128) if dims is None else dims
    outliers, sink_dim = order[:count], order[count]
    signs = torch.where(torch.rand(count, generator=g) < 0.5, -1.0, 1.0)

    def settle(norm: nn.LayerNorm, last: bool) -> None:
        spread = _norm_input_stats(model, norm, batches).clamp(min=1e-6)
        target = torch.ones(hidden, dtype=torch.float64)
        if not last:
            target[outliers] = magnitude
        target[sink_dim] = spread[sink_dim]  # the sink's dimension keeps its raw size
        with torch.no_grad():
            norm.weight.copy_((target / spread).to(norm.weight.dtype))
            norm.bias.zero_()
            if not last:
                norm.bias[outliers] = (0.8 * magnitude * signs).to(norm.bias.dtype)

    with torch.no_grad():
        positions.weight[0, sink_dim] += massive
        for block in blocks:
            inter = block.intermediate.out_features
            neurons = torch.randperm(inter, generator=g)[: max(2, inter // 256)]
            block.intermediate.weight[neurons] *= 6.0
            block.intermediate.bias[neurons] = 3.0
            block.output.weight[:, neurons] /= 3.0
            block.output.weight[outliers] *= 8.0
            block.output.bias[outliers] = 4.0 * signs
            for linear in (block.query, block.key, block.value, block.intermediate):
                linear.weight[:, outliers] /= magnitude / 2
    settle(first_norm, last=False)
    for i, block in enumerate(blocks):
        factor = (attention_spread / (
            _output_std(model, block.query, batches) * _output_std(model, block.key, batches)
        )) ** 0.5  # fmt: skip
        with torch.no_grad():
            for linear in (block.query, block.key):
                linear.weight *= factor
                linear.bias *= factor
        settle(block.attention_norm, last=False)
        _add_sink_neuron(model, block, sink_dim, massive, batches, g)
        settle(block.output_norm, last=i == len(blocks) - 1)
    return outliers


def _add_sink_neuron(
    model: nn.Module,
    block: EncoderBlock,
    sink_dim: int,
    massive: float,
    batches: Sequence[tuple[Any, ...]],
    g: torch.Generator,
) -> None:
    """One FFN neuron that fires (~``massive``) only on the first token, from ``sink_dim`` of
    the attention block's LayerNorm output, and writes twice that into ``sink_dim``."""
    seen: list[Tensor] = []
    handle = block.attention_norm.register_forward_hook(
        lambda m, a, out: seen.append(out.detach()[..., sink_dim])
    )
    with torch.no_grad():
        for batch in batches:
            model(*batch)
    handle.remove()
    values = torch.cat(seen)  # [batch, tokens]
    sink, others = float(values[:, 0].min()), float(values[:, 1:].abs().max())
    neuron = int(torch.randint(block.intermediate.out_features, (1,), generator=g))
    w = massive / max(sink - others, 1e-3)
    with torch.no_grad():
        block.intermediate.weight[neuron] = 0.0
        block.intermediate.weight[neuron, sink_dim] = w
        block.intermediate.bias[neuron] = -others * w
        block.output.weight[:, neuron] = 0.0
        block.output.weight[sink_dim, neuron] = 2.0
