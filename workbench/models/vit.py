"""A tiny Vision Transformer for scikit-learn's 8 x 8 digits (used by 02's quantized-ViT check).

Pre-norm blocks (multi-head attention, GELU MLP), a class token and learned positions: the
architecture of Dosovitskiy et al. 2021 at toy size.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["TinyViT", "ViTBlock", "block_linears", "accuracy"]


class TinyViT(nn.Module):
    """Pre-norm ViT for 8 x 8 digits: 2 x 2 patches (16 tokens), a class token, learned
    positions, ``depth`` blocks of multi-head attention and a GELU MLP, a linear head."""

    def __init__(self, dim: int = 32, depth: int = 2, heads: int = 2, mlp: int = 64,
                 patch: int = 2, n_classes: int = 10):
        super().__init__()
        self.patch, n_tok = patch, (8 // patch) ** 2
        self.embed = nn.Linear(patch * patch, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n_tok + 1, dim) * 0.02)
        self.layers = nn.ModuleList([ViTBlock(dim, heads, mlp) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x):                         # x: (B, 8, 8) or (B, 64), in [0, 1]
        B, p = x.shape[0], self.patch
        t = x.reshape(B, 8 // p, p, 8 // p, p).permute(0, 1, 3, 2, 4).reshape(B, -1, p * p)
        h = torch.cat([self.cls.expand(B, -1, -1), self.embed(t)], 1) + self.pos
        for blk in self.layers:
            h = blk(h)
        return self.head(self.norm(h[:, 0]))


class ViTBlock(nn.Module):
    def __init__(self, dim, heads, mlp):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, h):
        B, T, D = h.shape
        q, k, v = self.qkv(self.n1(h)).reshape(B, T, 3, self.heads, D // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        h = h + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return h + self.fc2(nn.functional.gelu(self.fc1(self.n2(h))))


def block_linears(model: TinyViT) -> dict[str, nn.Linear]:
    """The block linears of the ViT (what a quantizer replaces; patch embedding and head stay fp)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.startswith("layers.")}


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)``, in batches, without gradients."""
    with torch.no_grad():
        pred = torch.cat([model(x[i: i + batch]).argmax(-1) for i in range(0, len(x), batch)])
    return float((pred == y).float().mean())
