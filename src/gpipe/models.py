"""Example models as nn.Sequential: an MLP, and a tiny GPT for the demo and benchmarks."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "GPTConfig",
    "SleepLayer",
    "delay",
    "gpt",
    "gpt_loss",
    "mlp",
    "sleep_stages",
    "synthetic_tokens",
]


def mlp(layers: int = 16, width: int = 256) -> nn.Sequential:
    """``layers`` blocks of Linear + GELU, all ``width`` wide."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


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


class _Delay(torch.autograd.Function):
    """Identity that sleeps ``forward`` seconds on the way in, ``backward`` on the way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: float, backward: float) -> torch.Tensor:
        ctx.backward = backward
        if forward:
            time.sleep(forward)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.backward:
            time.sleep(ctx.backward)
        return grad, None, None


def delay(x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
    """``x`` unchanged, after sleeping ``forward_s``; its gradient sleeps ``backward_s``.

    The building block of latency layers: time that passes like an accelerator kernel's,
    releasing the GIL, without using the CPU.
    """
    return _Delay.apply(x, forward_s, backward_s)


class SleepLayer(nn.Module):
    """A stage of known latency: forward F ms, input gradient B ms, weight gradient W ms.

    The input and weight gradients sit on separate branches of the graph, so a schedule that
    splits them (zero-bubble) pays B and W separately, and one that does not pays B + W.
    When the input needs no gradient (the first stage), B moves onto the weight branch, so
    every stage's backward costs B + W and the ideal step time is the textbook one.
    Sleeping releases the GIL, as real kernels do, so stages overlap even on one core.
    """

    def __init__(self, forward_ms: float, backward_ms: float, weight_ms: float = 0.0) -> None:
        super().__init__()
        self.forward_s = forward_ms / 1000
        self.backward_s = backward_ms / 1000
        self.weight_s = weight_ms / 1000
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        needs_grad = x.requires_grad and torch.is_grad_enabled()
        delayed = delay(x, self.forward_s, self.backward_s if needs_grad else 0.0)
        weight_s = self.weight_s + (0.0 if needs_grad else self.backward_s)
        return delayed + delay(self.weight, 0.0, weight_s)


def sleep_stages(
    stages: int, forward_ms: float, backward_ms: float, weight_ms: float = 0.0
) -> nn.Sequential:
    """``stages`` :class:`SleepLayer` s in an nn.Sequential, one per stage."""
    return nn.Sequential(*[SleepLayer(forward_ms, backward_ms, weight_ms) for _ in range(stages)])
