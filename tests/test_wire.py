"""The wire format: a message's signature and tensors rebuild the message, whatever its shape."""

from __future__ import annotations

import pytest
import torch

from gpipe.distributed.wire import decode, encode, flatten, rebuild, receive_buffers


def _round_trip(value: object) -> object:
    """``value`` as the receiving rank rebuilds it: the signature decoded, fresh buffers."""
    signature, tensors = flatten(value)
    received = decode(encode(signature))
    buffers = receive_buffers(received, torch.device("cpu"))
    for buffer, tensor in zip(buffers, tensors):
        buffer.copy_(tensor)
    return rebuild(received, buffers)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_lone_tensor_and_a_list_of_one_keep_their_shape_and_gradient_flag(
    requires_grad: bool,
) -> None:
    tensor = torch.randn(2, 3, requires_grad=requires_grad)
    lone = _round_trip(tensor)
    assert isinstance(lone, torch.Tensor)
    assert torch.equal(lone, tensor.detach())
    assert lone.requires_grad is requires_grad
    boxed = _round_trip([tensor])  # an input's gradient travels as a list of one
    assert type(boxed) is list and len(boxed) == 1
    assert torch.equal(boxed[0], tensor.detach())
    assert boxed[0].requires_grad is requires_grad


def test_tuples_dicts_nones_and_values_come_back_as_they_were() -> None:
    a, b = torch.randn(3), torch.arange(4)
    value = {"x": (a,), "n": 7, "parts": [b, None], "name": "mask"}
    back = _round_trip(value)
    assert back.keys() == value.keys()  # type: ignore[attr-defined]
    assert type(back["x"]) is tuple and torch.equal(back["x"][0], a)  # type: ignore[index]
    assert back["n"] == 7 and back["name"] == "mask"  # type: ignore[index]
    assert torch.equal(back["parts"][0], b) and back["parts"][1] is None  # type: ignore[index]
    assert back["parts"][0].dtype == torch.int64  # type: ignore[index]
