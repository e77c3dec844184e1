"""A BERT encoder written the way Hugging Face transformers writes ``BertModel``.

transformers is not installed in the test environment, so the parts that matter to
quantization are rebuilt here: module names as in ``BertModel`` (``embeddings``,
``encoder.layer.N.attention.self.query``, ``...intermediate.dense``, ``pooler``), an
attention mask extended to ``(1 - mask) * finfo.min`` and added to the scores, GELU in a
separate activation module, ``LayerNorm(dense(x) + residual)``, dropout everywhere, a
dict-like output, and a decorator on ``forward`` that fills in defaults with Python control
flow on the inputs - which ``torch.fx.symbolic_trace`` cannot follow, as with the real model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class BertConfig:
    vocab_size: int = 1000
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 256
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02


class GELUActivation(nn.Module):
    """transformers keeps its activations in its own module classes."""

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.gelu(x)


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer(
            "position_ids", torch.arange(config.max_position_embeddings).unsqueeze(0),
            persistent=False,
        )  # fmt: skip

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        seq_length = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_length]
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def _heads(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.num_attention_heads, self.attention_head_size).transpose(
            1, 2
        )

    def forward(self, hidden_states: Tensor, attention_mask: Tensor) -> Tensor:
        query = self._heads(self.query(hidden_states))
        key = self._heads(self.key(hidden_states))
        value = self._heads(self.value(hidden_states))
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        scores = scores + attention_mask
        probs = self.dropout(nn.functional.softmax(scores, dim=-1))
        context = torch.matmul(probs, value).permute(0, 2, 1, 3).contiguous()
        return context.view(context.shape[0], context.shape[1], self.all_head_size)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor) -> Tensor:
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = GELUActivation()

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor) -> Tensor:
        attention_output = self.attention(hidden_states, attention_mask)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: Tensor, attention_mask: Tensor) -> Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states, attention_mask)
        return hidden_states


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


def fill_model_inputs(
    forward: Callable[..., dict[str, Tensor]],
) -> Callable[..., dict[str, Tensor]]:
    """Default the optional inputs and check them, as transformers' decorators do.

    The check branches on an input's shape in Python, so symbolic tracing fails here, at the
    root; torch.export follows it (it becomes a bound on the dynamic sequence length).
    """

    @functools.wraps(forward)
    def wrapper(
        self: BertModel,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds the "
                f"{self.config.max_position_embeddings} positions of the model"
            )
        return forward(self, input_ids, attention_mask, token_type_ids)

    return wrapper


class BertModel(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)

    def get_extended_attention_mask(self, attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
        extended = attention_mask[:, None, None, :].to(dtype)
        return (1.0 - extended) * torch.finfo(dtype).min

    @fill_model_inputs
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        assert attention_mask is not None  # the decorator fills both in
        assert token_type_ids is not None
        embedding_output = self.embeddings(input_ids, token_type_ids)
        mask = self.get_extended_attention_mask(attention_mask, embedding_output.dtype)
        sequence_output = self.encoder(embedding_output, mask)
        return {
            "last_hidden_state": sequence_output,
            "pooler_output": self.pooler(sequence_output),
        }


def token_batch(config: BertConfig, batch: int, seq: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random token ids with right padding (id 0), and the matching attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=g)
    lengths = torch.randint(max(1, seq // 2), seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def pooled(output: dict[str, Any], mask: Tensor) -> Tensor:
    """Mean of the last hidden state over the unmasked tokens (sentence embeddings)."""
    hidden = output["last_hidden_state"]
    weights = mask[:, :, None].to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1)
