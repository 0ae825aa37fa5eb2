"""A GPT with GPT-2's module layout: what splitting a Hugging Face-style model looks like.

Not an ``nn.Sequential``: the parameter names are GPT-2's (``transformer.wte``,
``transformer.h.3.attn.c_attn``, ``lm_head``), the head's weight *is* the token embedding's
(a tied parameter used at both ends of the model), and the attention mask is a keyword
input every block reads. Built from our own code with a seed, since no weights can be
downloaded here::

    model = gpt2(GPT2Config(n_layer=4), seed=0)
    logits = model(idx, attention_mask=mask)          # (B, T) -> (B, T, vocab_size)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT2", "GPT2Config", "gpt2"]


@dataclass
class GPT2Config:
    """A tiny GPT-2 (GPT-2 small is ``n_layer=12, n_head=12, n_embd=768``, 50257 tokens).

    ``dropout`` is off by default, so a pipe over any split matches plain training exactly.
    """

    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention under a boolean mask (True: may attend)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # NOTE: unpacked at once: torch.fx follows `q, k, v = t.chunk(3)`, not a generator.
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (z.unflatten(-1, (self.n_head, -1)).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).flatten(2)))


class MLP(nn.Module):
    """Width to 4x width and back, GELU in between."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block; ``x`` is the residual stream it adds to."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    """GPT-2's ``transformer``: embeddings, the blocks ``h``, the final norm ``ln_f``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)


class GPT2(nn.Module):
    """GPT-2's layout: ``transformer.{wte, wpe, drop, h, ln_f}`` and a tied ``lm_head``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # one Parameter, used twice
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` of token ids ``idx`` ``(B, T)``.

        Args:
            idx: token ids, ``T <= block_size``.
            attention_mask: ``(B, T)``, 1 (or True) for tokens, 0 for padding, as Hugging
                Face's; attention is causal either way.
        """
        positions = torch.arange(idx.shape[1], device=idx.device)
        mask = positions[None, :] <= positions[:, None]  # (T, T): causal
        if attention_mask is not None:
            # NOTE: every position may still attend to itself, so a padding position's row
            # is never all masked (a softmax over nothing is NaN).
            itself = positions[None, :] == positions[:, None]
            mask = (mask & attention_mask[:, None, None, :].bool()) | itself  # (B, 1, T, T)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x, mask)
        return self.lm_head(self.transformer.ln_f(x))


def gpt2(config: GPT2Config | None = None, *, seed: int = 0) -> GPT2:
    """A :class:`GPT2` initialised from ``seed`` (the global random state is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2(config or GPT2Config())
