"""Nested values (tensors in tuples, lists, dicts): map and flatten, fast for a lone tensor.

Stage inputs and outputs may be any such structure; most are one tensor, and these run on
every action, so the common case skips the generic tree walk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["leaves", "map_tensors"]


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it; other values unchanged."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    return pytree.tree_map_only(torch.Tensor, fn, value)


def leaves(value: Any) -> list[Any]:
    """The flattened leaves of ``value``, in the order :func:`map_tensors` visits them."""
    if isinstance(value, torch.Tensor):
        return [value]
    return pytree.tree_leaves(value)
