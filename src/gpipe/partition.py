"""Partitions: cut an nn.Sequential into consecutive stages, one nn.Sequential each."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

__all__ = ["check_balance", "split_module"]


def check_balance(module: nn.Sequential, balance: Sequence[int]) -> list[int]:
    """Validate ``balance`` (layers per stage) against ``module`` and return it as a list.

    Raises:
        TypeError: ``balance`` is not a sequence of ints.
        ValueError: it is empty, has an entry < 1, or does not sum to ``len(module)``.
    """
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a list of ints (layers per stage), got {balance!r}")
    balance = list(balance)
    if not balance or not all(isinstance(b, int) and not isinstance(b, bool) for b in balance):
        raise TypeError(f"balance must be a non-empty list of ints, got {balance!r}")
    fix = f"e.g. gpipe.balance_by_time(module, sample, {min(len(balance), len(module)) or 1})"
    if any(b < 1 for b in balance):
        raise ValueError(f"every stage needs at least one layer, got balance={balance}; {fix}")
    if sum(balance) != len(module):
        raise ValueError(
            f"balance={balance} sums to {sum(balance)} but the module has {len(module)} "
            f"layers; {fix}"
        )
    return balance


def split_module(module: nn.Sequential, balance: Sequence[int]) -> nn.ModuleList:
    """The stages: one nn.Sequential per entry of ``balance``, holding the user's own layers.

    Layer names are kept, so ``state_dict`` keys of a stage read as in the user's model.
    """
    balance = check_balance(module, balance)
    named = list(module.named_children())
    stages = nn.ModuleList()
    start = 0
    for size in balance:
        stages.append(nn.Sequential(OrderedDict(named[start : start + size])))
        start += size
    return stages
