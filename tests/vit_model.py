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
