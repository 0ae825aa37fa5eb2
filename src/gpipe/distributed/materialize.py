"""Which layers a rank keeps: its own stages, materialized on its device; the rest, freed.

A model built on the meta device is never materialized as a whole: each rank allocates only
its own stages (``to_empty``) and initializes them, with the user's ``init_fn`` or each
submodule's own ``reset_parameters()``. Layers this rank does not run have their tensors
replaced by meta ones, so the memory they held is freed even though the user's model object
still refers to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["keep_only"]


def keep_only(
    partitions: Sequence[nn.Module],
    held: Sequence[nn.Module | None],
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Materialize the stages this rank holds on ``device``; free every other stage.

    Args:
        partitions: every stage of the model.
        held: the same list with None for the stages this rank does not hold.
        device: this rank's device.
        init_fn: applied to each held layer after materialization from meta, like
            ``layer.apply(init_fn)``; None: each submodule's ``reset_parameters()``.

    A tensor a held stage shares with a freed one (a tied weight) is kept.
    """
    kept = {id(t) for p in held if p is not None for t in [*p.parameters(), *p.buffers()]}
    for partition, mine in zip(partitions, held):
        if mine is None:
            for module in partition.modules():
                _free(module, kept)
        else:
            _materialize(mine, device, init_fn)


def _free(module: nn.Module, kept: set[int]) -> None:
    """Replace ``module``'s own tensors by meta ones, except those in ``kept``."""
    for name, param in list(module._parameters.items()):
        if param is not None and id(param) not in kept and not param.is_meta:
            module._parameters[name] = nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and id(buffer) not in kept and not buffer.is_meta:
            module._buffers[name] = torch.empty_like(buffer, device="meta")


def _materialize(
    partition: nn.Module, device: torch.device, init_fn: Callable[[nn.Module], None] | None
) -> None:
    """Move ``partition`` to ``device``; if it was on meta, allocate and initialize it."""
    on_meta = any(t.is_meta for t in [*partition.parameters(), *partition.buffers()])
    if not on_meta:
        partition.to(device)
        return
    partition.to_empty(device=device)
    with torch.no_grad():
        for layer in partition.children():
            if init_fn is not None:
                layer.apply(init_fn)
            else:
                for sub in layer.modules():
                    reset = getattr(sub, "reset_parameters", None)
                    if callable(reset):
                        reset()
