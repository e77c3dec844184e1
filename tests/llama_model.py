"""A decoder written the way Hugging Face transformers writes ``LlamaForCausalLM``.

transformers is not installed in the test environment, so the parts that matter to
weight-only quantization are rebuilt here: module names as in the real model
(``model.embed_tokens``, ``model.layers.N.self_attn.q_proj`` ... ``o_proj``,
``mlp.gate_proj`` / ``up_proj`` / ``down_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``model.norm``, ``lm_head``), RMSNorm, rotary position
embeddings, grouped-query attention, a key/value cache that ``generate`` extends one token at
a time, and greedy or sampled decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Cache = list[tuple[Tensor, Tensor]]


@dataclass
class LlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0


class LlamaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        inv = 1.0 / config.rope_theta ** (torch.arange(0, self.head_dim, 2) / self.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: Tensor, start: int, past: tuple[Tensor, Tensor] | None) -> tuple[
        Tensor, tuple[Tensor, Tensor]
    ]:  # fmt: skip
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        positions = torch.arange(start, start + length, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        repeat = self.heads // self.kv_heads
        keys, values = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = q @ keys.transpose(-1, -2) / math.sqrt(self.head_dim)
        total = keys.shape[2]
        causal = torch.ones(length, total, dtype=torch.bool).tril(diagonal=total - length)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        out = (scores.softmax(-1) @ values).transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out), (k, v)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, start: int, past: tuple[Tensor, Tensor] | None) -> tuple[
        Tensor, tuple[Tensor, Tensor]
    ]:  # fmt: skip
        attended, cache = self.self_attn(self.input_layernorm(x), start, past)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for p in self.parameters():  # as Hugging Face's init: normal(0, 0.02), norms at 1
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(
        self, input_ids: Tensor, past_key_values: Cache | None = None
    ) -> tuple[Tensor, Cache]:
        """Logits ``[batch, length, vocab]`` and the cache extended by these tokens."""
        start = 0 if not past_key_values else past_key_values[0][0].shape[2]
        x = self.model.embed_tokens(input_ids)
        cache: Cache = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, start, past_key_values[i] if past_key_values else None)
            cache.append(kv)
        return self.lm_head(self.model.norm(x)), cache

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """``input_ids`` followed by ``max_new_tokens`` tokens, each from the logits of the
        last position (greedy, or sampled at ``temperature`` from the ``top_k`` best)."""
        logits, cache = self(input_ids)
        tokens = input_ids
        for _ in range(max_new_tokens):
            last = logits[:, -1, :]
            if do_sample:
                last = last / temperature
                if top_k is not None:
                    kth = torch.topk(last, top_k).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                token = torch.multinomial(last.softmax(-1), 1, generator=generator)
            else:
                token = last.argmax(-1, keepdim=True)
            tokens = torch.cat((tokens, token), dim=1)
            logits, cache = self(token, cache)
        return tokens
