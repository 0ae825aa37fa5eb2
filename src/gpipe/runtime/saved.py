"""Counting the bytes autograd keeps for backward: one rule, for the runtime and the profiler.

The rule: a saved tensor keeps its whole storage alive, so each storage counts once, at its
full size (a view ``x[:, :8]`` of a wide activation costs the activation; a tensor saved twice
costs it once). Parameters and buffers count nothing: they are the model, not activations.
Tensors handed in from outside the stage (its inputs, the loss targets) count their own bytes
instead: on one host they are views of the caller's whole batch, and a micro-batch holds its
share of it, not the batch.

A tensor whose storage cannot be read (sparse, nested, meta or fake tensors, or a tensor
subclass) counts its own bytes, once per tensor object. Sizes that are not concrete numbers
(symbolic shapes while ``torch.compile`` traces) count 0.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from gpipe.structure import leaves

__all__ = ["SavedBytes", "gradient_bytes", "kept_bytes", "storage_keys", "tensor_bytes"]

# NOTE: an exact type test is the cheapest way to tell a plain dense tensor (whose storage
# can be read) from a subclass such as FakeTensor, which warns when its pointer is read.
_PLAIN = (torch.Tensor, nn.Parameter)
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor``'s own elements (a sparse tensor's indices and values).

    Returns:
        Bytes; 0 when the size is not a concrete number.
    """
    parts = _SPARSE_PARTS.get(tensor.layout)
    if parts is not None:
        return sum(tensor_bytes(getattr(tensor, part)()) for part in parts)
    try:
        size = tensor.numel() * tensor.element_size()
    except RuntimeError:  # an opaque tensor without a size
        return 0
    return size if isinstance(size, int) else 0


def gradient_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (gradients passed on or kept), each tensor once.

    NOTE: this runs on every backward; the common values (None, a tensor, a flat list of
    gradients) skip the tree walk.
    """
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return tensor_bytes(value)
    flat = value if isinstance(value, list) else leaves(value)
    seen: set[int] = set()
    total = 0
    for item in flat:
        if isinstance(item, torch.Tensor) and id(item) not in seen:
            seen.add(id(item))
            total += tensor_bytes(item)
        elif isinstance(item, list):
            total += gradient_bytes(item)  # nested lists: the grads of W's resume points
    return total


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the storage ``tensor`` keeps alive, or None if it has none to read."""
    if type(tensor) not in _PLAIN or tensor.layout is not torch.strided:
        return None
    storage = tensor.untyped_storage()
    address = storage.data_ptr()
    if not address:  # meta tensors, and empty storages, have no address to tell them apart
        return None
    return address, storage.nbytes()


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storage addresses of ``tensors``: what :class:`SavedBytes` leaves out."""
    return {found[0] for t in tensors if (found := _storage(t)) is not None}


class SavedBytes:
    """A ``saved_tensors_hooks`` pack hook that adds up the bytes autograd keeps (see module).

    Use it as ``with torch.autograd.graph.saved_tensors_hooks(c.pack, c.unpack): ...``, or
    with ``*c.hooks()`` where the caller's own hooks must still see every tensor.
    NOTE: the pack hook runs for every tensor autograd saves (hundreds per micro-batch of a
    transformer), so it keeps to a type test and one storage lookup.

    Args:
        exclude: storage addresses that count nothing (parameters and buffers), from
            :func:`storage_keys`.
        borrowed: tensors from outside (loss targets): if saved, each counts its own bytes.
    """

    def __init__(self, exclude: set[int] | None = None, borrowed: Any = None) -> None:
        self._exclude = exclude or set()
        self._storages: dict[int, int] = {}  # storage address -> bytes
        self._borrowed: set[int] = set()  # storages whose tensors count by their own bytes
        self._views: dict[int, int] = {}  # data address on a borrowed storage -> bytes
        self._opaque: dict[int, int] = {}  # id of a tensor without a readable storage -> bytes
        self.nbytes = 0
        for leaf in leaves(borrowed):
            if isinstance(leaf, torch.Tensor) and (found := _storage(leaf)) is not None:
                self._borrowed.add(found[0])

    def keep(self, value: Any) -> None:
        """Count the tensors of ``value`` now, each by its own bytes (a stage's inputs)."""
        for leaf in leaves(value):
            if isinstance(leaf, torch.Tensor):
                found = _storage(leaf)
                if found is not None:
                    self._borrowed.add(found[0])
                self.pack(leaf)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor``'s memory unless it is counted already; return it unchanged."""
        found = _storage(tensor)
        if found is None:
            key = id(tensor)
            if key not in self._opaque:
                self._opaque[key] = size = tensor_bytes(tensor)
                self.nbytes += size
            return tensor
        address, size = found
        if address in self._exclude:
            return tensor
        if address in self._borrowed:
            view, own = tensor.data_ptr(), tensor_bytes(tensor)
            more = own - self._views.get(view, 0)
            if more > 0:
                self._views[view] = own
                self.nbytes += more
        elif address not in self._storages:
            self._storages[address] = size
            self.nbytes += size
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def hooks(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        """The (pack, unpack) hooks to count under, handing each tensor on to the caller's.

        NOTE: hooks do not stack, so the counter's would replace the caller's (``save_on_cpu``).
        And compiled code calls the hooks too: Dynamo would compile them as frames of their own,
        so it is told to leave them alone, once it is loaded (importing it takes seconds, and
        nothing is compiled before).
        """
        pack: Callable[[Any], Any] = self.pack
        unpack: Callable[[Any], Any] = self.unpack
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if outer is not None:
            outer_pack, unpack = outer

            def pack(tensor: torch.Tensor) -> Any:
                return outer_pack(self.pack(tensor))

        if "torch._dynamo" in sys.modules:
            pack, unpack = torch.compiler.disable(pack), torch.compiler.disable(unpack)
        return pack, unpack

    def counted(self, tensor: torch.Tensor) -> int:
        """The bytes counted so far for ``tensor``'s storage (0 if none, or not readable)."""
        found = _storage(tensor)
        if found is None:
            return self._opaque.get(id(tensor), 0)
        if found[0] in self._borrowed:
            return self._views.get(tensor.data_ptr(), 0)
        return self._storages.get(found[0], 0)


def kept_bytes(inputs: Any) -> int:
    """What a checkpointed micro-batch keeps: its stage input, by :class:`SavedBytes`' rule."""
    if isinstance(inputs, torch.Tensor):  # the common case, on every checkpointed forward
        return tensor_bytes(inputs)
    counter = SavedBytes()
    counter.keep(inputs)
    return counter.nbytes
