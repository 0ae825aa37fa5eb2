"""The executor: runs this rank's lowered program, posting its batches in order.

The worker runs its actions and asks for and hands over messages by tag, as it does in one
process. This transport, driven by the worker's own thread, posts the program's batches
(:mod:`gpipe.schedule.lowering`) in the program's order: a batch goes out as soon as the
actions before it have run, so a send leaves right after the action that made it, and a
receive is posted in the step its message is made and waited for right before the action
that reads it starts. Every rank derives its program from the same schedule, so both ends
of every pair agree on the order; the lowering guarantees no program can hang under NCCL's
rules.

What a batch carries is agreed per step key (:mod:`gpipe.distributed.signature_rounds`),
put on the wire by a poster (:mod:`gpipe.distributed.posting`), timed for the timeline
(:mod:`gpipe.distributed.transfer_log`); a failed wait names its culprit
(:mod:`gpipe.distributed.blame`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpipe.distributed.blame import Blame, Culprit
from gpipe.distributed.failure import Failure, PipelineFailure
from gpipe.distributed.posting import Message, Poster, peer_of, poster_for
from gpipe.distributed.signature_rounds import (
    Incoming,
    Outgoing,
    SignatureRounds,
    shapes_changed,
)
from gpipe.distributed.transfer_log import TransferLog
from gpipe.distributed.wire import Signature, flatten, rebuild, receive_buffers
from gpipe.runtime.mailbox import Mailbox
from gpipe.runtime.transport import Aborted, Tag, sending_stage
from gpipe.schedule import Action
from gpipe.schedule.lowering import SEND, Batch

__all__ = ["Executor"]


@dataclass
class _Receipt:
    """A receive posted for this step: its message, and the signature to rebuild it by."""

    message: Message
    signature: Signature


class Executor:
    """Carries one rank's messages by running its lowered program.

    Args:
        placement: ``placement[s]``: the pipeline device (pipeline rank) of stage ``s``.
        device: this rank's pipeline device.
        ranks: ``ranks[d]``: the global rank of pipeline device ``d``.
        torch_device: where this rank's stages run; received tensors land there.
        group: the process group carrying the messages (gloo or NCCL).
        timeout: seconds to wait for one message before declaring its sender lost.
        report: called with this rank's failure, to tell the other ranks (the fault
            channel); returns the failure every rank will name.
        overlap: False waits for every batch to complete before the next action, to
            measure what overlapping communication with compute is worth.
        blame: whom to name when a wait for a rank failed: ``blame(rank, what happened)``
            (the fault channel's culprit: a reported failure, or the rank that fell silent).
    """

    def __init__(
        self,
        placement: tuple[int, ...],
        device: int,
        ranks: list[int],
        torch_device: torch.device,
        group: Any,
        timeout: float,
        report: Callable[[Failure], Failure],
        overlap: bool = True,
        blame: Culprit | None = None,
    ) -> None:
        self._placement = placement
        self._device = device
        self._ranks = ranks
        self._rank = ranks[device]
        self._torch_device = torch_device
        self._timeout = timeout
        self._report = report
        self._blame = Blame(self._rank, timeout, blame)
        self.done = 0  # actions run, over every step: progress, for the fault channel's beats
        self.waiting = False  # whether the worker waits for a message now
        self.overlap = overlap
        self._poster: Poster = poster_for(group, timeout, self._link_failed)
        self._signatures = SignatureRounds(self._poster, torch_device)
        self.transfer_log = TransferLog(torch_device, self._poster.stream_waits)
        self._box = Mailbox()  # hand-offs between stages of this rank, and the caller's
        self._program: list[Batch] = []
        self._posted = 0  # batches of the program posted
        self._ran = 0  # actions run
        self._key: Any = None
        self._stash: dict[Tag, Any] = {}  # sent by the worker, not yet posted
        self._receipts: dict[Tag, _Receipt] = {}
        self.failure: Failure | None = None

    # -- the Transport protocol --------------------------------------------------------

    def reset(self) -> None:
        """A new step: nothing posted, no transfers recorded yet."""
        if self.failure is not None:
            raise PipelineFailure(self.failure, self._rank)
        self._box.clear()
        self._poster.reset()
        self._stash.clear()
        self._receipts.clear()
        self._posted = self._ran = 0
        self.transfer_log.reset()

    def begin(self, program: list[Batch], key: Any) -> None:
        """This step's batches (this rank's part of the lowered schedule), and its key:
        every rank gives the same key for steps whose messages have the same shapes."""
        self._program = program
        self._key = key
        self._advance()

    def send(self, tag: Tag, value: Any) -> None:
        """Deliver ``value``: here, or with the batch that carries it to another rank."""
        if self._device_of(tag[1]) == self._device:
            self._box.put(tag, value)
        else:
            self._stash[tag] = value

    def recv(self, tag: Tag) -> Any:
        """Wait for the message ``tag``, posted with its batch before this action.

        Raises:
            PipelineFailure: a rank failed or vanished, or nothing came within the timeout.
        """
        self.waiting = True
        try:
            if self._device_of(sending_stage(tag)) == self._device:
                return self._box.take(tag, self._timeout)
            self._advance()
            receipt = self._receipts.pop(tag)
            self._poster.wait(receipt.message)
        except Aborted:
            raise self._raised() from None
        except TimeoutError:
            sender = self._ranks[self._device_of(sending_stage(tag))]
            self.fail(self.failure or self._blame.silent(sender, tag))
            raise self._raised() from None
        finally:
            self.waiting = False
        self.transfer_log.arrived(tag, receipt.message)
        return rebuild(receipt.signature, receipt.message.tensors)

    def collect(self, tag: Tag) -> Any:
        """Take a message for the caller's side that must already be here."""
        return self._box.take_ready(tag)

    def abort(self, error: BaseException | None = None) -> None:
        """This rank failed (``error``): tell every rank, and wake this rank's worker."""
        if isinstance(error, PipelineFailure):  # heard from elsewhere: already reported
            self._heard(error.failure)
            return
        self.fail(self._blame.own(error))

    # -- distributed only --------------------------------------------------------------

    def ran(self, action: Action) -> None:
        """The worker finished ``action``: post the batches that follow it."""
        self._ran += 1
        self.done += 1
        self._advance()

    def finish(self) -> None:
        """Post what is left and wait until every message of the step is done.

        Raises:
            PipelineFailure: a rank failed, or a send did not complete within the timeout.
        """
        if self.failure is None:
            try:
                self._advance()
                self._poster.drain(lambda: self.failure is not None)
            except Aborted:
                pass
            except TimeoutError as error:
                self.fail(self.failure or self._blame.unsent(error, peer_of(error)))
        if self.failure is not None:
            raise PipelineFailure(self.failure, self._rank)
        self._signatures.learned(self._key)

    def fail(self, failure: Failure) -> Failure:
        """Record ``failure`` (reported to every rank), wake the worker; return the first."""
        if self.failure is None:
            failure = self._report(failure)
        self._heard(failure)
        assert self.failure is not None
        return self.failure

    def close(self, wait: float = 2.0) -> None:
        """Stop the poster's thread, and wait (``wait`` s at most) for it.

        Between steps it is idle, so it ends at once. After a failure it may still wait in
        gloo: then nothing is waited for here (see :meth:`release`).
        """
        self._poster.close()
        if self.failure is None:
            self._poster.join(wait)

    def release(self, grace: float = 2.0) -> None:
        """After a failure, once the groups' links are closed (mesh.retire): let this rank's
        threads end, waiting ``grace`` s at most.

        NOTE: a thread still waiting in gloo when the interpreter finalizes drops its work
        there, and the work's destructor, taking the GIL from a thread Python is ending,
        aborts the process ("terminate called without an active exception"); closed links
        fail those waits, so the threads end while the interpreter still runs.
        """
        self.close()
        self._poster.join(grace)
        # NOTE: a destroyed group keeps its threads and sockets while anything refers to it
        self._poster.group = None

    # -- posting -----------------------------------------------------------------------

    def _advance(self) -> None:
        """Post every batch whose actions before it have run, in the program's order."""
        program = self._program
        while self._posted < len(program) and program[self._posted].after <= self._ran:
            batch = program[self._posted]
            self._posted += 1
            self._post(batch)

    def _post(self, batch: Batch) -> None:
        outgoing: list[Outgoing] = []
        incoming: list[Incoming] = []
        for op in batch.ops:
            peer = self._ranks[op.peer]
            if op.direction != SEND:
                incoming.append((op.tag, peer))
                continue
            signature, tensors = flatten(self._stash.pop(op.tag))
            outgoing.append((op.tag, peer, signature, tensors))
        try:
            signatures, changed = self._signatures.agree(self._key, outgoing, incoming)
        except Aborted:
            raise self._raised() from None
        except TimeoutError as error:
            self.fail(self.failure or self._blame.no_signature(peer_of(error)))
            raise self._raised() from None
        except Exception as error:
            self._refused(error)
            raise
        messages = [Message(True, peer, tensors) for _, peer, _, tensors in outgoing]
        for tag, peer in incoming:
            buffers = receive_buffers(signatures[tag], self._torch_device)
            message = Message(False, peer, buffers)
            self._receipts[tag] = _Receipt(message, signatures[tag])
            messages.append(message)
        try:
            self._poster.post(messages)
        except Exception as error:
            self._refused(error)
            raise
        self.transfer_log.handed(outgoing)
        if not self.overlap:
            for message in messages:
                if not message.send:
                    self._poster.wait(message)
            self._poster.drain(lambda: self.failure is not None)
        if changed:
            raise shapes_changed(changed)

    # -- pieces ------------------------------------------------------------------------

    def _device_of(self, stage: int) -> int:
        if 0 <= stage < len(self._placement):
            return self._placement[stage]
        return self._device  # the caller's side: inputs and outputs stay on this rank

    def _raised(self) -> PipelineFailure:
        assert self.failure is not None
        return PipelineFailure(self.failure, self._rank)

    def _link_failed(self, peer: int, error: BaseException) -> None:
        """A link to ``peer`` (-1: not known) broke (the poster's callback, or a post the link
        refused): name the rank that failed."""
        if self.failure is None:
            self.fail(self._blame.lost_link(peer, error) if peer >= 0 else self._blame.own(error))

    def _refused(self, error: Exception) -> None:
        """A post raised ``error``: a link its poster says refused it (the peer may be gone)
        goes to the culprit, as a broken link does, and this rank's worker stops there, not
        taking the link's error for its own action's."""
        if peer_of(error) >= 0:
            self._link_failed(peer_of(error), error)
            raise self._raised() from None

    def _heard(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure
        self._signatures.forget()
        self._box.abort()
        self._poster.abort()
