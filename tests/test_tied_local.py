"""A Parameter tied between stages on different devices of a local pipe trains as plain PyTorch.

The owner (the user's Parameter) lives with the first stage holding it; every other device
reads a copy, refreshed from the owner at each step, whose gradients are added into the
owner's. There is no second accelerator here, so the ``apart`` fixture makes the pipe keep
copies between stages on the one CPU (``gpipe.tied._apart``): the copy path runs for real.
The CUDA test at the end runs it on two GPUs where there are two.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import gpipe
import gpipe.tied
from gpipe import GPipe
from gpipe.models import GPT2Config, gpt2, gpt_loss

VOCAB, WIDTH = 13, 8


@pytest.fixture
def apart(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Stages on different pipeline devices keep a copy each, though all run on "cpu"."""
    monkeypatch.setattr(gpipe.tied, "_apart", lambda a, b: True)
    yield


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(self.norm(x))))


def tiny_gpt(seed: int = 0) -> nn.Sequential:
    """Embedding, 3 blocks, a norm and a head whose weight *is* the embedding's (float64)."""
    torch.manual_seed(seed)
    embed, head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, Block(), Block(), Block(), nn.LayerNorm(WIDTH), head).double()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch(seed: int = 1, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (size, 5), generator=generator)
    return idx, torch.randint(0, VOCAB, (size, 5), generator=generator)


