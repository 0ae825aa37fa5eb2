"""Nested values (tensors in tuples, lists, dicts): map and flatten, fast for the common shapes.

Stage inputs and outputs may be any such structure; most are one tensor, and gradient
messages are a flat list of tensors (or None). These run on every action, so those two cases
skip the generic tree walk, which costs dozens of Python calls per value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["leaves", "map_tensors"]


def _flat(value: Any) -> bool:
    """Whether ``value`` is a plain list or tuple of tensors and Nones (pytree leaves all)."""
    return type(value) in (list, tuple) and all(
        item is None or isinstance(item, torch.Tensor) for item in value
    )


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it; other values unchanged."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if _flat(value):
        mapped = [None if item is None else fn(item) for item in value]
        return mapped if type(value) is list else tuple(mapped)
    return pytree.tree_map_only(torch.Tensor, fn, value)


def leaves(value: Any) -> list[Any]:
    """The flattened leaves of ``value``, in the order :func:`map_tensors` visits them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if _flat(value):
        return list(value)
    return pytree.tree_leaves(value)
