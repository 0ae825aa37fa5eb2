"""Namespace: keeps the skip names of one use of a skippable layer apart from another's."""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["Namespace"]


class Namespace:
    """A scope for skip names, so one skippable class can be used several times in a model.

    ``Stash().isolate(ns)`` and ``Pop().isolate(ns)`` pair up through ``ns`` only, so two
    such pairs may both call their skip ``"skip"``. Two namespaces are never equal; a copy
    of one is equal to it (a copied model keeps its pairs).
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace {self.id.hex[:8]}>"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and self.id == other.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __copy__(self) -> Namespace:
        copied = Namespace.__new__(Namespace)
        copied.id = self.id
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> Namespace:
        return self.__copy__()
