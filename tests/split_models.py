"""Small real-shaped models that are not a chain, for the tests of :func:`gpipe.split`.

Each is built float64 and seeded by its ``make_*`` function, which returns the model and the
call that feeds it (positional inputs, keyword inputs). They are the models the tracer was
measured on (``python tests/test_split_tracers.py`` prints the table).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Call = tuple[tuple[Any, ...], dict[str, Any]]


# --- a GPT-2 layout (nanoGPT): tied embedding and head, the causal mask as a kwarg ---------


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if mask is not None:
            att = att.masked_fill(mask[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask=mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 32, context: int = 8, width: int = 16, layers: int = 4):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList(Block(width, 2) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x, mask=mask)
        return self.lm_head(self.ln_f(x))


def make_gpt(layers: int = 4) -> tuple[GPT, Call]:
    torch.manual_seed(0)
    model = GPT(layers=layers).double()
    idx = torch.randint(0, 32, (4, 8))
    mask = torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8)
    return model, ((idx,), {"mask": mask})


# --- a ResNet with BatchNorm ----------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class ResNet(nn.Module):
    def __init__(self, channels: int = 4, blocks: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.layers = nn.Sequential(*(BasicBlock(channels) for _ in range(blocks)))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def make_resnet() -> tuple[ResNet, Call]:
    torch.manual_seed(0)
    return ResNet().double(), ((torch.randn(4, 3, 8, 8, dtype=torch.float64),), {})


# --- a U-Net: long skips across every stage ---------------------------------------------------


def _conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.Tanh())


class UNet(nn.Module):
    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.down1, self.down2, self.down3 = _conv(1, c), _conv(c, 2 * c), _conv(2 * c, 4 * c)
        self.bottom = _conv(4 * c, 4 * c)
        self.up3, self.up2 = _conv(8 * c, 2 * c), _conv(4 * c, c)
        self.up1 = nn.Conv2d(2 * c, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        d3 = self.down3(F.max_pool2d(d2, 2))
        b = self.bottom(d3)
        u3 = self.up3(torch.cat([b, d3], dim=1))
        u2 = self.up2(torch.cat([F.interpolate(u3, scale_factor=2.0), d2], dim=1))
        return self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0), d1], dim=1))


def make_unet() -> tuple[UNet, Call]:
    torch.manual_seed(0)
    return UNet().double(), ((torch.randn(2, 1, 8, 8, dtype=torch.float64),), {})


# --- an encoder-decoder: two inputs, two outputs, the memory crosses the cut ----------------


class CrossBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.cross = nn.MultiheadAttention(width, 2, batch_first=True)
        self.ff = nn.Linear(width, width)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        y = y + self.self_attn(y, y, y, need_weights=False)[0]
        y = y + self.cross(y, memory, memory, need_weights=False)[0]
        return y + torch.tanh(self.ff(y))


class EncoderDecoder(nn.Module):
    def __init__(self, width: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.src_in = nn.Linear(3, width)
        self.tgt_in = nn.Linear(5, width)
        self.encoder = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.decoder = nn.ModuleList(CrossBlock(width) for _ in range(layers))
        self.out = nn.Linear(width, 5)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory = self.src_in(src)
        for layer in self.encoder:
            memory = torch.tanh(layer(memory))
        y = self.tgt_in(tgt)
        for block in self.decoder:
            y = block(y, memory)
        return self.out(y), memory.mean(dim=1)


def make_encoder_decoder() -> tuple[EncoderDecoder, Call]:
    torch.manual_seed(0)
    src = torch.randn(4, 6, 3, dtype=torch.float64)
    tgt = torch.randn(4, 5, 5, dtype=torch.float64)
    return EncoderDecoder().double(), ((src, tgt), {})


# --- an LSTM language model -------------------------------------------------------------------


class LSTMModel(nn.Module):
    def __init__(self, vocab: int = 20, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, (h, _) = self.lstm(self.embed(idx))
        return self.head(torch.tanh(self.proj(out)) + h[-1].unsqueeze(1))


def make_lstm() -> tuple[LSTMModel, Call]:
    torch.manual_seed(0)
    return LSTMModel().double(), ((torch.randint(0, 20, (3, 7)),), {})


# --- a data-dependent `if` ---------------------------------------------------------------------


class Gate(nn.Module):
    """Picks a branch by the sign of the input's sum: no trace can follow both."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.up(x)
        return self.down(x)


class Gated(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.gate = Gate(width)
        self.last = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.gate(torch.tanh(self.first(x)))))


def make_gated() -> tuple[Gated, Call]:
    torch.manual_seed(0)
    return Gated().double(), ((torch.randn(4, 6, dtype=torch.float64),), {})


# --- Hugging Face-style keywords: attention_mask, position_ids, a dict output -----------------


class HFStyle(nn.Module):
    def __init__(self, vocab: int = 32, context: int = 8, width: int = 16, layers: int = 3):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, 2) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        # NOTE: a causal buffer sliced to the length, as GPT-2's `bias`; torch.ones(T, T) of a
        # traced length is what torch.fx cannot follow (the measurement's table shows it)
        self.register_buffer("causal", torch.tril(torch.ones(context, context)))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
        mask = None
        if attention_mask is not None:
            # padding mask (batch, 1, 1, T) and a causal one, combined as 0/1
            length = input_ids.size(1)
            causal = self.causal[:length, :length].to(attention_mask.dtype)
            mask = attention_mask[:, None, None, :] * causal
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            x = block(x, mask=mask)
        x = self.ln_f(x)
        return {"last_hidden_state": x, "pooled": x[:, 0]}


def make_hf_style() -> tuple[HFStyle, Call]:
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 8))
    attention_mask = torch.ones(2, 8, dtype=torch.float64)
    attention_mask[1, 6:] = 0
    position_ids = torch.arange(8).unsqueeze(0).expand(2, 8)
    return HFStyle().double(), (
        (ids,),
        {"attention_mask": attention_mask, "position_ids": position_ids},
    )


MODELS: dict[str, Callable[[], tuple[nn.Module, Call]]] = {
    "gpt (tied, mask kwarg)": make_gpt,
    "resnet (BatchNorm)": make_resnet,
    "unet (long skips)": make_unet,
    "encoder-decoder (2 in, 2 out)": make_encoder_decoder,
    "lstm": make_lstm,
    "data-dependent if": make_gated,
    "hf-style kwargs": make_hf_style,
}
