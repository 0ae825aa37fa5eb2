"""An encoder-decoder transformer: two inputs, two outputs, a memory read across the cut.

The encoder reads ``src``; every decoder block reads ``tgt``'s stream and, through
cross-attention, the encoder's output (the *memory*). Cut between encoder and decoder
blocks, the memory is made on one stage and read by every decoder stage. Two outputs: the
decoder's next-token logits, and an auxiliary head on the memory that reconstructs ``src``
(a second loss term, so both outputs carry gradient)::

    model = seq2seq(Seq2SeqConfig(), seed=0)
    logits, src_logits = model(src, tgt)      # (B, S), (B, T) -> (B, T, V), (B, S, V)
    loss = seq2seq_loss((logits, src_logits), (tgt_targets, src))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Seq2Seq", "Seq2SeqConfig", "seq2seq", "seq2seq_loss"]


@dataclass
class Seq2SeqConfig:
    """A tiny translation model: encoder and decoder blocks, shared width and heads."""

    vocab_size: int = 64
    block_size: int = 32
    n_encoder: int = 2
    n_decoder: int = 2
    n_head: int = 4
    n_embd: int = 32


class Attention(nn.Module):
    """Multi-head attention of ``x`` over ``context`` (``x`` itself for self-attention)."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.q = nn.Linear(config.n_embd, config.n_embd)
        self.kv = nn.Linear(config.n_embd, 2 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, context: torch.Tensor, causal: bool) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (self.n_head, -1)).transpose(1, 2)
        k, v = self.kv(context).chunk(2, dim=-1)
        k, v = (z.unflatten(-1, (self.n_head, -1)).transpose(1, 2) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.proj(y.transpose(1, 2).flatten(2))


def _mlp(config: Seq2SeqConfig) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(config.n_embd, 4 * config.n_embd),
        nn.GELU(),
        nn.Linear(4 * config.n_embd, config.n_embd),
    )


class EncoderBlock(nn.Module):
    """Bidirectional self-attention, then an MLP (pre-norm)."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = _mlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, causal=False)
        return x + self.mlp(self.ln_2(x))


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention over the memory, then an MLP (pre-norm)."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.self_attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.cross_attn = Attention(config)
        self.ln_3 = nn.LayerNorm(config.n_embd)
        self.mlp = _mlp(config)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.self_attn(h, h, causal=True)
        x = x + self.cross_attn(self.ln_2(x), memory, causal=False)
        return x + self.mlp(self.ln_3(x))


class Seq2Seq(nn.Module):
    """``src_embed``, ``tgt_embed``, ``pos_embed``, ``encoder``, ``decoder`` (ModuleLists),
    ``ln_memory``, ``ln_f``, ``lm_head``, ``aux_head``."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        self.src_embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.tgt_embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_embed = nn.Embedding(config.block_size, config.n_embd)
        self.encoder = nn.ModuleList(EncoderBlock(config) for _ in range(config.n_encoder))
        self.ln_memory = nn.LayerNorm(config.n_embd)
        self.decoder = nn.ModuleList(DecoderBlock(config) for _ in range(config.n_decoder))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.aux_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, src_logits)``: next-token logits ``(B, T, V)`` of the target, and the
        auxiliary reconstruction of the source ``(B, S, V)``."""
        x = self.src_embed(src) + self.pos_embed(torch.arange(src.shape[1], device=src.device))
        for block in self.encoder:
            x = block(x)
        memory = self.ln_memory(x)
        y = self.tgt_embed(tgt) + self.pos_embed(torch.arange(tgt.shape[1], device=tgt.device))
        for block in self.decoder:
            y = block(y, memory)
        return self.lm_head(self.ln_f(y)), self.aux_head(memory)


def seq2seq(config: Seq2SeqConfig | None = None, *, seed: int = 0) -> Seq2Seq:
    """A :class:`Seq2Seq` initialised from ``seed`` (the global random state is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Seq2Seq(config or Seq2SeqConfig())


def seq2seq_loss(
    outputs: tuple[torch.Tensor, torch.Tensor],
    targets: tuple[torch.Tensor, torch.Tensor],
    aux_weight: float = 0.5,
) -> torch.Tensor:
    """Cross-entropy of the target tokens plus ``aux_weight`` times that of the source's.

    Args:
        outputs: the model's ``(logits, src_logits)``.
        targets: ``(tgt_targets, src)``: the next target tokens, and the source itself.
    """
    logits, src_logits = outputs
    tgt_targets, src = targets
    main = F.cross_entropy(logits.flatten(0, 1), tgt_targets.flatten())
    return main + aux_weight * F.cross_entropy(src_logits.flatten(0, 1), src.flatten())
