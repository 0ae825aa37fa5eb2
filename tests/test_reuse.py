"""A layer object used at several places, or a parameter shared by two layers, trains as in plain
PyTorch when its uses share a device. Across devices a shared parameter gets a copy per device
(tests/test_tied_local.py), and a shared layer with parameters is refused with the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import reference_step
from gpipe import GPipe
from gpipe.partition import split_module
from gpipe.tied import TiedParameters


def _reused_relu() -> nn.Sequential:
    """lin1, act, lin2, act, lin3: one ReLU object at positions 1 and 3."""
    torch.manual_seed(0)
    act = nn.ReLU()
    return nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act, nn.Linear(4, 4)).double()


def _reused_linear() -> nn.Sequential:
    """One Linear object at positions 0 and 2 (a weight applied twice), on two stages."""
    torch.manual_seed(1)
    shared = nn.Linear(4, 4)
    return nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(4, 3)).double()


def _tied_weights() -> nn.Sequential:
    """Two distinct layers holding one Parameter (tied input/output weights)."""
    torch.manual_seed(2)
    first, last = nn.Linear(4, 4, bias=False), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), last).double()


MODELS = {"reused_relu": _reused_relu, "reused_linear": _reused_linear, "tied": _tied_weights}


def _data(out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    x = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    return x, torch.randn(10, out, dtype=torch.float64)


def test_len_and_iteration_count_every_use_of_a_reused_layer() -> None:
    model = _reused_relu()
    pipe = GPipe(model, [1] * 5)
    assert len(pipe) == len(model) == 5
    assert list(pipe) == list(model)
    assert pipe[3] is model[1]
    assert [p.positions for p in pipe.partitions] == [[0], [1], [2], [3], [4]]
    assert all(len(p) == 1 for p in pipe.partitions)  # no empty stage


@pytest.mark.parametrize("balance", [[5], [2, 3], [1, 1, 1, 1, 1], [4, 1]])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_reused_parameter_free_layer_on_any_stages_equals_plain(
    balance: list[int], checkpoint: str
) -> None:
    x, target = _data()
    expected, expected_loss, grads, x_grad = reference_step(_reused_relu(), x, target, F.mse_loss)
    model = _reused_relu()
    pipe = GPipe(model, balance, chunks=3, checkpoint=checkpoint)
    x = x.detach().requires_grad_()
    output = pipe(x)
    loss = F.mse_loss(output, target)
    loss.backward()
    assert_close(output, expected)
    assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), grads):
        assert_close(param.grad, grad)
    assert_close(x.grad, x_grad)


@pytest.mark.parametrize("name", ["reused_linear", "tied"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_parameter_shared_across_stages_on_one_device_equals_plain(
    name: str, schedule: str, checkpoint: str
) -> None:
    """Two workers accumulate into one .grad concurrently: AccumulateGrad takes a lock."""
    out = 3 if name == "reused_linear" else 4
    x, target = _data(out)
    _, expected_loss, grads, _ = reference_step(MODELS[name](), x, target, F.mse_loss)
    model = MODELS[name]()
    pipe = GPipe(model, [1, 1, 3], chunks=5, checkpoint=checkpoint, schedule=schedule)
    for _ in range(3):  # gradients accumulate over steps too
        loss = pipe.train_step(x.detach(), target, F.mse_loss)
    assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), grads):
        assert_close(param.grad, 3 * grad)


def test_reused_layer_with_parameters_on_one_stage_equals_plain() -> None:
    x, target = _data(3)
    _, expected_loss, grads, _ = reference_step(_reused_linear(), x, target, F.mse_loss)
    model = _reused_linear()
    loss = GPipe(model, [3, 2], chunks=2).train_step(x.detach(), target, F.mse_loss)
    assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), grads):
        assert_close(param.grad, grad)


def test_state_dict_keys_read_as_the_users_model() -> None:
    model = _reused_linear()
    pipe = GPipe(model, [3, 2])
    stage_keys = [k for p in pipe.partitions for k in p.state_dict()]
    assert sorted(stage_keys) == sorted(model.state_dict())


def _ties(model: nn.Sequential, balance: list[int], devices: list[str]) -> TiedParameters:
    """The tied parameters of ``model`` cut by ``balance``, stage ``s`` on ``devices[s]``."""
    stages = split_module(model, balance)
    return TiedParameters(stages, range(len(devices)), [torch.device(d) for d in devices])


def test_reused_layer_with_parameters_on_two_devices_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as info:
        _ties(_reused_linear(), [1, 4], ["cpu", "cuda:0"])
    message = str(info.value)
    assert "stage 0's '0' is stage 1's '2' (one Linear object" in message
    assert "stage 0 runs on cpu and stage 1 on cuda:0" in message
    assert "its own Linear" in message and "one stage" in message and "same device" in message


def test_parameter_shared_by_two_layers_on_two_devices_gets_a_copy() -> None:
    assert len(_ties(_tied_weights(), [2, 3], ["cpu", "cuda:1"])) == 1
    assert len(_ties(_tied_weights(), [2, 3], ["cuda:1", "cuda:1"])) == 0


def test_reused_parameter_free_layer_may_span_devices() -> None:
    assert len(_ties(_reused_relu(), [2, 3], ["cpu", "cuda:0"])) == 0


def test_pipe_refuses_shared_parameters_across_devices_before_moving_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NOTE: the pipe refuses devices the machine lacks first; pretend to have one GPU, as
    # the refusal comes before anything would touch it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = _reused_linear()
    with pytest.raises(ValueError, match="stage 0's '0' is stage 1's '2'"):
        GPipe(model, [1, 4], devices=["cpu", "cuda:0"])
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_deferred_batch_norm_refuses_a_reused_batch_norm() -> None:
    norm = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), norm, nn.Linear(4, 4), norm)
    with pytest.raises(ValueError, match=r"positions 1 and 3.*own BatchNorm"):
        GPipe(model, [2, 2], deferred_batch_norm=True)
