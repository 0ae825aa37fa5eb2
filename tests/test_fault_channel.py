"""The fault channel: an idle pipe asks the store nothing; a failure wakes every rank at once."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from gpipe.distributed.failure import Failure
from gpipe.distributed.fault_channel import FaultChannel
from gpipe.distributed.waiting import wait_for


class Counting:
    """A store that counts the requests each method makes."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            with self.lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            return method(*args)

        return counted


def test_an_idle_channel_sends_one_blocking_wait_and_nothing_more() -> None:
    store = Counting()
    channel = FaultChannel(store, "p", 0, lambda failure: None, world=2)
    time.sleep(0.5)
    assert store.calls == {"wait": 1}
    started = time.monotonic()
    channel.close()
    # a hang check (usually milliseconds; close may wait 4 s for a slow store): a watcher
    # nothing wakes would wait out its hour
    assert time.monotonic() - started < 120


def test_a_published_failure_wakes_every_ranks_watcher_naming_the_rank() -> None:
    store = Counting()
    heard: list[tuple[int, Failure]] = []
    done = threading.Event()

    def listener(rank: int) -> Any:
        def on_failure(failure: Failure) -> None:
            heard.append((rank, failure))
            if len(heard) == 3:
                done.set()

        return on_failure

    channels = [FaultChannel(store, "p", r, listener(r), world=3) for r in range(3)]
    first = channels[2].publish(Failure(2, "ValueError: boom", stage=1, microbatch=0))
    assert done.wait(10), heard  # usually milliseconds; unwoken, the watchers wait an hour
    assert sorted(rank for rank, _ in heard) == [0, 1, 2]
    assert all(failure == first and failure.rank == 2 for _, failure in heard)
    # a second report loses: every rank names the first cause
    assert channels[0].publish(Failure(0, "RuntimeError: later")) == first
    for channel in channels:
        channel.close()


