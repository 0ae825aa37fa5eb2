"""Signature rounds: the first step of a key agrees every message's signature, later ones reuse it.

Messages carry only tensors once a step's shapes are known. A step is keyed by what its
shapes follow from (training or not, micro-batches, the input's shapes and dtypes), which
every rank learns from the step header. The first step of a key exchanges each message's
signature first (its size, then its JSON, then the tensors: three rounds, each a batch
of the same shape on both ends); later steps of the key post the receives straight in the
shapes both ends remember. A message whose signature changes under a known key (shapes
that depend on the data) is an error naming it: its receiver posted other shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gpipe.distributed.posting import Message, Poster
from gpipe.distributed.wire import Signature, decode, encode, receive_buffers
from gpipe.runtime.transport import Tag

__all__ = ["Incoming", "Outgoing", "SignatureRounds", "shapes_changed"]

# A message of a batch to send: (tag, peer rank, signature, tensors); one to receive: (tag, peer).
Outgoing = tuple[Tag, int, Signature, list[torch.Tensor]]
Incoming = tuple[Tag, int]


class SignatureRounds:
    """Every message's signature, per step key: agreed in the key's first step, then known.

    Args:
        poster: what carries the rounds (the executor's own, in its order).
        device: where the rounds' tensors and the receive buffers live.
    """

    def __init__(self, poster: Poster, device: torch.device) -> None:
        self._poster = poster
        self._device = device
        self._known: set[Any] = set()  # keys whose steps completed: shapes known
        self._plans: dict[Any, dict[Tag, Signature]] = {}

    def agree(
        self, key: Any, outgoing: list[Outgoing], incoming: list[Incoming]
    ) -> tuple[dict[Tag, Signature], Sequence[str]]:
        """One batch of a step keyed ``key``: the signature of each message it receives, and
        what changed (one clause per message) in the messages it sends.

        Under a known key, an outgoing message whose signature changed is replaced in
        ``outgoing`` by empty tensors of the remembered shapes; the caller posts the batch,
        then fails with :func:`shapes_changed`. Under a new key, the batch's signatures go
        both ways first (two rounds: this waits for the received ones).

        Raises:
            Aborted: the poster was aborted while a round waited.
            TimeoutError: a round's signature did not come within the poster's timeout.
        """
        plans = self._plans.setdefault(key, {})
        if key in self._known:
            changed: Sequence[str] = ()
            for tag, _, signature, _ in outgoing:
                if plans.get(tag) != signature:
                    changed = self._refill(plans, outgoing)
                    break
            return {tag: plans[tag] for tag, _ in incoming}, changed
        for tag, _, signature, _ in outgoing:
            plans[tag] = signature
        signatures = self._exchange(outgoing, incoming)
        plans.update(signatures)
        return signatures, ()

    def learned(self, key: Any) -> None:
        """A step keyed ``key`` completed: its signatures are known on both ends."""
        self._known.add(key)

    def forget(self) -> None:
        """After a failure: the two ends may have stopped at different messages, so every
        key's signatures are agreed anew."""
        self._known.clear()
        self._plans.clear()

    def _refill(self, plans: dict[Tag, Signature], outgoing: list[Outgoing]) -> list[str]:
        """What changed in ``outgoing`` from ``plans``; each changed message replaced by
        empty tensors of its remembered shapes.

        NOTE: the receiver posted receives of the remembered shapes: fill them, so every
        later message still meets its own, then fail.
        """
        changed = []
        for index, (tag, peer, signature, _) in enumerate(outgoing):
            expected = plans.get(tag)
            if expected != signature:
                changed.append(_changed(tag, expected, signature))
                assert expected is not None
                outgoing[index] = (tag, peer, expected, receive_buffers(expected, self._device))
        return changed

    def _exchange(self, outgoing: list[Outgoing], incoming: list[Incoming]) -> dict[Tag, Signature]:
        """Tell and hear every message's signature, in two rounds of the batch's own shape
        (sizes, then the JSON), before its tensors go."""
        device = self._device
        encoded = [encode(signature).to(device) for _, _, signature, _ in outgoing]
        sizes_out = [torch.tensor([e.numel()], dtype=torch.int64, device=device) for e in encoded]
        sizes_in = [torch.empty(1, dtype=torch.int64, device=device) for _ in incoming]
        self._round(outgoing, sizes_out, incoming, sizes_in)
        lengths = [int(size.item()) for size in sizes_in]
        texts = [torch.empty(n, dtype=torch.uint8, device=device) for n in lengths]
        self._round(outgoing, encoded, incoming, texts)
        return {tag: decode(text) for (tag, _), text in zip(incoming, texts)}

    def _round(
        self,
        outgoing: list[Outgoing],
        sent: list[torch.Tensor],
        incoming: list[Incoming],
        received: list[torch.Tensor],
    ) -> None:
        """Post one tensor per message of the batch and wait for the received ones."""
        messages = [Message(True, peer, [t]) for (_, peer, _, _), t in zip(outgoing, sent)]
        receives = [Message(False, peer, [t]) for (_, peer), t in zip(incoming, received)]
        self._poster.post(messages + receives)
        for message in receives:
            self._poster.wait(message)


def shapes_changed(changed: Sequence[str]) -> RuntimeError:
    """The error for messages whose shapes changed under a known key (from :meth:`agree`)."""
    return RuntimeError(
        "; ".join(changed) + ": the shapes of a stage's messages must follow from the "
        "step's input shapes (gpipe posts each receive in the shapes it had in the last "
        "step with the same input shapes)"
    )


def _changed(tag: Tag, expected: Signature | None, got: Signature) -> str:
    def shapes(signature: Signature | None) -> str:
        if signature is None:
            return "nothing"
        described = [f"{s} {str(d).removeprefix('torch.')}" for _, s, d, _ in signature.tensors]
        return ", ".join(described) or "no tensors"

    return (
        f"the {tag[0]} for stage {tag[1]}, micro-batch {tag[2]} changed from "
        f"[{shapes(expected)}] to [{shapes(got)}] between two steps with the same input shapes"
    )
