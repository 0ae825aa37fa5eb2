"""The executor: runs this rank's lowered program, posting its batches in order.

The worker runs its actions and asks for and hands over messages by tag, as it does in one
process. This transport, driven by the worker's own thread, posts the program's batches
(:mod:`gpipe.schedule.lowering`) in the program's order: a batch goes out as soon as the
actions before it have run, so a send leaves right after the action that made it, and a
receive is posted before the action that needs it and waited for right before that action
starts. Every rank derives its program from the same schedule, so both ends of every pair
agree on the order; the lowering guarantees no program can hang under NCCL's rules.

Messages carry only tensors once a step's shapes are known. A step is keyed by what its
shapes follow from (training or not, micro-batches, the input's shapes and dtypes), which
every rank learns from the step header. The first step of a key exchanges each message's
signature first (its size, then its JSON, then the tensors: three rounds, each a batch
of the same shape on both ends); later steps of the key post the receives straight in the
shapes both ends remember. A message whose signature changes under a known key (shapes
that depend on the data) is an error naming it: its receiver posted other shapes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpipe.distributed.faults import Failure, PipelineFailure, brief
from gpipe.distributed.posting import Message, Poster, poster_for
from gpipe.distributed.wire import Signature, decode, encode, flatten, rebuild, receive_buffers
from gpipe.runtime.copies import GpuClock
from gpipe.runtime.mailbox import Mailbox
from gpipe.runtime.step import unplaced
from gpipe.runtime.transport import Aborted, Tag, sending_stage
from gpipe.schedule import Action
from gpipe.schedule.lowering import SEND, Batch

__all__ = ["Executor", "Transfer"]


@dataclass(frozen=True)
class Transfer:
    """One message received from another rank, as the timeline shows it.

    Times are this rank's ``perf_counter_ns``: ``posted`` when its receive was posted,
    ``done`` when its tensors were known to have arrived (on NCCL, when the GPU's stream had
    them: see :meth:`Executor.settle`).
    """

    tag: Tag
    source: int
    posted_ns: int
    done_ns: int
    nbytes: int


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
        blame: Callable[[int, str], Failure] | None = None,
    ) -> None:
        self._placement = placement
        self._device = device
        self._ranks = ranks
        self._rank = ranks[device]
        self._torch_device = torch_device
        self._timeout = timeout
        self._report = report
        self._blame = blame
        self.done = 0  # actions run, over every step: progress, for the fault channel's beats
        self.waiting = False  # whether the worker waits for a message now
        self.overlap = overlap
        self._poster: Poster = poster_for(group, timeout, self._link_failed)
        self._box = Mailbox()  # hand-offs between stages of this rank, and the caller's
        self._program: list[Batch] = []
        self._posted = 0  # batches of the program posted
        self._ran = 0  # actions run
        self._key: Any = None
        self._known: set[Any] = set()  # keys whose steps completed: shapes known
        self._plans: dict[Any, dict[Tag, Signature]] = {}
        self._stash: dict[Tag, Any] = {}  # sent by the worker, not yet posted
        self._receipts: dict[Tag, _Receipt] = {}
        self._peers_used: set[int] = set()
        self.failure: Failure | None = None
        self.transfers: list[Transfer] = []  # received this step
        self.sent: list[tuple[Tag, int, int]] = []  # (tag, peer, perf_counter_ns) this step
        # NOTE: on NCCL the host never waits for a message (a wait is the stream's), so its
        # clock says when a message was queued, not when it moved: each hand-over and arrival
        # is also marked on this rank's GPU stream, and read by settle().
        self._clock = (
            GpuClock(torch_device)
            if torch_device.type == "cuda" and self._poster.stream_waits
            else None
        )
        self._marks: list[tuple[bool, int, Any]] = []  # (sent?, index, GPU mark) this step

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
        self.transfers = []
        self.sent = []
        self._marks = []
        if self._clock is not None:
            self._clock.start()

    def settle(self) -> None:
        """Time this step's messages by the GPU's stream, where it carried them (NCCL):
        each hand-over when the sender's stream had the message ready, each arrival when
        the receiver's stream had it (waiting for the GPU to get there).

        NOTE: marked on the stream the stage runs on, after its wait for NCCL's, so a
        receiver still busy with earlier work shows the arrival late by as much (as a GPU
        still busy shows its actions late); NCCL's own stream is not ours to mark.
        """
        clock, marks, self._marks = self._clock, self._marks, []
        if clock is None:
            return
        for sent, index, mark in marks:
            at = clock.ns(mark)
            if sent:
                tag, peer, _ = self.sent[index]
                self.sent[index] = (tag, peer, at)
            else:
                self.transfers[index] = dataclasses.replace(self.transfers[index], done_ns=at)

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
            if self._clock is not None:
                self._marks.append((False, len(self.transfers), self._clock.mark()))
        except Aborted:
            raise self._raised() from None
        except TimeoutError:
            sender = self._ranks[self._device_of(sending_stage(tag))]
            what = (
                f"rank {self._rank} got no {tag[0]} for stage {tag[1]}, micro-batch {tag[2]} "
                f"from rank {sender} within {self._timeout:g} s"
            )
            self.fail(self._named(sender, what))
            raise self._raised() from None
        finally:
            self.waiting = False
        message = receipt.message
        nbytes = sum(t.numel() * t.element_size() for t in message.tensors)
        self.transfers.append(
            Transfer(tag, message.peer, message.posted_ns, message.done_ns, nbytes)
        )
        return rebuild(receipt.signature, message.tensors)

    def collect(self, tag: Tag) -> Any:
        """Take a message for the caller's side that must already be here."""
        return self._box.take_ready(tag)

    def abort(self, error: BaseException | None = None) -> None:
        """This rank failed (``error``): tell every rank, and wake this rank's worker."""
        if isinstance(error, PipelineFailure):  # heard from elsewhere: already reported
            self._heard(error.failure)
            return
        action = getattr(error, "gpipe_action", None)
        if error is None or isinstance(error, KeyboardInterrupt):
            text = "KeyboardInterrupt: interrupted (Ctrl-C or SIGINT)"
        else:  # NOTE: the failure names the stage, micro-batch and action itself
            first = next(iter(str(error).splitlines()), "")
            text = f"{type(error).__name__}: {unplaced(first)}"
        self.fail(
            Failure(
                self._rank,
                text,
                stage=None if action is None else action.stage,
                microbatch=None if action is None else action.microbatch,
                action=None if action is None else str(action),
            )
        )

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
                self.fail(Failure(self._rank, f"a send did not complete: {error}"))
        if self.failure is not None:
            raise PipelineFailure(self.failure, self._rank)
        self._known.add(self._key)

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
            self._join(wait)

    def release(self, grace: float = 2.0) -> None:
        """After a failure, once the groups' links are closed (mesh.retire): let this rank's
        threads end, waiting ``grace`` s at most.

        NOTE: a thread still waiting in gloo when the interpreter finalizes drops its work
        there, and the work's destructor, taking the GIL from a thread Python is ending,
        aborts the process ("terminate called without an active exception"); closed links
        fail those waits, so the threads end while the interpreter still runs.
        """
        self.close()
        self._join(grace)
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
        plans = self._plans.setdefault(self._key, {})
        known = self._key in self._known
        outgoing: list[tuple[Tag, int, Signature, list[torch.Tensor]]] = []
        incoming: list[tuple[Tag, int]] = []
        changed: list[str] = []
        for op in batch.ops:
            peer = self._ranks[op.peer]
            self._peers_used.add(peer)
            if op.direction != SEND:
                incoming.append((op.tag, peer))
                continue
            signature, tensors = flatten(self._stash.pop(op.tag))
            if known:
                expected = plans.get(op.tag)
                if expected != signature:
                    # NOTE: the receiver posted receives of the remembered shapes: fill
                    # them, so every later message still meets its own, then fail
                    changed.append(_changed(op.tag, expected, signature))
                    assert expected is not None
                    signature = expected
                    tensors = receive_buffers(expected, self._torch_device)
            else:
                plans[op.tag] = signature
            outgoing.append((op.tag, peer, signature, tensors))
        if known:
            signatures = {tag: plans[tag] for tag, _ in incoming}
        else:
            signatures = self._agree(outgoing, incoming)
            plans.update(signatures)
        messages = [Message(True, peer, tensors) for _, peer, _, tensors in outgoing]
        for tag, peer in incoming:
            buffers = receive_buffers(signatures[tag], self._torch_device)
            message = Message(False, peer, buffers)
            self._receipts[tag] = _Receipt(message, signatures[tag])
            messages.append(message)
        self._poster.post(messages)
        now = time.perf_counter_ns()
        if self._clock is not None and outgoing:
            mark = self._clock.mark()
            self._marks += [(True, len(self.sent) + i, mark) for i in range(len(outgoing))]
        self.sent.extend((tag, peer, now) for tag, peer, _, _ in outgoing)
        if not self.overlap:
            for message in messages:
                if not message.send:
                    self._poster.wait(message)
            self._poster.drain(lambda: self.failure is not None)
        if changed:
            raise RuntimeError(
                "; ".join(changed) + ": the shapes of a stage's messages must follow from the "
                "step's input shapes (gpipe posts each receive in the shapes it had in the last "
                "step with the same input shapes)"
            )

    def _agree(
        self,
        outgoing: list[tuple[Tag, int, Signature, list[torch.Tensor]]],
        incoming: list[tuple[Tag, int]],
    ) -> dict[Tag, Signature]:
        """The first step of a key: tell and hear every message's signature, in two rounds
        of the batch's own shape (sizes, then the JSON), before its tensors go."""
        device = self._torch_device
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
        outgoing: list[tuple[Tag, int, Signature, list[torch.Tensor]]],
        sent: list[torch.Tensor],
        incoming: list[tuple[Tag, int]],
        received: list[torch.Tensor],
    ) -> None:
        """Post one tensor per message of the batch and wait for the received ones."""
        messages = [Message(True, peer, [t]) for (_, peer, _, _), t in zip(outgoing, sent)]
        receives = [Message(False, peer, [t]) for (_, peer), t in zip(incoming, received)]
        self._poster.post(messages + receives)
        try:
            for message in receives:
                self._poster.wait(message)
        except Aborted:
            raise self._raised() from None
        except TimeoutError:
            self.fail(Failure(self._rank, f"no message signature came within {self._timeout:g} s"))
            raise self._raised() from None

    # -- pieces ------------------------------------------------------------------------

    def _device_of(self, stage: int) -> int:
        if 0 <= stage < len(self._placement):
            return self._placement[stage]
        return self._device  # the caller's side: inputs and outputs stay on this rank

    def _raised(self) -> PipelineFailure:
        assert self.failure is not None
        return PipelineFailure(self.failure, self._rank)

    def _link_failed(self, peer: int, error: BaseException) -> None:
        """A link to ``peer`` broke: name the rank that failed (see :meth:`_named`)."""
        what = (
            f"rank {self._rank} lost its link to rank {peer} ({_link_cause(error, self._timeout)})"
        )
        self.fail(self._named(peer, what))

    def _named(self, suspect: int, what: str) -> Failure:
        """Whom a failed wait for ``suspect`` blames: a failure already heard, else the fault
        channel's culprit (a reported failure, or the rank that fell silent), else
        ``suspect``."""
        if self.failure is not None:
            return self.failure
        if self._blame is not None:
            return self._blame(suspect, what)
        return Failure(
            suspect, f"{what}: that rank died, hung past the timeout, or its network failed"
        )

    def _heard(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure
        # NOTE: the two ends may have stopped at different messages: learn shapes anew
        self._known.clear()
        self._plans.clear()
        self._box.abort()
        self._poster.abort()

    def _join(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for thread in self._poster.threads():
            thread.join(max(0.0, deadline - time.monotonic()))


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


def _link_cause(error: BaseException, timeout: float) -> str:
    """Why a link failed, in one short clause; a timeout named with the pipe's own."""
    text = brief(error)
    if "timeout" in text.lower() or "timed out" in text.lower():
        return f"nothing came within the timeout of {timeout:g} s: DistributedGPipe(timeout=...)"
    return text
