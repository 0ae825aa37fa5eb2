"""A tiny GPT as an nn.Sequential (nanoGPT-style), and a task for it with nothing to download."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from gpipe.generation.cache import DecodeStep, LayerCache

__all__ = ["GPTConfig", "gpt", "gpt_loss", "synthetic_tokens"]


@dataclass
class GPTConfig:
    """A tiny GPT: small enough for a laptop CPU, shaped like the real thing."""

    vocab: int = 64
    context: int = 32
    layers: int = 8
    heads: int = 4
    width: int = 64
    dropout: float = 0.1


class Embedding(nn.Module):
    """Token plus learned position embeddings: (B, T) ids -> (B, T, width)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.dropout(self.token(ids) + self.position(positions))

    def forward_cached(
        self, ids: torch.Tensor, cache: LayerCache, step: DecodeStep
    ) -> torch.Tensor:
        """The new tokens' embeddings at their positions (``pipe.generate``'s protocol)."""
        return self.dropout(self.token(ids) + self.position(step.positions))


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.norm2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width),
            nn.GELU(),
            nn.Linear(4 * config.width, config.width),
        )
        self.dropout = nn.Dropout(config.dropout)
        self.attn_dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.attn_dropout if self.training else 0.0
        )
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, t, c)))
        return x + self.dropout(self.mlp(self.norm2(x)))

    def forward_cached(self, x: torch.Tensor, cache: LayerCache, step: DecodeStep) -> torch.Tensor:
        """The new tokens' output, attending to every earlier token through ``cache``
        (``pipe.generate``'s protocol, see :mod:`gpipe.generation.programs`)."""
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        k, v = cache.update(k, v)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask(q.dtype))
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, t, c)))
        return x + self.dropout(self.mlp(self.norm2(x)))


def gpt(config: GPTConfig | None = None) -> nn.Sequential:
    """A tiny GPT as an nn.Sequential: embedding, ``layers`` blocks, norm, head."""
    config = config or GPTConfig()
    model = nn.Sequential(
        Embedding(config),
        *[Block(config) for _ in range(config.layers)],
        nn.LayerNorm(config.width),
        nn.Linear(config.width, config.vocab, bias=False),
    )
    for name, param in model.named_parameters():
        if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
            nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.layers))
    return model


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over every position."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_tokens(
    batch: int, config: GPTConfig, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task with nothing to download: each sequence counts up by its own step.

    Returns ``(ids, targets)``, targets being ids shifted left by one.
    """
    start = torch.randint(0, config.vocab, (batch, 1), generator=generator)
    step = torch.randint(1, 4, (batch, 1), generator=generator)
    seq = (start + step * torch.arange(config.context + 1)) % config.vocab
    return seq[:, :-1], seq[:, 1:]
