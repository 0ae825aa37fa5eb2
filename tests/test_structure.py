"""map_tensors and leaves: their fast paths give what the generic pytree walk gives."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from gpipe.structure import leaves, map_tensors

Pair = namedtuple("Pair", "first second")
_A, _B = torch.arange(3.0), torch.ones(2, 2)

VALUES = [
    _A,
    [_A, None, _B],
    (_A, _B),
    [],
    (None,),
    [_A, [_B]],
    (_A, 3, "x"),
    Pair(_A, _B),
    {"x": _A, "y": [_B, None]},
]


def _same(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w)
        else:
            assert g == w


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_map_tensors_equals_the_generic_tree_map(value: Any) -> None:
    double = lambda t: t * 2  # noqa: E731
    _same(map_tensors(double, value), pytree.tree_map_only(torch.Tensor, double, value))


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_leaves_equal_the_generic_tree_leaves(value: Any) -> None:
    got, want = leaves(value), pytree.tree_leaves(value)
    assert len(got) == len(want)
    assert all(g is w for g, w in zip(got, want))
