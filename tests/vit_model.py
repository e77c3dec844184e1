"""A Vision Transformer written the way torchvision writes ``vit_b_16``.

Module names and structure as in ``torchvision.models.vision_transformer``: ``conv_proj`` (the
patch embedding, a strided conv), ``class_token``, ``encoder.pos_embedding``,
``encoder.layers.encoder_layer_N`` with ``ln_1``, ``self_attention`` (``nn.MultiheadAttention``,
batch first), ``ln_2`` and ``mlp`` (Linear, GELU, Dropout, Linear, Dropout), ``encoder.ln`` and
``heads.head``; pre-norm blocks, the class token's output classified. Weights are initialised
as torchvision does (the class token zero, the heads randomly, so the logits are not zero).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import Tensor, nn


class MLPBlock(nn.Sequential):
    def __init__(self, dim: int, mlp_dim: int, dropout: float) -> None:
        super().__init__(
            nn.Linear(dim, mlp_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_dim, dim),
            nn.Dropout(dropout),
        )
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.normal_(m.bias, std=1e-6)


class EncoderBlock(nn.Module):
    def __init__(self, heads: int, dim: int, mlp_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLPBlock(dim, mlp_dim, dropout)

    def forward(self, input: Tensor) -> Tensor:
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x)
        x = x + input
        y = self.ln_2(x)
        y = self.mlp(y)
        return x + y


class Encoder(nn.Module):
    def __init__(self, seq: int, layers: int, heads: int, dim: int, mlp_dim: int) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(
            OrderedDict(
                (f"encoder_layer_{i}", EncoderBlock(heads, dim, mlp_dim)) for i in range(layers)
            )
        )
        self.ln = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, input: Tensor) -> Tensor:
        input = input + self.pos_embedding
        out: Tensor = self.ln(self.layers(self.dropout(input)))
        return out


class VisionTransformer(nn.Module):
    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        layers: int = 12,
        heads: int = 12,
        dim: int = 768,
        mlp_dim: int = 3072,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.image_size, self.patch_size, self.hidden_dim = image_size, patch_size, dim
        self.conv_proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        seq = (image_size // patch_size) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = Encoder(seq, layers, heads, dim, mlp_dim)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(dim, num_classes)))
        fan_in = 3 * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)

    def _process_input(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        p = self.patch_size
        grid = self.image_size // p
        x = self.conv_proj(x)  # [n, dim, grid, grid]
        x = x.reshape(n, self.hidden_dim, grid * grid)
        return x.permute(0, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self._process_input(x)
        n = x.shape[0]
        batch_class_token = self.class_token.expand(n, -1, -1)
        x = torch.cat([batch_class_token, x], dim=1)
        x = self.encoder(x)
        out: Tensor = self.heads(x[:, 0])
        return out


def add_trained_statistics(
    model: VisionTransformer,
    *,
    dims: int | None = None,
    magnitude: float = 20.0,
    channel_spread: float = 0.6,
    massive: float = 100.0,
    neuron_gain: float = 6.0,
    attention_spread: float = 3.0,
    seed: int = 0,
) -> list[int]:
    """Give a random-init ViT the activation statistics of a trained one, in place; returns
    the outlier dimensions.

    What the literature reports of trained ViTs (Yuan et al. 2022, PTQ4ViT; Li et al. 2023,
    RepQ-ViT; Lin et al. 2022, FQ-ViT; Darcet et al. 2024, "Vision transformers need
    registers"; Sun et al. 2024, "Massive activations"), built here:

    * the LayerNorm outputs vary widely between channels: each LayerNorm of a block has a
      log-normal weight (``channel_spread``: its sigma) and, on a few outlier dimensions
      (``dims``, default 1 in 128), a weight and bias ~``magnitude`` times the others; the
      projections reading them have small weights there;
    * massive activations: the class token carries one dimension of size ``massive`` in the
      residual stream (the final LayerNorm gives that dimension a small weight);
    * FFN outlier neurons: a few hidden neurons (1 in 256) whose GELU outputs are
      ~``neuron_gain`` times larger, so the second Linear's input has a long tail;
    * peaked attention: queries and keys scaled so the scores spread over ~``attention_spread``.
    """
    g = torch.Generator().manual_seed(seed)
    hidden = model.hidden_dim
    order = torch.randperm(hidden, generator=g).tolist()
    count = max(2, hidden // 128) if dims is None else dims
    outliers, sink_dim = order[:count], order[count]
    signs = torch.where(torch.rand(count, generator=g) < 0.5, -1.0, 1.0)
    blocks = [b for b in model.encoder.layers if isinstance(b, EncoderBlock)]
    with torch.no_grad():
        model.class_token[0, 0, sink_dim] = massive
        model.encoder.ln.weight[sink_dim] = 1.0 / massive
        for block in blocks:
            for norm in (block.ln_1, block.ln_2):
                norm.weight.copy_(torch.empty(hidden).log_normal_(0.0, channel_spread, generator=g))
                norm.weight[outliers] = magnitude
                norm.bias.zero_()
                norm.bias[outliers] = 0.8 * magnitude * signs
            attention = block.self_attention
            fc1, fc2 = block.mlp[0], block.mlp[3]
            assert isinstance(fc1, nn.Linear)
            assert isinstance(fc2, nn.Linear)
            attention.in_proj_weight[:, outliers] /= magnitude / 2
            fc1.weight[:, outliers] /= magnitude / 2
            count_neurons = max(2, fc1.out_features // 256)
            neurons = torch.randperm(fc1.out_features, generator=g)[:count_neurons]
            fc1.weight[neurons] *= neuron_gain
            fc1.bias[neurons] = 3.0
            fc2.weight[:, neurons] /= neuron_gain / 2
    for block in blocks:
        _peak_attention(model, block, attention_spread)
    return outliers


def _peak_attention(model: VisionTransformer, block: EncoderBlock, spread: float) -> None:
    """Scale the block's query and key projections so its attention scores spread over
    ~``spread`` (measured on one random image)."""
    seen: list[Tensor] = []
    handle = block.ln_1.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    image = torch.randn(
        1, 3, model.image_size, model.image_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        model(image)
    handle.remove()
    attention = block.self_attention
    dim, heads = model.hidden_dim, attention.num_heads
    w, b = attention.in_proj_weight, attention.in_proj_bias
    assert b is not None
    with torch.no_grad():
        q = (seen[0] @ w[:dim].T + b[:dim]).reshape(-1, heads, dim // heads)
        k = (seen[0] @ w[dim : 2 * dim].T + b[dim : 2 * dim]).reshape(-1, heads, dim // heads)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(dim // heads)
        factor = (spread / float(scores.std())) ** 0.5
        w[: 2 * dim] *= factor
        b[: 2 * dim] *= factor