def plain_step(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Plain training on the whole batch: the loss; gradients land in ``model``."""
    loss = lm_loss(model(idx), target)
    loss.backward()
    return loss.detach()


def assert_same_gradients(model: nn.Module, plain: nn.Module) -> None:
    mine, theirs = dict(model.named_parameters()), dict(plain.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, param in mine.items():
        assert param.grad is not None, f"{name} got no gradient"
        assert_close(param.grad, theirs[name].grad, msg=lambda m, n=name: f"{n}: {m}")


def copy_of(pipe: GPipe) -> nn.Parameter:
    """The one copy of the tied weight the pipe keeps (what the head's forward reads)."""
    tied = pipe._stages.tied
    assert tied is not None and len(tied._copies) == 1
    return tied._copies[0].replica


CASES = [
    ([2, 4], "gpipe", 1),
    ([2, 4], "1f1b", 1),
    ([2, 4], "zb-h1", 1),  # split backward: the copy's gradient comes in W
    ([2, 1, 2, 1], "1f1b", 1),
    ([2, 1, 2, 1], "interleaved", 2),  # stage 3 on device 1: a copy there
]


@pytest.mark.parametrize(("balance", "schedule", "v"), CASES)
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_tied_head_on_another_device_trains_like_plain_pytorch(
    apart: None, balance: list[int], schedule: str, v: int, checkpoint: str
) -> None:
    idx, target = batch()
    model, plain = tiny_gpt(), tiny_gpt()
    expected = plain_step(plain, idx, target)
    pipe = GPipe(
        model,
        balance,
        devices=["cpu"] * (len(balance) // v),
        chunks=4,
        schedule=schedule,
        virtual_stages=v,
        checkpoint=checkpoint,
    )
    head, embed = model[5], model[0]
    assert head.weight is copy_of(pipe) and head._parameters["weight"] is embed.weight
    loss = pipe.train_step(idx, target, lm_loss)
    assert_close(loss, expected)
    assert_same_gradients(model, plain)
    assert copy_of(pipe).grad is None  # handed on to the owner


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_pipe_then_backward_adds_the_copy_gradient_into_the_owner(
    apart: None, checkpoint: str
) -> None:
    idx, target = batch()
    model, plain = tiny_gpt(), tiny_gpt()
    expected_out = plain(idx)
    lm_loss(expected_out, target).backward()
    pipe = GPipe(model, [3, 3], chunks=3, checkpoint=checkpoint)
    output = pipe(idx)
    lm_loss(output, target).backward()
    assert_close(output, expected_out.detach())
    assert_same_gradients(model, plain)


def test_two_forwards_then_one_backward_read_the_same_unchanged_copy(apart: None) -> None:
    """The copy is not rewritten while the owner is unchanged: the first graph stays valid."""
    (a, ta), (b, tb) = batch(1), batch(2)
    model, plain = tiny_gpt(), tiny_gpt()
    (lm_loss(plain(a), ta) + lm_loss(plain(b), tb)).backward()
    pipe = GPipe(model, [3, 3], chunks=2, checkpoint="never")
    (lm_loss(pipe(a), ta) + lm_loss(pipe(b), tb)).backward()
    assert_same_gradients(model, plain)


def test_two_momentum_steps_through_the_pipe_equal_two_plain_steps(apart: None) -> None:
    model, plain = tiny_gpt(), tiny_gpt()
    pipe = GPipe(model, [2, 4], chunks=4, schedule="1f1b")
    replica = copy_of(pipe)
    mine = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
    theirs = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    for step in range(2):
        idx, target = batch(seed=step)
        assert_close(pipe.train_step(idx, target, lm_loss), plain_step(plain, idx, target))
        mine.step()
        theirs.step()
        mine.zero_grad()
        theirs.zero_grad()
        assert not torch.equal(replica, model[0].weight)  # refreshed only when next read
    for (name, param), other in zip(model.named_parameters(), plain.parameters()):
        assert_close(param, other, msg=lambda m, n=name: f"{n}: {m}")
    idx, _ = batch(seed=5)
    with torch.no_grad():
        assert_close(pipe(idx), plain(idx))
    assert torch.equal(replica, model[0].weight)


def test_after_close_the_model_reads_its_own_tied_parameter_and_the_pipe_still_trains(
    apart: None,
) -> None:
    """Closing hands the tie back: the model called directly after an optimizer step must not
    read the copy of the last step; the next step shadows the owner again."""
    model, plain = tiny_gpt(), tiny_gpt()
    pipe = GPipe(model, [2, 4], chunks=4, schedule="1f1b")
    mine = torch.optim.SGD(pipe.parameters(), lr=0.5)
    theirs = torch.optim.SGD(plain.parameters(), lr=0.5)
    idx, target = batch(seed=0)
    for _ in range(2):
        assert_close(pipe.train_step(idx, target, lm_loss), plain_step(plain, idx, target))
        mine.step()
        theirs.step()
        mine.zero_grad()
        theirs.zero_grad()
        pipe.close()
        assert model[5].weight is model[0].weight
        with torch.no_grad():
            assert_close(model(idx), plain(idx))
    assert_close(pipe.train_step(idx, target, lm_loss), plain_step(plain, idx, target))
    assert_same_gradients(model, plain)
    assert model[5].weight is copy_of(pipe)


def test_a_write_through_data_reaches_the_copy_at_the_next_forward(apart: None) -> None:
    """``p.data`` writes bump no version counter: the copy is compared, not trusted."""
    model, plain = tiny_gpt(), tiny_gpt()
    pipe = GPipe(model, [3, 3], chunks=2)
    idx, _ = batch()
    for param in (model[0].weight, plain[0].weight):
        param.data.mul_(2.0)
    with torch.no_grad():
        assert_close(pipe(idx), plain(idx))
    assert torch.equal(copy_of(pipe), model[0].weight)


def test_copies_are_neither_parameters_nor_state_of_the_pipe(apart: None) -> None:
    model = tiny_gpt()
    params, keys = [id(p) for p in model.parameters()], list(model.state_dict())
    pipe = GPipe(model, [3, 3], chunks=2)
    replica = copy_of(pipe)
    assert [id(p) for p in pipe.parameters()] == [id(p) for p in model.parameters()] == params
    assert list(model.state_dict()) == keys
    assert [key.split(".", 2)[2] for key in pipe.state_dict()] == keys  # partitions.<s>.<key>
    with torch.no_grad():
        model[0].weight.add_(1.0)  # as an optimizer step does; the copy is now stale
    for saved in (model.state_dict(), pipe.state_dict(keep_vars=True)):
        head = next(value for key, value in saved.items() if key.endswith("5.weight"))
        assert torch.equal(head, model[0].weight) and head is not replica


def test_a_state_dict_round_trip_through_the_pipe_loads_into_plain_and_back(
    apart: None,
) -> None:
    model = tiny_gpt()
    pipe = GPipe(model, [3, 3], chunks=2)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    idx, target = batch()
    pipe.train_step(idx, target, lm_loss)
    optimizer.step()
    plain = tiny_gpt(seed=7)
    plain.load_state_dict(model.state_dict())  # strict: the same keys
    assert plain[5].weight is plain[0].weight
    with torch.no_grad():
        assert_close(pipe(idx), plain(idx))
    other = tiny_gpt(seed=9)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert_close(pipe(idx), other(idx))
    assert torch.equal(copy_of(pipe), other[0].weight)


def test_a_dtype_conversion_of_the_pipe_reaches_the_copy(apart: None) -> None:
    model, plain = tiny_gpt(), tiny_gpt().float()
    pipe = GPipe(model, [3, 3], chunks=2).to(torch.float32)
    idx, target = batch()
    assert_close(pipe.train_step(idx, target, lm_loss), plain_step(plain, idx, target))
    assert copy_of(pipe).dtype == torch.float32
    assert_same_gradients(model, plain)


def test_a_frozen_tied_weight_stays_frozen_on_every_device(apart: None) -> None:
    model, plain = tiny_gpt(), tiny_gpt()
    pipe = GPipe(model, [3, 3], chunks=2, schedule="zb-h1")
    model[0].weight.requires_grad_(False)
    plain[0].weight.requires_grad_(False)
    idx, target = batch()
    assert_close(pipe.train_step(idx, target, lm_loss), plain_step(plain, idx, target))
    assert model[0].weight.grad is None and copy_of(pipe).grad is None
    assert_close(model[1].fc.weight.grad, plain[1].fc.weight.grad)


def test_a_deep_copy_of_the_pipe_keeps_its_own_tie(apart: None) -> None:
    model, plain = tiny_gpt(), tiny_gpt()
    twin = copy.deepcopy(GPipe(model, [3, 3], chunks=2, schedule="zb-h1"))
    idx, target = batch()
    assert_close(twin.train_step(idx, target, lm_loss), plain_step(plain, idx, target))
    owner = twin.partitions[0][0].weight
    assert owner is not model[0].weight and model[0].weight.grad is None
    assert_close(owner.grad, plain[0].weight.grad)


def test_a_pipe_over_the_same_model_on_one_device_drops_the_old_copy(apart: None) -> None:
    model, plain = tiny_gpt(), tiny_gpt()
    GPipe(model, [3, 3], chunks=2)
    pipe = GPipe(model, [6], chunks=2)
    assert model[5].weight is model[0].weight
    idx, target = batch()
    assert_close(pipe.train_step(idx, target, lm_loss), plain_step(plain, idx, target))
    assert_same_gradients(model, plain)


@pytest.mark.parametrize(("stages", "schedule"), [(2, "zb-h1"), (4, "1f1b")])
def test_a_split_gpt2_with_its_tied_head_on_another_device_trains_like_plain(
    apart: None, stages: int, schedule: str
) -> None:
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (4, 8), generator=generator)
    target = torch.roll(idx, -1, dims=1)
    model = gpt2(GPT2Config(n_layer=2, n_embd=16), seed=0).double()
    plain = copy.deepcopy(model)
    expected = gpt_loss(plain(idx), target)
    expected.backward()
    points = {2: ["transformer.h.1"], 4: ["transformer.h.0", "transformer.h.1", "lm_head"]}
    cut = gpipe.split(model, points[stages], example_inputs=(idx[:1],))
    pipe = GPipe(cut, devices=["cpu"] * stages, chunks=2, schedule=schedule)
    assert model.lm_head.weight is copy_of(pipe)
    assert_close(pipe.train_step(idx, target, gpt_loss), expected.detach())
    assert_same_gradients(model, plain)


def test_zb_v_puts_the_first_and_last_stage_on_one_device_and_needs_no_copy(
    apart: None,
) -> None:
    model, plain = tiny_gpt(), tiny_gpt()
    pipe = GPipe(model, [2, 1, 2, 1], chunks=4, schedule="zb-v", virtual_stages=2)
    assert pipe._stages.tied is None and model[5].weight is model[0].weight
    idx, target = batch()
    assert_close(pipe.train_step(idx, target, lm_loss), plain_step(plain, idx, target))
    assert_same_gradients(model, plain)


class Scaled(nn.Module):
    """Multiplies by a buffer it may share with another Scaled."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_buffer_shared_by_stages_on_two_devices_is_refused_with_the_fix(apart: None) -> None:
    scale = torch.ones(4)
    model = nn.Sequential(Scaled(scale), nn.Linear(4, 4), Scaled(scale))
    with pytest.raises(ValueError) as info:
        GPipe(model, [2, 1])
    message = str(info.value)
    assert "stage 0's buffer '0.scale' is stage 1's '2.scale'" in message
    assert "same device" in message and "a buffer of its own" in message
    GPipe(nn.Sequential(Scaled(scale), nn.Linear(4, 4), Scaled(scale)), [3])  # one device


def test_a_layer_with_parameters_used_on_two_devices_is_refused_with_the_fix(
    apart: None,
) -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    with pytest.raises(ValueError, match=r"stage 0's '0' is stage 1's '2' \(one Linear object"):
        GPipe(model, [2, 1])
    assert shared.weight.device.type == "cpu"


def _gpus(count: int) -> pytest.MarkDecorator:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < count, reason=f"needs {count} CUDA GPU(s)")


@pytest.mark.parametrize(
    "devices",
    [
        pytest.param(["cuda:0", "cuda:1"], marks=_gpus(2)),
        pytest.param(["cpu", "cuda:0"], marks=_gpus(1)),
    ],
)
def test_a_tied_head_on_another_real_device_trains_like_plain_pytorch(devices: list[str]) -> None:
    """No seam: the devices differ, so the head's stage reads a copy on its own device."""
    idx, target = batch()
    model, plain = tiny_gpt(), tiny_gpt()
    pipe = GPipe(model, [3, 3], devices=devices, chunks=4, schedule="zb-h1")
    owner, replica = model[0].weight, model[5].weight
    assert owner.device == torch.device(devices[0]) and replica.device == torch.device(devices[1])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
    reference = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        loss = pipe.train_step(idx.to(devices[0]), target, lm_loss)
        assert_close(loss.cpu(), plain_step(plain, idx, target))
        for name, param in model.named_parameters():
            other = dict(plain.named_parameters())[name]
            assert_close(param.grad.cpu(), other.grad, msg=lambda m, n=name: f"{n}: {m}")
        for step in (optimizer, reference):
            step.step()
            step.zero_grad()
    with torch.no_grad():
        assert_close(pipe(idx.to(devices[0])).cpu(), plain(idx))
    assert torch.equal(replica.cpu(), owner.cpu())
