"""The wire format: a message's signature travels once, then only its tensors move.

A message is a pytree of tensors and other values (a stage's output, or the gradients of its
inputs). Its *signature* is everything but the tensors' contents: the tree's structure, each
tensor's shape, dtype and ``requires_grad``, and the non-tensor leaves themselves. It
travels once per step key (:mod:`gpipe.distributed.signature_rounds`); after that a message
is its tensors alone, received into buffers of the shapes both ends remember.

The tree's structure travels as torch's own pytree serialization (``treespec_dumps``, JSON)
and the leaf descriptions as JSON too: nothing a peer sends is ever unpickled. Non-tensor
leaves must be JSON values (numbers, strings, booleans, None, and lists or dicts of them);
a namedtuple must be registered with pytree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["Signature", "decode", "encode", "flatten", "rebuild", "receive_buffers"]

# A leaf: ("t", shape, dtype, requires_grad) for a tensor, ("v", value) for anything else.
Leaf = tuple[Any, ...]


@dataclass(frozen=True)
class Signature:
    """What a receiver must know to take a message's tensors and rebuild the message."""

    spec: pytree.TreeSpec
    leaves: tuple[Leaf, ...]

    @property
    def tensors(self) -> list[Leaf]:
        """The tensor leaves, in the order their contents travel."""
        return [leaf for leaf in self.leaves if leaf[0] == "t"]


def flatten(value: Any) -> tuple[Signature, list[torch.Tensor]]:
    """Split ``value`` into its signature and its tensors (contiguous, ready to send)."""
    flat, spec = pytree.tree_flatten(value)
    leaves: list[Leaf] = []
    tensors: list[torch.Tensor] = []
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            leaves.append(("t", tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
            tensors.append(leaf.detach().contiguous())
        else:
            leaves.append(("v", leaf))
    return Signature(spec, tuple(leaves)), tensors


def encode(signature: Signature) -> torch.Tensor:
    """The signature as a uint8 tensor (UTF-8 JSON), to send when a channel first needs it.

    Raises:
        TypeError: the structure or a non-tensor leaf has no JSON form, so it cannot cross
            processes.
    """
    try:
        structure = pytree.treespec_dumps(signature.spec)
    except (NotImplementedError, TypeError) as error:
        raise TypeError(
            f"a stage boundary carries a structure torch cannot describe to another process: "
            f"{error}"
        ) from error
    leaves = [
        ["t", list(leaf[1]), str(leaf[2]).removeprefix("torch."), leaf[3]]
        if leaf[0] == "t"
        else ["v", leaf[1]]
        for leaf in signature.leaves
    ]
    try:
        text = json.dumps([structure, leaves], allow_nan=True)
    except (TypeError, ValueError) as error:
        values = [type(leaf[1]).__name__ for leaf in signature.leaves if leaf[0] == "v"]
        raise TypeError(
            f"a stage boundary carries values with no JSON form ({', '.join(values)}), so they "
            "cannot travel between processes; pass tensors, numbers, strings, booleans or "
            f"None (or lists and dicts of them) across stages ({error})"
        ) from error
    if json.loads(text)[1] != leaves:  # a tuple leaf would come back a list: say so now
        raise TypeError(
            "a stage boundary carries non-tensor values that JSON changes (tuples, "
            "non-string dict keys): pass them as lists or tensors"
        )
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def decode(data: torch.Tensor) -> Signature:
    """The signature :func:`encode` made: JSON, so a peer's bytes can never run code.

    Raises:
        ValueError: the bytes are not a signature (a peer of another version or program).
    """
    try:
        structure, leaves = json.loads(bytes(data.cpu().numpy()).decode())
        parsed: list[Leaf] = []
        for leaf in leaves:
            if leaf[0] == "t":
                dtype = getattr(torch, leaf[2])
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"{leaf[2]!r} is no dtype")
                parsed.append(("t", tuple(int(n) for n in leaf[1]), dtype, bool(leaf[3])))
            else:
                parsed.append(("v", leaf[1]))
        return Signature(pytree.treespec_loads(structure), tuple(parsed))
    except (ValueError, TypeError, IndexError, AttributeError, UnicodeDecodeError) as error:
        raise ValueError(f"a peer sent a message signature that cannot be read: {error}") from error


def receive_buffers(signature: Signature, device: torch.device) -> list[torch.Tensor]:
    """Empty tensors to receive a message's contents into, on ``device``."""
    return [
        torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype, _ in signature.tensors
    ]


def rebuild(signature: Signature, tensors: list[torch.Tensor]) -> Any:
    """The message: ``signature``'s tree with ``tensors`` (received) in its tensor leaves.

    Tensors that needed a gradient on the sending side need one here too: they are the
    leaves this stage's backward differentiates with respect to.
    """
    leaves, spec = signature.leaves, signature.spec
    if len(leaves) == 1 and leaves[0][0] == "t":
        # NOTE: the usual messages, a lone tensor (an activation) or a list of one (its
        # gradient): no tree to rebuild (on every hand-off)
        if spec.is_leaf():
            return tensors[0].requires_grad_(leaves[0][3])
        if spec.type is list and spec.num_children == 1:
            return [tensors[0].requires_grad_(leaves[0][3])]
    received = iter(tensors)
    flat = []
    for leaf in signature.leaves:
        if leaf[0] == "t":
            flat.append(next(received).requires_grad_(leaf[3]))
        else:
            flat.append(leaf[1])
    return pytree.tree_unflatten(flat, signature.spec)
