"""A trained pipe copies, pickles and saves (EMA weights, best-model snapshots)."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import pytest
import torch
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import make_mlp, reference_step
from gpipe import GPipe


def trained_pipe() -> GPipe:
    pipe = GPipe(make_mlp(4), [2, 4, 2], chunks=4, schedule="1f1b")
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe.train_step(x, target, F.mse_loss)
    return pipe


def through_torch_save(pipe: GPipe) -> GPipe:
    buffer = io.BytesIO()
    torch.save(pipe, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES: dict[str, Callable[[GPipe], GPipe]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda pipe: pickle.loads(pickle.dumps(pipe)),
    "torch.save": through_torch_save,
}


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_after_a_step_trains_like_plain_pytorch_and_leaves_the_original(how: str) -> None:
    pipe = trained_pipe()
    before = [(p.detach().clone(), p.grad.clone()) for p in pipe.parameters()]
    clone = COPIES[how](pipe)

    # the copy's parameters are copies: same values, other tensors
    for original, copied in zip(pipe.parameters(), clone.parameters()):
        assert copied is not original and copied.data_ptr() != original.data_ptr()
        assert_close(copied, original)
    assert (clone.balance, clone.chunks, clone.schedule) == ([2, 4, 2], 4, "1f1b")
    with pytest.raises(RuntimeError, match="no step has run yet"):
        clone.timeline  # noqa: B018 -- the copy carries no step

    # the copy trains exactly like its plain model
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    plain = make_mlp(4)
    plain.load_state_dict({k.split(".", 2)[-1]: v for k, v in clone.state_dict().items()})
    _, expected_loss, expected_grads, _ = reference_step(plain, x, target, F.mse_loss)
    clone.zero_grad(set_to_none=True)
    assert_close(clone.train_step(x, target, F.mse_loss), expected_loss)
    for param, grad in zip(clone.parameters(), expected_grads):
        assert_close(param.grad, grad)
    assert [len(events) for events in clone.timeline.events] == [8, 8, 8]

    # the original is untouched, and trains on
    for param, (value, grad) in zip(pipe.parameters(), before):
        assert torch.equal(param, value) and torch.equal(param.grad, grad)
    pipe.train_step(x, target, F.mse_loss)


def test_an_ema_copy_averages_the_trained_weights() -> None:
    pipe = trained_pipe()
    ema = copy.deepcopy(pipe)
    start = [p.detach().clone() for p in pipe.parameters()]
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()
    with torch.no_grad():
        for average, param in zip(ema.parameters(), pipe.parameters()):
            average.lerp_(param, 0.25)
    plain = make_mlp(4)
    with torch.no_grad():
        for layer, before, after in zip(plain.parameters(), start, pipe.parameters()):
            layer.copy_(before + 0.25 * (after - before))
        x = torch.randn(4, 6, dtype=torch.float64)
        assert_close(ema(x), plain(x))
