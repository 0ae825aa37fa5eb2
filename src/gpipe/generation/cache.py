"""What one stage keeps and knows while a lane decodes: its KV cache, and where each token is.

A lane's :class:`DecodeStep` says, for the tokens a forward adds, their position ids, their
places in the cache and the mask over every key so far. Every stage works it out alone from
the lane's prompt mask and the token's index, so nothing but hidden states crosses a stage
boundary: Hugging Face would read positions and masks off cache layer 0, which a later stage
does not hold. A :class:`StageCache` holds one lane's keys and values for the layers of one
stage, on that stage's device, and is never sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["DecodeStep", "LayerCache", "StageCache"]


@dataclass(frozen=True)
class DecodeStep:
    """Where the tokens of one forward of one lane sit.

    Attributes:
        token: which forward of the lane this is: 0 reads the prompt (prefill), ``t`` reads
            the ``t``-th generated token.
        positions: ``[rows, new]`` position ids, as Hugging Face's ``generate`` derives them
            from the attention mask (a left-padded row's first real token is position 0).
        cache_position: ``[new]`` the indices of the new tokens in the cache.
        key_mask: ``[rows, keys]`` 1 where a key (prompt or generated) is a real token, 0 at
            padding; ``keys`` = every token so far, the new ones included.
    """

    token: int
    positions: Tensor
    cache_position: Tensor
    key_mask: Tensor

    @classmethod
    def of(cls, prompt_mask: Tensor, token: int, device: torch.device) -> DecodeStep:
        """The step of forward ``token`` of a lane whose prompt mask is ``prompt_mask``."""
        rows, length = prompt_mask.shape
        prompt_mask = prompt_mask.to(device)
        if token == 0:
            positions = (prompt_mask.long().cumsum(-1) - 1).masked_fill(prompt_mask == 0, 1)
            cache_position = torch.arange(length, device=device)
            key_mask = prompt_mask
        else:
            positions = prompt_mask.long().sum(-1, keepdim=True) + token - 1
            cache_position = torch.arange(length + token - 1, length + token, device=device)
            ones = torch.ones(rows, token, dtype=prompt_mask.dtype, device=device)
            key_mask = torch.cat([prompt_mask, ones], dim=1)
        return cls(token, positions, cache_position, key_mask)

    def mask(self, dtype: torch.dtype, sliding_window: int | None = None) -> Tensor:
        """``[rows, 1, new, keys]`` additive mask: 0 where a query may attend, dtype's min not.

        Causal by cache index, padding keys masked, and within ``sliding_window`` keys when
        given. NOTE: additive with the dtype's min, not ``-inf`` or booleans: a padding
        query row that may attend nowhere then averages instead of making NaNs, which
        would reach real rows through the next layer's values.
        """
        keys = self.key_mask.shape[1]
        index = torch.arange(keys, device=self.key_mask.device)
        query = self.cache_position[:, None]
        allowed = index[None, :] <= query
        if sliding_window is not None:
            allowed = allowed & (index[None, :] > query - sliding_window)
        allowed = allowed[None, None] & self.key_mask.bool()[:, None, None, :]
        blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return blocked.masked_fill(~allowed, torch.finfo(dtype).min)


class LayerCache:
    """One layer's keys and values for one lane, grown along the sequence by each forward."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new tokens' ``[rows, heads, new, dim]`` keys and values; return all."""
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        """The bytes this layer's cache holds."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    @property
    def length(self) -> int:
        """How many tokens are cached."""
        return 0 if self.keys is None else int(self.keys.shape[-2])


class StageCache:
    """One lane's cache for the layers of one stage: a :class:`LayerCache` per layer.

    Hugging Face attention layers call ``update(keys, values, layer_idx, ...)`` on the cache
    object they are given; this answers that for the layers of one stage only (their
    ``layer_idx`` are the model's), and :meth:`layer` gives the protocol's layers their own.
    """

    def __init__(self) -> None:
        self.layers: dict[int, LayerCache] = {}

    def layer(self, index: int) -> LayerCache:
        """The cache of layer ``index``, empty at first."""
        if index not in self.layers:
            self.layers[index] = LayerCache()
        return self.layers[index]

    def update(
        self, keys: Tensor, values: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Hugging Face's ``Cache.update``: append to layer ``layer_idx``; return its all."""
        return self.layer(layer_idx).update(keys, values)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached by this stage's first layer (what HF asks of layer 0)."""
        return next(iter(self.layers.values())).length if self.layers else 0

    @property
    def nbytes(self) -> int:
        """The bytes this lane's cache holds on this stage."""
        return sum(layer.nbytes for layer in self.layers.values())