class Freezable:
    """A store that, once frozen, answers nothing ever again (a stopped host)."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.frozen = threading.Event()
        self._never = threading.Event()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            if self.frozen.is_set():
                self._never.wait()
            return method(*args)

        return call


@contextlib.contextmanager
def _channels(world: int, beat: float = 0.1) -> Iterator[list[FaultChannel]]:
    """A channel per rank on one in-process store, all closed at the end, passed or not."""
    store = dist.HashStore()
    channels = [
        FaultChannel(store, "p", r, lambda failure: None, world=world, token=b"k", beat=beat)
        for r in range(world)
    ]
    try:
        yield channels
    finally:
        for channel in channels:
            channel.close()


def test_the_culprit_is_the_rank_whose_beats_stopped_not_the_one_waited_for() -> None:
    with _channels(3) as channels:
        for channel in channels:
            channel.progress = lambda: {"done": 0, "waiting": True}
            channel._heartbeat._busy = 1  # inside a step
        time.sleep(0.3)
        channels[1].close()  # rank 1 stops beating: stopped, or dead
        failure = channels[0].culprit(2, "rank 0 got nothing from rank 2", [0, 1, 2])
        assert failure.rank == 1 and "stopped answering" in failure.error, failure
        assert "rank 0 got nothing from rank 2" in failure.error


def test_the_culprit_is_a_rank_that_beats_but_makes_no_progress_outside_a_wait() -> None:
    with _channels(3) as channels:
        count = iter(range(10**6))
        channels[1].progress = lambda: {"done": 7, "waiting": False, "doing": "a step"}  # stuck
        channels[2].progress = lambda: {"done": next(count), "waiting": False}  # working
        for channel in channels:
            channel._heartbeat._busy = 1
        time.sleep(0.3)
        failure = channels[0].culprit(2, "rank 0 got nothing from rank 2", [0, 1, 2])
        assert failure.rank == 1 and "made no progress" in failure.error, failure


def test_with_every_rank_alive_and_waiting_the_culprit_is_the_suspect() -> None:
    with _channels(2) as channels:
        for channel in channels:
            channel.progress = lambda: {"done": 0, "waiting": True}
            channel._heartbeat._busy = 1
        time.sleep(0.3)
        failure = channels[0].culprit(1, "rank 0 lost its link to rank 1", [0, 1])
        assert failure.rank == 1 and failure.error.startswith("rank 0 lost its link to rank 1")
        assert channels[0].culprit(-1, "a collective broke", None).rank == -1


def test_a_reported_failure_wins_over_any_culprit() -> None:
    with _channels(2) as channels:
        reported = channels[1].publish(Failure(1, "ValueError: boom"))
        assert channels[0].culprit(1, "rank 0 lost its link to rank 1", [0, 1]) == reported


class Slow:
    """A store whose beat writes take ``seconds`` (a busy host, as every rank exits)."""

    def __init__(self, seconds: float) -> None:
        self.store = dist.HashStore()
        self.seconds = seconds
        self.writing = threading.Event()
        self.written = threading.Event()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            slow = name == "set" and "/alive/" in args[0]
            if slow:
                self.writing.set()
                time.sleep(self.seconds)
            result = method(*args)
            if slow:
                self.written.set()
            return result

        return call


def test_close_waits_for_the_store_requests_in_flight() -> None:
    """A request that returns once the interpreter is finalizing aborts the process, so
    the close at exit must not leave one behind (it waited a second for the beats)."""
    store = Slow(1.8)
    channel = FaultChannel(store, "p", 0, lambda failure: None, world=2, beat=0.05)
    channel.progress = lambda: {"done": 0, "waiting": False}
    channel._heartbeat._busy = 1  # inside a step: beating
    assert store.writing.wait(5)
    channel.close()
    assert store.written.is_set()
    assert not channel._ask._thread.is_alive()  # the requests thread ended with close


def test_a_silent_store_names_rank_0_that_hosts_it_within_its_bound() -> None:
    store = Freezable()
    channel = FaultChannel(store, "p", 1, lambda failure: None, world=2, ask=0.5)
    store.frozen.set()
    started = time.monotonic()
    failure = channel.culprit(2, "rank 1 got nothing from rank 0", [0, 1, 2])
    assert failure.rank == 0 and "store" in failure.error, failure
    channel.publish(Failure(1, "later"))  # bounded too: the store is known silent
    channel.acknowledge(2)
    channel.close()
    # a hang check: usually the 0.5 s bound; unbounded, a frozen store never answers
    assert time.monotonic() - started < 10
    store.frozen.clear()  # the host resumes: the threads left waiting on it end
    store._never.set()
    store.store.set(f"{channel._prefix}/wake/1", b"closed")


def test_a_forged_failure_record_is_ignored_and_a_real_one_replaces_it() -> None:
    store = Counting()
    heard: list[Failure] = []
    channel = FaultChannel(store, "p", 0, heard.append, world=1, token=b"secret")
    forged = {"failure": json.dumps({"rank": 3, "error": "x"}), "mac": "0" * 64}
    store.store.set(f"{channel._prefix}/failure", json.dumps(forged).encode())
    store.store.set(f"{channel._prefix}/wake/0", b"failure")
    time.sleep(0.5)
    assert heard == [] and channel.check() is None
    first = channel.publish(Failure(0, "ValueError: real"))
    assert first.error == "ValueError: real" and heard == [first]
    other = FaultChannel(store, "p", 0, lambda failure: None, world=1, token=b"other")
    assert other.check() is None  # signed under another job's token: not ours
    for c in (channel, other):
        c.close()


def test_a_rank_between_steps_is_named_only_when_no_rank_in_the_step_is_stuck() -> None:
    with _channels(3) as channels:
        channels[0].progress = lambda: {"done": 0, "waiting": True}
        channels[2].progress = lambda: {"done": 3, "waiting": False, "doing": "a step"}  # stuck
        channels[0]._heartbeat._busy = channels[2]._heartbeat._busy = 1
        with channels[1].busy():  # rank 1 did its part of the step, and left it
            time.sleep(0.3)
        time.sleep(0.3)
        failure = channels[0].culprit(2, "rank 0 got nothing from rank 2", [0, 1, 2])
        assert failure.rank == 2 and "made no progress" in failure.error, failure
        channels[2]._heartbeat._busy = 0  # now rank 2 waits for rank 1, which is outside the step
        channels[2].progress = lambda: {"done": 3, "waiting": True}
        channels[2]._heartbeat._busy = 1
        failure = channels[0].culprit(2, "rank 0 got nothing from rank 2", [0, 1, 2])
        assert failure.rank == 1 and "outside the pipe's step" in failure.error, failure


def test_a_rank_that_left_an_earlier_step_and_fell_silent_is_named_as_stopped() -> None:
    # rank 1 finished step 1, entered step 2 and was stopped before its first beat there:
    # its last record says idle, but of an earlier step than the one rank 0 waits in
    with _channels(2) as channels:
        channels[0].progress = lambda: {"done": 0, "waiting": True}
        with channels[1].busy():
            time.sleep(0.3)
        time.sleep(0.3)
        with channels[0].busy():  # step 1
            pass
        with channels[0].busy():  # step 2, where rank 0 waits for rank 1
            failure = channels[0].culprit(1, "rank 0 got nothing from rank 1", [0, 1])
        assert failure.rank == 1 and "stopped answering" in failure.error, failure


def test_a_collectives_work_is_freed_on_the_waiting_thread_not_its_helper() -> None:
    """torch frees a work with the GIL released: freed on a daemon helper as the interpreter
    finalizes, that aborts the process. The helper lets go of it before saying it is done."""
    freed: list[str] = []

    class Work:
        def is_completed(self) -> bool:
            return False

        def wait(self) -> None:
            time.sleep(0.01)

        def __del__(self) -> None:
            freed.append(threading.current_thread().name)

    for _ in range(20):
        work = Work()
        wait_for(work, None, lambda: None, 0)
        del work
    assert freed == [threading.current_thread().name] * 20


def test_a_restarted_attempt_reads_nothing_an_earlier_attempt_wrote() -> None:
    """torchrun hands every attempt the same store: the earlier attempt's failure record,
    beats and acknowledgements must not reach the next (same prefix, same token even)."""
    store = Counting()
    heard: list[Failure] = []
    old = FaultChannel(store, "p", 0, lambda failure: None, world=2, token=b"k", attempt=0)
    old.progress = lambda: {"done": 0, "waiting": True}
    with old.busy():
        time.sleep(1.2)  # one beat written
    old.publish(Failure(1, "ValueError: the earlier attempt's"))
    old.acknowledge(2, grace=0.1)
    old.close()
    new = FaultChannel(store, "p", 0, heard.append, world=2, token=b"k", attempt=1)
    try:
        time.sleep(0.3)  # a watcher woken by the earlier attempt's wake key would hear it
        assert heard == [] and new.check() is None
        assert new._heartbeat._records([0]) == {0: None}  # no beat of the earlier attempt
        assert store.store.add(f"{new._prefix}/failure/heard", 0) == 0  # nobody heard yet
        assert new._prefix != old._prefix and new._prefix.endswith("attempt-1")
    finally:
        new.close()


def test_the_attempt_comes_from_torchruns_restart_count(monkeypatch: Any) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    channel = FaultChannel(dist.HashStore(), "p", 0, lambda failure: None, world=1)
    assert channel._prefix == "p/attempt-3"
    channel.close()


def test_beats_a_rank_did_not_seal_never_make_a_silent_rank_look_alive() -> None:
    """Another client of the store may write any beat key: an unsealed record, a rank's last
    record written back again and again, or one rank's record copied under another's key.
    None of them counts as a beat, so the silent rank is still named. (What such a client
    can do, replaying a rank's earlier records in turn, is said in docs/distributed.md.)"""
    with _channels(3) as channels:
        for channel in channels:
            channel.progress = lambda: {"done": 0, "waiting": True}
            channel._heartbeat._busy = 1
        time.sleep(0.35)
        channels[1].close()  # rank 1 falls silent
        prefix = channels[0]._prefix
        store = channels[0]._store
        old = store.get(f"{prefix}/alive/1")
        forged = json.dumps({"beat": 10**9, "busy": True, "entered": 1, "done": 5})
        forgers = [
            lambda: store.set(f"{prefix}/alive/1", forged),  # unsealed
            lambda: store.set(f"{prefix}/alive/1", old),  # written back
            lambda: store.set(f"{prefix}/alive/1", store.get(f"{prefix}/alive/2")),  # copied
        ]
        for forge in forgers:
            store.set(f"{prefix}/alive/1", old)
            stop = threading.Event()

            def keep_forging(forge: Any = forge, stop: threading.Event = stop) -> None:
                while not stop.wait(0.01):
                    forge()

            thread = threading.Thread(target=keep_forging)
            thread.start()
            try:
                failure = channels[0].culprit(2, "rank 0 got nothing from rank 2", [0, 1, 2])
            finally:
                stop.set()
                thread.join()
            assert failure.rank == 1 and "stopped answering" in failure.error, failure


def test_a_broken_link_names_its_peer_first_once_its_silence_is_established() -> None:
    """Two ranks fell silent: the one at the other end of the broken link is named, not the
    first in rank order; a live peer is not named while another rank is silent."""
    with _channels(4) as channels:
        for channel in channels:
            channel.progress = lambda: {"done": 0, "waiting": True}
            channel._heartbeat._busy = 1
        time.sleep(0.35)
        channels[1].close()
        channels[3].close()
        failure = channels[2].culprit(3, "rank 2 lost its link to rank 3", [0, 1, 2, 3])
        assert failure.rank == 3 and "stopped answering" in failure.error, failure
        failure = channels[2].culprit(0, "rank 2 lost its link to rank 0", [0, 1, 2, 3])
        assert failure.rank == 1, failure  # rank 0 beats: the silent rank 1 is named


def test_a_link_error_inside_an_own_action_names_the_silent_rank_not_this_one() -> None:
    from gpipe.distributed.blame import Blame, broken_link
    from gpipe.schedule import Action
    from gpipe.schedule.action import FORWARD

    error = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [x]:1")
    error.gpipe_action = Action(FORWARD, 2, 0)  # type: ignore[attr-defined]
    assert broken_link(error) and not broken_link(ValueError("boom"))
    with _channels(4) as channels:
        for channel in channels:
            channel.progress = lambda: {"done": 0, "waiting": True}
            channel._heartbeat._busy = 1
        time.sleep(0.35)
        channels[3].close()  # rank 3 died
        failure = Blame(2, 30.0, channels[2].culprit).own(error)
        assert failure.rank == 3 and "stopped answering" in failure.error, failure
        assert "rank 2 lost a link in" in failure.error, failure
        boom = ValueError("boom")
        boom.gpipe_action = error.gpipe_action  # type: ignore[attr-defined]
        started = time.monotonic()
        own = Blame(2, 30.0, channels[2].culprit).own(boom)  # its own error: named at once
        assert own.rank == 2 and own.action == "2F0" and time.monotonic() - started < 0.2
