"""In-place writes into a stage's input: told by version counters, answered with a copy.

A stage input may be the caller's batch (stage 0), views sharing one version counter with the
other micro-batches, or what a checkpointed micro-batch recomputes from: a stage that writes
into it gets a copy. Whether it does is learned from its first forward in each mode, run on a
copy so nothing is written before it is known. In a dataflow a value may also be read by
several stages at once: there a stage always gets a copy.
"""

from __future__ import annotations

from typing import Any

import torch

from gpipe.structure import leaves, map_tensors

__all__ = ["cloned", "learn_writes", "versions"]


def cloned(value: Any) -> Any:
    """A copy of ``value`` with each tensor cloned (in the graph when grad mode is on)."""
    return map_tensors(torch.Tensor.clone, value)


def versions(value: Any) -> Any:
    """The version counters of ``value``'s tensors: an in-place write bumps its tensor's.

    Views share their base's counter, so a write through a view of an input shows too.
    (Inference tensors have none; nothing can be saved from them for a backward either.)
    A lone tensor, the common case on every forward, skips the tree walk.
    """
    if isinstance(value, torch.Tensor):
        # NOTE: asking first (value.is_inference()) is a call that releases the GIL, twice per
        # forward; an inference tensor's _version raises instead.
        try:
            return value._version
        except RuntimeError:
            return None
    return [versions(leaf) for leaf in leaves(value) if isinstance(leaf, torch.Tensor)]


def learn_writes(
    copies_input: dict[tuple[int, bool], bool],
    key: tuple[int, bool],
    before: Any,
    given: Any,
    copied: bool,
    harmless: bool,
) -> None:
    """Note in ``copies_input`` whether the forward just run wrote into its input (``given``).

    A stage whose earlier forwards in this mode did not write ran on the input itself:
    a write now (an in-place op that only some inputs trigger) may have changed what a
    checkpointed micro-batch recomputes from, so the step stops. Without autograd
    (``harmless``) nothing is kept that the write could spoil.

    Args:
        copies_input: per (stage, training mode), whether the stage writes into its input.
        key: the (stage, training mode) of the forward.
        before: :func:`versions` of ``given`` before the forward.
        given: what the forward ran on.
        copied: whether ``given`` is a copy of the stage input.
        harmless: whether the forward ran without autograd.

    Raises:
        RuntimeError: the stage wrote into the input itself while autograd kept a graph.
    """
    if before is None or (isinstance(before, list) and None in before):
        return  # inference tensors keep no version: this forward cannot tell
    wrote = versions(given) != before
    known = copies_input.get(key)
    if known is None or (wrote and not known):
        copies_input[key] = wrote
    if wrote and not copied and not harmless:
        raise RuntimeError(
            f"stage {key[0]} wrote into its input in place, though its first forward "
            f"in {'training' if key[1] else 'eval'} mode did not (an in-place op that "
            "only some inputs trigger), so this step may have recomputed from a changed "
            "input and was stopped. gpipe copies this stage's input from now on: run "
            "the step again"
        )
