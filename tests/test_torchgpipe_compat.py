"""Code written for torchgpipe.GPipe runs by changing the import (docs/torchgpipe.md lists
where gpipe deliberately differs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import make_mlp, reference_step
from gpipe import GPipe
from gpipe.balance import balance_by_memory, balance_by_time


def test_extra_devices_go_unused() -> None:
    pipe = GPipe(make_mlp(3), [2, 2, 2], devices=["cpu"] * 5)
    assert pipe.devices == [torch.device("cpu")] * 3


def test_extra_devices_go_unused_with_virtual_stages() -> None:
    pipe = GPipe(make_mlp(4), [2] * 4, devices=["cpu"] * 3, virtual_stages=2, chunks=2)
    assert pipe.devices == [torch.device("cpu")] * 2


def test_too_few_devices_is_a_value_error_and_an_index_error_as_in_torchgpipe() -> None:
    with pytest.raises(ValueError, match="balance lists 4 stages") as info:
        GPipe(make_mlp(2), [1, 1, 1, 1], devices=["cpu"])
    assert isinstance(info.value, IndexError)


def test_integral_float_chunks_and_string_like_checkpoint_are_accepted() -> None:
    class Mode:
        def __str__(self) -> str:
            return "always"

    pipe = GPipe(make_mlp(1), [2], chunks=42.0, checkpoint=Mode())  # type: ignore[arg-type]
    assert pipe.chunks == 42 and type(pipe.chunks) is int
    assert pipe.checkpoint == "always" and type(pipe.checkpoint) is str


@pytest.mark.parametrize("chunks", [2.5, "4", 0, -1, True, None])
def test_bad_chunks_are_refused_at_construction_and_later(chunks: object) -> None:
    with pytest.raises((TypeError, ValueError), match="chunks"):
        GPipe(make_mlp(1), [2], chunks=chunks)  # type: ignore[arg-type]
    pipe = GPipe(make_mlp(1), [2], chunks=2)
    with pytest.raises((TypeError, ValueError), match="chunks"):
        pipe.chunks = chunks  # type: ignore[assignment]
    assert pipe.chunks == 2


def test_chunks_set_after_construction_is_used() -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=2)
    pipe.chunks = 4.0  # type: ignore[assignment]
    assert pipe.chunks == 4 and type(pipe.chunks) is int
    pipe(torch.randn(8, 6, dtype=torch.float64))
    assert len(pipe.timeline.events[0]) == 4


def test_schedule_set_after_a_step_is_the_one_the_next_step_runs() -> None:
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = GPipe(make_mlp(2), [2, 2], chunks=4)
    pipe.train_step(x, target, F.mse_loss)
    assert pipe.timeline.schedule == "gpipe"
    pipe.schedule = "1f1b"
    pipe.train_step(x, target, F.mse_loss)
    assert pipe.timeline.schedule == "1f1b"


def test_bad_schedule_or_checkpoint_set_later_is_refused_and_the_old_one_kept() -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=4, checkpoint="always")
    with pytest.raises(ValueError, match="unknown schedule '2f2b'"):
        pipe.schedule = "2f2b"
    with pytest.raises(TypeError, match="schedule must be a name"):
        pipe.schedule = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        pipe.checkpoint = "sometimes"
    assert (pipe.schedule, pipe.checkpoint) == ("gpipe", "always")
    pipe.checkpoint = "never"
    pipe.train_step(torch.randn(8, 6, dtype=torch.float64), torch.zeros(8, 6), F.mse_loss)
    assert pipe._last is not None and pipe._last[0].state.checkpoint == "never"


def test_a_schedule_set_later_that_places_stages_elsewhere_is_refused_with_the_fix() -> None:
    pipe = GPipe(make_mlp(2), [1, 1, 1, 1], chunks=4, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match=r"build a new GPipe\(\.\.\., schedule='zb-v'\)"):
        pipe.schedule = "zb-v"
    assert pipe.schedule == "interleaved"


def test_empty_sequential_is_the_identity() -> None:
    pipe = GPipe(nn.Sequential(), [])
    assert len(pipe) == 0 and list(pipe) == [] and pipe.devices == []
    assert pipe(torch.tensor(42)) == torch.tensor(42)
    assert pipe((torch.tensor(42),)) == (torch.tensor(42),)
    with pytest.raises(TypeError, match="tensor"):
        pipe(42)


def test_empty_sequential_train_step_equals_the_loss_on_the_input() -> None:
    pipe = GPipe(nn.Sequential(), [], chunks=3)
    x = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    target = torch.randn(5, 2, dtype=torch.float64)
    loss = pipe.train_step(x, target, F.mse_loss)
    expected = x.detach().clone().requires_grad_()
    F.mse_loss(expected, target).backward()
    assert_close(loss, F.mse_loss(expected, target).detach())
    assert_close(x.grad, expected.grad)


def test_bad_balance_recommends_balance_by_time() -> None:
    for module, balance in [(nn.Sequential(), [1]), (make_mlp(1), [1])]:
        with pytest.raises(ValueError, match=r"gpipe\.balance import balance_by_time"):
            GPipe(module, balance)


def test_balance_by_time_takes_torchgpipes_argument_order_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Timings differ from call to call, so the two orders are compared on what they
    # measure (the same module and sample) and on a balance the times decide alone.
    from gpipe.balance import measured

    seen: list[tuple[nn.Module, torch.Tensor]] = []
    real_profile = measured.profile

    def recording_profile(module: nn.Sequential, sample: torch.Tensor, **kwargs: object):  # type: ignore[no-untyped-def]
        seen.append((module, sample))
        return real_profile(module, sample, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(measured, "profile", recording_profile)
    model = make_mlp(2).float()
    sample = torch.randn(4, 6)
    ours, theirs = balance_by_time(model, sample, 2), balance_by_time(2, model, sample)
    assert len(seen) == 2 and all(m is model and s is sample for m, s in seen)
    for balance in (ours, theirs):
        assert len(balance) == 2 and sum(balance) == len(model) and min(balance) >= 1


def test_balance_by_memory_takes_torchgpipes_balance_by_size_argument_order() -> None:
    model = make_mlp(3).float()
    sample = torch.randn(4, 6)
    ours = balance_by_memory(model, sample, 2, kept_microbatches=[2, 1])
    assert balance_by_memory(2, model, sample, kept_microbatches=[2, 1]) == ours  # type: ignore[arg-type]
    assert len(ours) == 2 and sum(ours) == len(model)


def test_sequential_like_access_matches_the_model_torchgpipe_style() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 6, dtype=torch.float64)
    _, expected_loss, grads, _ = reference_step(make_mlp(2), x, target, F.mse_loss)
    model = make_mlp(2)
    pipe = GPipe(model, (1, 3), devices=("cpu", "cpu"), chunks=4.0)  # type: ignore[arg-type]
    loss = F.mse_loss(pipe(x), target)
    loss.backward()
    assert_close(loss.detach(), expected_loss)
    for param, grad in zip(model.parameters(), grads):
        assert_close(param.grad, grad)
