"""The in-process mailboxes: any receive order, waiting receivers woken by sends and aborts."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gpipe.runtime.mailbox import LocalTransport, Mailbox
from gpipe.runtime.transport import ACTIVATION, GRADIENT, Aborted


def test_take_waits_for_its_own_tag_whatever_order_messages_arrive_in() -> None:
    box = Mailbox()
    got: list[object] = []
    receiver = threading.Thread(
        target=lambda: got.extend(box.take(("act", 0, i)) for i in (2, 0, 1)),
        name="mailbox-test-receiver",
    )
    receiver.start()
    for i in range(3):
        time.sleep(0.01)  # the receiver is parked on a tag not sent yet
        box.put(("act", 0, i), f"message {i}")
    receiver.join(timeout=5)
    assert got == ["message 2", "message 0", "message 1"]


def test_abort_wakes_a_waiting_receiver_and_clear_readies_the_box_again() -> None:
    box = Mailbox()
    raised: list[type[BaseException]] = []

    def receive() -> None:
        try:
            box.take(("grad", 1, 0))
        except Aborted as exc:
            raised.append(type(exc))

    receiver = threading.Thread(target=receive, name="mailbox-test-receiver")
    receiver.start()
    time.sleep(0.01)
    box.abort()
    receiver.join(timeout=5)
    assert not receiver.is_alive()
    assert raised == [Aborted]
    with pytest.raises(Aborted):
        box.take(("grad", 1, 1))  # aborted: no waiting for a message that will not come
    box.clear()
    box.put(("grad", 1, 1), 7)
    assert box.take(("grad", 1, 1)) == 7


def test_messages_move_to_the_receivers_device_unless_sent_from_a_stage_already_there() -> None:
    meta, cpu = torch.device("meta"), torch.device("cpu")
    transport = LocalTransport((0, 1, 1), [meta, cpu])  # stage 0 on meta, stages 1-2 on cpu
    x = torch.ones(2)
    transport.send((ACTIVATION, 0, 0), x)  # from the caller's side to stage 0: moved
    assert transport.recv((ACTIVATION, 0, 0)).device == meta
    transport.send((GRADIENT, 0, 0), [x, None])  # stage 1 -> stage 0: cpu -> meta
    grads = transport.recv((GRADIENT, 0, 0))
    assert grads[0].device == meta and grads[1] is None
    transport.send((ACTIVATION, 2, 0), x)  # stage 1 -> stage 2, both on cpu: as sent
    assert transport.recv((ACTIVATION, 2, 0)) is x
    sent = [x]
    transport.send((GRADIENT, 1, 0), sent)  # stage 2 -> stage 1: as sent, too
    assert transport.recv((GRADIENT, 1, 0)) is sent
