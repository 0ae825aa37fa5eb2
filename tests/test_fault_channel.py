"""The fault channel: an idle pipe asks the store nothing; a failure wakes every rank at once."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist

from gpipe.distributed.faults import Failure, FaultChannel


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
    # a hang check (usually milliseconds): a watcher nothing wakes would wait out its hour
    assert time.monotonic() - started < 5


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
