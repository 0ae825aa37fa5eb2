"""What each stage runs to decode: its layers, called with the lane's cache and positions.

A stage program is called as ``program(x, cache, step)``: ``x`` is the token ids on the first
stage and the hidden states after, ``cache`` the lane's :class:`StageCache` on this stage,
``step`` the lane's :class:`DecodeStep`. It returns the hidden states for the next stage, or
on the last stage the logits of each row's newest position (``[rows, 1, vocab]``).

**The protocol for an nn.Sequential.** Tensors between layers are ``[rows, tokens, ...]``.
Each layer of the model either

- mixes positions and keeps a cache: it has ``forward_cached(x, cache, step)`` taking the
  new tokens' ``x``, its own :class:`LayerCache` for this lane (empty on the prompt) and the
  :class:`DecodeStep`, and returns the new tokens' output; or
- works on each position alone (a Linear, a norm, an activation, a token embedding, dropout
  in eval): it is called as in training on the new tokens only. torch.nn's position-wise
  layers are known; a layer of your own says so with a class attribute
  ``position_wise = True``.

Any other layer is refused before decoding starts: called on the new tokens alone, a layer
that mixes positions would give a wrong answer without an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from gpipe.generation.cache import DecodeStep, LayerCache, StageCache

__all__ = ["CachedLayer", "StageProgram", "sequential_programs"]

StageProgram = Callable[[Tensor, StageCache, DecodeStep], Tensor]

_POSITION_WISE: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Embedding,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Dropout,
    nn.Identity,
    nn.GELU,
    nn.ReLU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softmax,
    nn.LogSoftmax,
)


@runtime_checkable
class CachedLayer(Protocol):
    """A layer that mixes positions and keeps its own keys and values while decoding."""

    def forward_cached(self, x: Tensor, cache: LayerCache, step: DecodeStep) -> Tensor:
        """The new tokens' output, reading every earlier token through ``cache``."""
        ...


def _position_wise(layer: nn.Module) -> bool:
    if getattr(type(layer), "position_wise", False):
        return True
    if isinstance(layer, nn.Sequential):
        return all(_position_wise(child) for child in layer)
    return isinstance(layer, _POSITION_WISE)


class _SequentialStage:
    """One stage of an nn.Sequential pipe, decoding by the protocol above."""

    def __init__(self, layers: Sequence[nn.Module], names: Sequence[str], last: bool) -> None:
        self.layers = list(layers)
        for layer, name in zip(self.layers, names):
            if not isinstance(layer, CachedLayer) and not _position_wise(layer):
                raise TypeError(
                    f"layer {name} ({type(layer).__name__}) has no forward_cached(x, cache, "
                    "step) and is not known to work on each position alone, so it cannot "
                    "decode token by token: give it forward_cached (see "
                    "gpipe.generation.programs), or set position_wise = True on its class "
                    "if it never mixes positions"
                )
        # On the last stage, the layers after its last cached one see only the newest
        # position: the logits of the others are never read.
        cached = [i for i, layer in enumerate(self.layers) if isinstance(layer, CachedLayer)]
        self._tail = (cached[-1] + 1 if cached else 0) if last else None

    def __call__(self, x: Tensor, cache: StageCache, step: DecodeStep) -> Tensor:
        for index, layer in enumerate(self.layers):
            if index == self._tail:
                x = x[:, -1:]
            if isinstance(layer, CachedLayer):
                x = layer.forward_cached(x, cache.layer(index), step)
            else:
                x = layer(x)
        return x[:, -1:] if self._tail == len(self.layers) else x


def sequential_programs(
    partitions: Sequence[nn.Module], names: Sequence[Sequence[str]]
) -> list[StageProgram]:
    """One program per stage of an nn.Sequential pipe: ``partitions[s]`` runs its layers.

    Args:
        partitions: each stage's layers, in order (a Sequential each).
        names: each stage's layer names in the user's model, for errors.

    Raises:
        TypeError: a layer that neither keeps a cache nor works position by position.
    """
    last = len(partitions) - 1
    return [
        _SequentialStage(
            # NOTE: _modules, not children(): a layer used twice is two calls, two caches
            [layer for layer in partition._modules.values() if layer is not None],
            stage_names,
            stage == last,
        )
        for stage, (partition, stage_names) in enumerate(zip(partitions, names))
    ]
