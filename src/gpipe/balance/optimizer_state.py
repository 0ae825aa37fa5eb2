"""Optimizer state: how many parameter-sized tensors an optimizer keeps per parameter."""

from __future__ import annotations

from typing import TypeAlias

import torch

__all__ = ["OptimizerSpec", "optimizer_state_factor"]

#: An optimizer named for its state: ``"adam"``, ``"sgd"``, ... a ``torch.optim`` class, or
#: None for no optimizer state.
OptimizerSpec: TypeAlias = str | type[torch.optim.Optimizer] | None

# Optimizer state per parameter, in parameter-sized tensors (scalar step counters ignored).
_STATE_BY_NAME: dict[str, int] = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
_STATE_BY_CLASS: dict[type, int] = {
    torch.optim.SGD: 0,  # momentum is off by default; name "sgd-momentum" when it is on
    torch.optim.Adagrad: 1,
    torch.optim.RMSprop: 1,
    torch.optim.Adadelta: 2,
    torch.optim.Adam: 2,
    torch.optim.AdamW: 2,
    torch.optim.Adamax: 2,
    torch.optim.NAdam: 2,
    torch.optim.RAdam: 2,
}


def optimizer_state_factor(optimizer: OptimizerSpec) -> int:
    """Optimizer state per trainable parameter, in multiples of the parameter's size.

    Args:
        optimizer: None or ``"sgd"`` (no state), ``"sgd-momentum"`` (one buffer), ``"adam"``
            or ``"adamw"`` (two moments), or an optimizer class such as ``torch.optim.Adam``.

    Returns:
        0, 1 or 2.

    Raises:
        ValueError: an optimizer this does not know.
    """
    if optimizer is None:
        return 0
    if isinstance(optimizer, str) and optimizer.lower() in _STATE_BY_NAME:
        return _STATE_BY_NAME[optimizer.lower()]
    if isinstance(optimizer, type):
        for cls in optimizer.__mro__:
            if cls in _STATE_BY_CLASS:
                return _STATE_BY_CLASS[cls]
    names = ", ".join(map(repr, _STATE_BY_NAME))
    raise ValueError(
        f"unknown optimizer {optimizer!r}: pass None, one of {names}, or a torch.optim class "
        "such as torch.optim.Adam"
    )
