"""The point-to-point transport: stage messages between processes over torch.distributed.

Each pair of ranks has one channel per direction, a FIFO in the *sender's* order: the sender
sends a small header (step, signature number, tag), the signature the first time it uses
that number, then the tensors, all with ``isend``; it never waits for them (a completion
thread does). On the receiving rank, one thread per sending peer keeps the next message's
receives posted ahead, its header's *and its tensors'*, and files each finished message in
the rank's mailbox under its tag. The worker takes messages by tag, in whatever order its
actions need them. So the two sides of a pair always agree on the order (NCCL, which has no
tags, needs exactly that) and no schedule can make them swap micro-batches; a receive is
under way before the action that needs it starts; and a send never stalls the stage that
made it.

The tensors' receives can be posted before their header has come because a step repeats the
last one: both sides of a channel predict that its ``j``-th message of a step has the tensor
shapes and dtypes its ``j``-th message had in the last step of the same kind (training or
not). NOTE: a receive posted only once the header is read costs the transport's rendezvous
on top (gloo: the sender announces the message, the receiver answers, then the data moves),
measured at 0.3-2 ms per message on two loaded cores against 0.1 ms posted ahead. When a
message's shapes differ from the prediction (the first step, a smaller last micro-batch, a
model whose shapes change), the sender knows, since it keeps the same prediction: it sends
filler tensors of the predicted shapes into the receives already posted, then the real ones,
which the receiver posts once the header told it their shapes. Headers and signatures travel
on tags of their own, so they never meet a posted tensor receive even when the control and
data groups are one (gloo).

Nothing here blocks the worker in torch.distributed: it waits only on its mailbox, which a
failure anywhere (this rank, a peer, a vanished process, a timeout) wakes at once.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpipe.distributed.faults import Failure, PipelineFailure, brief
from gpipe.distributed.wire import Signature, decode, encode, flatten, rebuild, receive_buffers
from gpipe.runtime.mailbox import Mailbox
from gpipe.runtime.routes import Routes
from gpipe.runtime.step import unplaced
from gpipe.runtime.transport import ACTIVATION, GRADIENT, Aborted, Tag
from gpipe.schedule import BACKWARD, FORWARD, Schedule

__all__ = ["P2PTransport", "Transfer", "inbound"]

_KINDS = {ACTIVATION: 0, GRADIENT: 1}
_KIND_NAMES = {code: kind for kind, code in _KINDS.items()}
# step, signature number, signature bytes (0 if known), kind, stage, micro-batch, and the
# sending stage of a dataflow's tag (see gpipe.runtime.routes), or _CHAIN for a chain's
_HEADER = 7
_CHAIN = -(2**62)
# gloo tags of the control messages (the data group's tensors use torch's default, 0, as
# NCCL, which has no tags, needs): a posted tensor receive never takes a header.
_HEADER_TAG = 1
_SIGNATURE_TAG = 2
_CLOSE_TAG = 3  # never sent: a receive on it times out, closing its link (see release)
_AT_ONCE = datetime.timedelta(milliseconds=1)
# Backends whose batched point-to-point ops run as one operation (see _Link).
BATCHED_BACKENDS = frozenset({"nccl"})
# A tensor message's layout: each tensor's (shape, dtype), what a posted receive must match.
Layout = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@dataclass(frozen=True)
class Transfer:
    """One message received from another rank, as the timeline shows it.

    Times are this rank's ``perf_counter_ns``: ``posted`` when its receives were posted
    (its header's, and its tensors' if their shapes were predicted), ``done`` when its
    tensors had arrived.
    """

    tag: Tag
    source: int
    posted_ns: int
    done_ns: int
    nbytes: int


def _layout(signature: Signature) -> Layout:
    return tuple((shape, dtype) for _, shape, dtype, _ in signature.tensors)


@dataclass
class _Plans:
    """What one channel's messages looked like, to post the next step's receives ahead.

    Both ends keep one, updated alike with every message, so the sender knows what the
    receiver has posted: ``layouts[n]`` is the layout of signature number ``n``, and
    ``numbers[key][j]`` the signature number of the ``j``-th message of the last step of
    kind ``key`` that had one.
    """

    layouts: list[Layout] = field(default_factory=list)
    numbers: dict[Any, list[int]] = field(default_factory=dict)

    def predict(self, key: Any, j: int) -> Layout | None:
        """The layout the ``j``-th message of a step of kind ``key`` is expected to have."""
        seen = self.numbers.get(key)
        return self.layouts[seen[j]] if seen is not None and j < len(seen) else None

    def note(self, key: Any, j: int, number: int) -> None:
        """The ``j``-th message of this step has signature number ``number``."""
        seen = self.numbers.setdefault(key, [])
        if j < len(seen):
            seen[j] = number
        else:
            seen.append(number)


@dataclass
class _Outbound:
    """The sending side of one channel: the signatures already numbered on it, what the
    receiver predicts, and how many messages this step has sent."""

    numbers: dict[Any, int] = field(default_factory=dict)
    plans: _Plans = field(default_factory=_Plans)
    sent: int = 0
    # the signature number of a message of one tensor, by its key (see _single): the usual
    single: dict[tuple[Any, ...], int] = field(default_factory=dict)


class P2PTransport:
    """Carries one rank's messages to and from the ranks holding the other stages.

    Args:
        placement: ``placement[s]``: the pipeline device (pipeline rank) of stage ``s``.
        device: this rank's pipeline device.
        ranks: ``ranks[d]``: the global rank of pipeline device ``d``.
        torch_device: where this rank's stages run; received tensors land there.
        group: the process group carrying tensors (gloo or NCCL).
        control: the process group carrying headers and signatures (gloo, CPU).
        timeout: seconds to wait for one message before declaring its sender lost.
        report: called with this rank's failure, to tell the other ranks (the fault
            channel); returns the failure every rank will name.
        overlap: post receives ahead and complete sends in the background (the point of
            this transport). False is for measuring what that buys: a send waits until
            its message is received, and a message is received only once an action asks
            for one from that peer (so each rank must consume a peer's messages in the
            order they were sent, as GPipe's fill-drain does).
    """

    def __init__(
        self,
        placement: tuple[int, ...],
        device: int,
        ranks: list[int],
        torch_device: torch.device,
        group: Any,
        control: Any,
        timeout: float,
        report: Callable[[Failure], Failure],
        overlap: bool = True,
    ) -> None:
        self._placement = placement
        self._device = device
        self._ranks = ranks
        self._rank = ranks[device]
        self._torch_device = torch_device
        self._group = group
        self._control = control
        self._timeout = timeout
        self._report = report
        self.overlap = overlap
        self._box = Mailbox()
        self._step = 0
        self._key: Any = None  # the kind of step (see expect): what predictions key on
        self._outbound: dict[int, _Outbound] = {}
        self._inbound: dict[int, _Inbound] = {}
        self._sends = _Sender(self, timeout)
        self._links: dict[int, tuple[_Link, _Link]] = {}  # peer: (control, data)
        self.failure: Failure | None = None
        self.transfers: list[Transfer] = []  # received this step
        self.sent: list[tuple[Tag, int, int]] = []  # (tag, peer, perf_counter_ns) this step

    # -- the Transport protocol --------------------------------------------------------

    def reset(self) -> None:
        """A new step: an empty mailbox, no transfers recorded yet."""
        if self.failure is not None:
            raise PipelineFailure(self.failure, self._rank)
        self._box.clear()
        self._step += 1
        self.transfers = []
        self.sent = []
        for outbound in self._outbound.values():
            outbound.sent = 0

    def send(self, tag: Tag, value: Any) -> None:
        """Deliver ``value``: to this rank's mailbox, or to the rank holding its stage."""
        device = self._device_of(tag[1])
        if device == self._device:
            self._box.put(tag, value)
            return
        self._send_remote(self._ranks[device], tag, value)

    def recv(self, tag: Tag) -> Any:
        """Wait for the message ``tag``: it is local, or a receiver thread files it.

        Raises:
            PipelineFailure: a rank failed or vanished, or nothing came within the timeout.
        """
        try:
            sender = self._sender_of(tag)
            if not self.overlap and sender != self._rank:
                self._inbound[sender].asked.release()
            return self._box.take(tag, self._timeout)
        except Aborted:
            assert self.failure is not None
            raise PipelineFailure(self.failure, self._rank) from None
        except TimeoutError:
            sender = self._sender_of(tag)
            failure = self.fail(
                Failure(
                    sender,
                    f"rank {self._rank} got no {tag[0]} for stage {tag[1]}, micro-batch "
                    f"{tag[2]} from rank {sender} within {self._timeout:g} s: that rank died, "
                    "hung, or is not running the same pipe",
                )
            )
            raise PipelineFailure(failure, self._rank) from None

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

    def expect(self, counts: dict[int, int], key: Any = None) -> None:
        """Receive this step's messages: ``counts[device]`` from each sending device.

        Each peer's receiver thread starts on them at once, so a message is received as soon
        as it is sent, before the action that needs it asks for it. ``key`` names the kind
        of step (every rank gives the same): its messages' shapes are predicted from the
        last step of that kind, so their receives are posted ahead of their headers.
        """
        self._key = key
        for device, count in counts.items():
            rank = self._ranks[device]
            if count:
                if rank not in self._inbound:
                    self._inbound[rank] = _Inbound(self, rank)
                self._inbound[rank].jobs.put((self._step, count, key))

    def finish(self) -> None:
        """Wait until every send of this step has been received (or a failure).

        Raises:
            PipelineFailure: a rank failed, or a send did not complete within the timeout.
        """
        try:
            self._sends.drain(lambda: self.failure is not None)
        except TimeoutError as error:
            self.fail(Failure(self._rank, f"a send did not complete: {error}"))
        if self.failure is not None:
            raise PipelineFailure(self.failure, self._rank)

    def fail(self, failure: Failure) -> Failure:
        """Record ``failure`` (reported to every rank), wake the worker; return the first."""
        if self.failure is None:
            failure = self._report(failure)
        self._heard(failure)
        assert self.failure is not None
        return self.failure

    def close(self, wait: float = 2.0) -> None:
        """Stop the receiving and sending threads, and wait (``wait`` s at most) for them.

        Between steps the threads are idle, so they end at once. NOTE: a thread left to end
        while the interpreter finalizes (at exit) can abort the process as it drops a gloo
        work (see ``_Sender._send``). After a failure a thread may still wait in gloo: then
        nothing is waited for here (see :meth:`release`).
        """
        for inbound in self._inbound.values():
            inbound.jobs.put(None)
        self._sends.close()
        if self.failure is None:
            self._join(wait)

    def release(self, grace: float = 2.0) -> None:
        """After a failure, at exit: close this rank's links and let its threads end.

        NOTE: a thread still waiting in gloo when the interpreter finalizes drops its work
        there, and the work's destructor, taking the GIL from a thread Python is ending,
        aborts the process ("terminate called without an active exception", exit 134
        instead of the error's own). A receive that times out closes its pair, failing
        every wait on it: so each link gets a receive that times out at once, and the
        threads, woken, end while the interpreter still runs.
        """
        self.close()
        # NOTE: the control group is gloo; the data group is the same group on a CPU pipe,
        # and NCCL otherwise, whose waits do not block a thread
        for peer in set(self._inbound) | set(self._links):
            with contextlib.suppress(Exception):  # closed, as meant (or already)
                _Link(self._control, peer).recv(torch.empty(1), _CLOSE_TAG).wait(_AT_ONCE)
        self._join(grace)

    def _join(self, seconds: float) -> None:
        """Wait (``seconds`` at most in all) for the receiving and sending threads to end."""
        deadline = time.monotonic() + seconds
        threads = [inbound.thread for inbound in self._inbound.values()]
        for thread in [*threads, self._sends.thread]:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    # -- pieces ------------------------------------------------------------------------

    def _heard(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure
        self._box.abort()

    def _device_of(self, stage: int) -> int:
        if 0 <= stage < len(self._placement):
            return self._placement[stage]
        return self._device  # the caller's side: inputs and outputs stay on this rank

    def _sender_of(self, tag: Tag) -> int:
        neighbour = tag[1] - 1 if tag[0] == ACTIVATION else tag[1] + 1
        source = tag[3] if len(tag) == 4 else neighbour
        return self._ranks[self._device_of(source)]

    def _send_remote(self, peer: int, tag: Tag, value: Any) -> None:
        outbound = self._outbound.get(peer)
        if outbound is None:
            outbound = self._outbound[peer] = _Outbound()
        encoded = None
        # NOTE: a message of one tensor (an activation, or an input's gradient in its list)
        # whose signature this channel has numbered skips the tree walk and the signature's
        # key: 25-60 us on the worker, cold after a kernel (a gradient took 90 us without)
        single = _single(value)  # (key, tensor), or None
        number = None if single is None else outbound.single.get(single[0])
        if single is not None and number is not None:
            tensor = single[1]
            tensors = [tensor if tensor.is_contiguous() else tensor.contiguous()]
        else:
            signature, tensors = flatten(value)
            signature_key = _signature_key(signature)
            number = outbound.numbers.get(signature_key)
            if number is None:
                number = outbound.numbers[signature_key] = len(outbound.numbers)
                outbound.plans.layouts.append(_layout(signature))
                encoded = encode(signature)
            if single is not None:
                outbound.single[single[0]] = number
        j, outbound.sent = outbound.sent, outbound.sent + 1
        predicted = outbound.plans.predict(self._key, j)
        outbound.plans.note(self._key, j, number)
        fillers: list[torch.Tensor] = []
        if predicted is not None and predicted != outbound.plans.layouts[number]:
            # the receiver posted receives of other shapes: fill them, then send the real
            fillers = [torch.empty(s, dtype=d, device=self._torch_device) for s, d in predicted]
        sender = tag[3] if len(tag) == 4 else _CHAIN
        size = 0 if encoded is None else encoded.numel()
        header = [self._step, number, size, _KINDS[tag[0]], tag[1], tag[2], sender]
        links = self._links.get(peer)
        if links is None:
            links = self._links[peer] = (_Link(self._control, peer), _Link(self._group, peer))
        self._sends.add(_Outgoing(tag, links, header, encoded, fillers + tensors, len(fillers)))
        if not self.overlap:
            self.finish()


class _Inbound:
    """One sending peer's messages, received in its order by a thread of their own."""

    def __init__(self, transport: P2PTransport, peer: int) -> None:
        self.transport = transport
        self.peer = peer
        self.data = _Link(transport._group, peer)
        self.control = _Link(transport._control, peer)
        self.jobs: queue.Queue[tuple[int, int, Any] | None] = queue.Queue()
        self.asked = threading.Semaphore(0)  # without overlap: receive only when asked
        self.signatures: dict[int, Signature] = {}
        self.plans = _Plans()
        self.thread = threading.Thread(
            target=self._run, name=f"gpipe-recv-from-rank{peer}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        transport = self.transport
        while (job := self.jobs.get()) is not None:
            step, count, key = job
            for j in range(count):
                if not transport.overlap:
                    self.asked.acquire()
                transfers = transport.transfers  # this step's, even if the next has begun
                try:
                    tag, value, buffers, posted = self._receive(step, key, j)
                except Exception as error:
                    lost = _link_lost(transport._rank, self.peer, error, transport._timeout)
                    transport.fail(lost)
                    return
                # NOTE: the worker may be waiting for this message: hand it over first
                done = time.perf_counter_ns()
                transport._box.put(tag, value)
                nbytes = sum(b.numel() * b.element_size() for b in buffers)
                transfers.append(Transfer(tag, self.peer, posted, done, nbytes))

    def _receive(self, step: int, key: Any, j: int) -> tuple[Tag, Any, list[torch.Tensor], int]:
        """The ``j``-th message of this step from the peer: its header and, posted at once,
        its tensors' receives in the shapes the plans predict; with its tensors and when
        its receives were posted."""
        device = self.transport._torch_device
        header = torch.empty(_HEADER, dtype=torch.int64)
        heading = self.control.recv(header, _HEADER_TAG)
        posted = time.perf_counter_ns()
        predicted = self.plans.predict(key, j)
        buffers: list[torch.Tensor] = []
        works: list[Any] = []
        if predicted is not None:
            buffers = [torch.empty(s, dtype=d, device=device) for s, d in predicted]
            works = self.data.recv_all(buffers)
        heading.wait()
        sent_step, number, size, kind, stage, microbatch, sender = header.tolist()
        if sent_step != step:
            raise RuntimeError(
                f"rank {self.peer} sent a message of step {sent_step} during step {step}: "
                "the ranks are not running the same steps"
            )
        if size:
            data = torch.empty(size, dtype=torch.uint8)
            self.control.recv(data, _SIGNATURE_TAG).wait()
            self.signatures[number] = decode(data)
            self.plans.layouts.append(_layout(self.signatures[number]))
        signature = self.signatures[number]
        self.plans.note(key, j, number)
        for work in works:  # the message itself, or fillers if the prediction missed
            work.wait()
        if predicted != self.plans.layouts[number]:
            buffers = receive_buffers(signature, device)
            for work in self.data.recv_all(buffers):
                work.wait()
        tag: Tag = (_KIND_NAMES[kind], stage, microbatch)
        if sender != _CHAIN:
            tag = (*tag, sender)
        return tag, rebuild(signature, buffers), buffers, posted


@dataclass
class _Outgoing:
    """One message handed to the sending thread: its links to the peer (control, data), its
    header's values, its signature if new, and its tensors (any fillers first), which it
    keeps alive until they are sent."""

    tag: Tag
    links: tuple[_Link, _Link]
    header: list[int]  # made a tensor by the thread, off the worker
    signature: torch.Tensor | None  # the encoded signature, the first time it is used
    tensors: list[torch.Tensor]
    fillers: int  # how many of the tensors are fillers


class _Sender:
    """Sends, posted and waited for in order by a thread of their own: a worker only hands a
    message over, and goes on with its next action at once.

    NOTE: a message waits for this thread to wake, 0.2-0.3 ms on two cores (a shorter GIL
    switch interval did not shorten it). Posted by the worker itself, it went out at once
    but cost the worker about as much (two sends, 70-135 us each, run cold after a kernel):
    on the 4-stage sleep pipeline, efficiency 0.944 against 0.952 for GPipe and 0.932
    against 0.932 for 1F1B (medians of four runs each); so did packing a small message and
    its header into one send. The order of the messages on each channel is the order the
    worker handed them over, as the receiver expects.
    """

    def __init__(self, transport: P2PTransport, timeout: float) -> None:
        self._transport = transport
        self._timeout = timeout
        self._jobs: queue.SimpleQueue[_Outgoing | threading.Event | None] = queue.SimpleQueue()
        self._pending = 0  # messages posted and not yet known to have gone
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gpipe-sends", daemon=True)
        self.thread.start()

    def add(self, message: _Outgoing) -> None:
        """Send ``message`` after those handed over before it."""
        with self._lock:
            self._pending += 1
        self._jobs.put(message)

    def drain(self, failed: Callable[[], bool]) -> None:
        """Wait for every send so far, or until ``failed()``.

        Raises:
            TimeoutError: sends still open after the timeout, or a send failed.
        """
        if self._pending:  # NOTE: usually every send has gone: no round trip to the thread
            done = threading.Event()
            self._jobs.put(done)
            deadline = time.monotonic() + self._timeout
            while not done.wait(min(max(deadline - time.monotonic(), 0.0), 0.1)):
                if failed():
                    return
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"sends still open after {self._timeout:g} s")
        if self._error is not None:
            raise TimeoutError(str(self._error))

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        transport = self._transport
        while (job := self._jobs.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                if self._error is None:  # the link broke: nothing more gets through
                    self._send(job)
            except Exception as error:
                self._error = error
                transport.fail(
                    _link_lost(transport._rank, job.links[1].rank, error, transport._timeout)
                )
            finally:
                del job
                with self._lock:
                    self._pending -= 1

    def _send(self, message: _Outgoing) -> None:
        """Post ``message`` and wait until it is sent.

        NOTE: its works end with this call. A gloo work dropped by a thread that outlives
        the interpreter's finalization takes the GIL in its destructor from a thread Python
        is ending, which aborts the process ("terminate called without an active
        exception"): seen at exit in 4 runs of 6 with a ZeroRedundancyOptimizer, from the
        last message's works, which the loop kept until its thread ended.
        """
        control, data = message.links
        header = torch.tensor(message.header, dtype=torch.int64)
        works = [control.send(header, _HEADER_TAG)]
        if message.signature is not None:
            works.append(control.send(message.signature, _SIGNATURE_TAG))
        tensors = message.tensors
        if message.fillers:  # NOTE: a batch of their own, as the receiver posted them
            works += data.send_all(tensors[: message.fillers])
            tensors = tensors[message.fillers :]
        works += data.send_all(tensors)
        self._transport.sent.append((message.tag, data.rank, time.perf_counter_ns()))
        for work in works:
            work.wait()


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: a complex tensor as its real view (as torch's own isend does)."""
    return torch.view_as_real(tensor) if tensor.dtype.is_complex else tensor


class _Link:
    """Posts point-to-point messages to one peer on one group, straight on the group.

    NOTE: ``dist.isend``/``irecv`` look the group and rank up again on every call (about 15
    Python calls): posting a 4-float tensor took 15-18 us that way against 12 us straight
    on the group (medians of 2000 warm posts between two gloo ranks); the group rank is
    found once.

    A message of several tensors goes as one batch (``dist.batch_isend_irecv``) on a
    backend that runs a batch as one operation (NCCL: one group call instead of one launch
    per tensor); gloo runs a batch op by op, so there each tensor is posted straight.
    """

    __slots__ = ("batched", "group", "peer", "rank")

    def __init__(self, group: Any, rank: int) -> None:
        group = group if group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise RuntimeError("point-to-point message outside the pipe's process group")
        self.group = group
        self.rank = rank
        self.peer = dist.get_group_rank(group, rank)
        self.batched = str(dist.get_backend(group)) in BATCHED_BACKENDS

    def send(self, tensor: torch.Tensor, tag: int = 0) -> Any:
        return self.group.send([_wire(tensor)], self.peer, tag)

    def recv(self, tensor: torch.Tensor, tag: int = 0) -> Any:
        return self.group.recv([_wire(tensor)], self.peer, tag)

    def send_all(self, tensors: list[torch.Tensor]) -> list[Any]:
        """Post the sends of one message's tensors, in order (a batch where it pays)."""
        if self.batched and len(tensors) > 1:
            return self._batch(dist.isend, tensors)
        return [self.send(t) for t in tensors]

    def recv_all(self, tensors: list[torch.Tensor]) -> list[Any]:
        """Post the receives of one message's tensors, in order, as the sender batched them."""
        if self.batched and len(tensors) > 1:
            return self._batch(dist.irecv, tensors)
        return [self.recv(t) for t in tensors]

    def _batch(self, op: Callable[..., Any], tensors: list[torch.Tensor]) -> list[Any]:
        ops = [dist.P2POp(op, _wire(t), group=self.group, group_peer=self.peer) for t in tensors]
        return dist.batch_isend_irecv(ops)


def _link_lost(rank: int, peer: int, error: BaseException, timeout: float) -> Failure:
    return Failure(
        peer,
        f"rank {rank} lost its link to rank {peer} ({_link_cause(error, timeout)}): that rank "
        "died, hung past the timeout, or its network failed",
    )


def _link_cause(error: BaseException, timeout: float) -> str:
    """Why a link failed, in one short clause; a timeout named with the pipe's own."""
    text = brief(error)
    if "timeout" in text.lower() or "timed out" in text.lower():
        return f"nothing came within the timeout of {timeout:g} s: DistributedGPipe(timeout=...)"
    return text


def _single(value: Any) -> tuple[tuple[Any, ...], torch.Tensor] | None:
    """A message of one tensor, alone or as a one-element list (a stage input's gradient):
    its key among a channel's signatures, and the tensor; None for any other message."""
    if type(value) is torch.Tensor:
        tensor, boxed = value, False
    elif type(value) is list and len(value) == 1 and type(value[0]) is torch.Tensor:
        tensor, boxed = value[0], True
    else:
        return None
    return (boxed, tuple(tensor.shape), tensor.dtype, tensor.requires_grad), tensor


def _signature_key(signature: Signature) -> Any:
    """A hashable stand-in for ``signature`` (its values may not be hashable)."""
    try:
        key = (repr(signature.spec), signature.leaves)
        hash(key)
        return key
    except TypeError:
        return encode(signature).numpy().tobytes()


def inbound(schedule: Schedule, device: int, routes: Routes | None = None) -> dict[int, int]:
    """How many messages ``device`` receives from each other device in one step of ``schedule``.

    In a chain, an F receives its stage's input from the previous stage, a B its output's
    gradient from the next; in a dataflow (``routes``), an F one message from each stage it
    reads from, a B one from each stage that read its output. The last stage's backward
    starts from its own loss, never a message; the pipe's inputs come from this rank.
    """
    placement, last = schedule.placement, schedule.stages - 1
    counts: dict[int, int] = {}
    for action in schedule.actions[device]:
        stage = action.stage
        if action.kind == FORWARD:
            if routes is None:
                senders = [stage - 1] if stage > 0 else []
            else:
                senders = [source for source, _ in routes.sources[stage] if source >= 0]
        elif action.kind == BACKWARD and stage < last:
            senders = [stage + 1] if routes is None else [r for r, _ in routes.readers[stage]]
        else:
            continue
        for sender in senders:
            source = placement[sender]
            if source != device:
                counts[source] = counts.get(source, 0) + 1
    return counts
