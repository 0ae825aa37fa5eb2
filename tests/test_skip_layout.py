"""gpipe.skip.stages: a skippable Sequential cut into stages; each skip goes straight to its pop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe.dataflow import INPUT, Stages
from gpipe.partition import Partition
from gpipe.skip import Namespace, inspect_skip_layout, pop, skippable, stages, stash


class Pass(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@skippable(stash=["foo"])
class StashFoo(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("foo", x)
        return x


@skippable(pop=["foo"])
class PopFoo(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        foo = yield pop("foo")
        return x + foo


@skippable(stash=["bar"])
class StashBar(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("bar", x)
        return x


@skippable(pop=["bar"])
class PopBar(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        bar = yield pop("bar")
        return x + bar


def _takes(model: nn.Sequential, balance: list[int]) -> list[list[tuple[str, int]]]:
    return [list(taken) for taken in stages(model, balance).dataflow.takes]


def test_without_skippables_the_stages_are_a_chain() -> None:
    assert _takes(nn.Sequential(Pass(), Pass()), [1, 1]) == [[("input", INPUT)], [("input", 0)]]


def test_a_stash_and_pop_on_one_stage_never_leave_it() -> None:
    cut = stages(nn.Sequential(StashFoo(), PopFoo(), Pass()), [2, 1])
    assert [list(t) for t in cut.dataflow.takes] == [[("input", INPUT)], [("input", 0)]]
    out = cut[0]({"input": torch.tensor(3.0)})
    assert list(out) == ["input"]
    assert out["input"].item() == 6.0


def test_a_skip_to_the_next_stage_is_its_own_value() -> None:
    assert _takes(nn.Sequential(StashFoo(), PopFoo()), [1, 1]) == [
        [("input", INPUT)],
        [("input", 0), ("skip:foo", 0)],
    ]


def test_a_skip_across_stages_comes_from_the_stashing_stage_not_through_the_middle() -> None:
    cut = stages(nn.Sequential(StashFoo(), Pass(), PopFoo()), [1, 1, 1])
    assert [list(t) for t in cut.dataflow.takes] == [
        [("input", INPUT)],
        [("input", 0)],
        [("input", 1), ("skip:foo", 0)],
    ]
    assert cut.dataflow.skips() == [(0, 2, ("skip:foo",))]
    assert cut.dataflow.sends(0) == {1: ("input",), 2: ("skip:foo",)}
    middle = cut[1]({"input": torch.tensor(1.0)})
    assert list(middle) == ["input"]  # the middle stage never sees the skip


def test_skips_from_two_stages_are_read_in_stage_order() -> None:
    model = nn.Sequential(StashFoo(), StashBar(), PopBar(), PopFoo())
    assert _takes(model, [1, 1, 2])[2] == [("input", 1), ("skip:foo", 0), ("skip:bar", 1)]


def test_isolated_skips_get_one_name_per_namespace() -> None:
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(
        StashFoo().isolate(ns1),
        StashFoo().isolate(ns2),
        PopFoo().isolate(ns2),
        PopFoo().isolate(ns1),
    )
    assert _takes(model, [1, 1, 2])[2] == [("input", 1), ("skip:foo@2", 0), ("skip:foo@1", 1)]
    layout = inspect_skip_layout(model, [1, 1, 2])
    assert [(r.key, r.source, r.reader) for r in layout.routes] == [
        ((ns2, "foo"), 1, 2),
        ((ns1, "foo"), 0, 2),
    ]


def test_stages_hold_the_users_layers_with_their_positions() -> None:
    model = nn.Sequential(StashFoo(), nn.Linear(2, 2), PopFoo())
    cut = stages(model, [2, 1], devices=["cpu", "cpu"])
    assert isinstance(cut, Stages)
    assert cut.balance == [2, 1]
    assert cut.devices == [torch.device("cpu")] * 2
    assert all(isinstance(stage, Partition) for stage in cut)
    assert [stage.positions for stage in cut] == [[0, 1], [2]]
    assert cut[0][1] is model[1]
    assert {id(p) for p in cut.parameters()} == {id(p) for p in model.parameters()}


@skippable(stash=["down"])
class Down(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("down", x)
        return torch.tanh(self.linear(x))


@skippable(pop=["down"])
class Up(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        down = yield pop("down")
        return self.linear(torch.cat([x, down], dim=-1))


def _nested(width: int = 4) -> nn.Sequential:
    """Down, Down, Linear, Up, Up: two nested skips, each pair isolated."""
    torch.manual_seed(0)
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        Down(width).isolate(outer),
        Down(width).isolate(inner),
        nn.Linear(width, width),
        Up(width).isolate(inner),
        Up(width).isolate(outer),
    ).double()


@pytest.mark.parametrize("balance", [[5], [1, 4], [2, 3], [1, 2, 2], [1, 1, 1, 2], [1, 1, 1, 1, 1]])
def test_stages_in_order_equal_the_plain_model_with_every_gradient(balance: list[int]) -> None:
    model = _nested()
    plain = copy.deepcopy(model)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()

    expected = plain(x_plain)
    expected.square().sum().backward()
    output = stages(model, balance)(x)
    output.square().sum().backward()

    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(x.grad, x_plain.grad)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_stages_refuse_what_is_not_a_paired_sequential() -> None:
    with pytest.raises(TypeError, match=r"cuts an nn.Sequential, got Linear.*gpipe.split"):
        stages(nn.Linear(1, 1), [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="as poppable but stashed"):
        stages(nn.Sequential(StashFoo(), Pass()), [1, 1])
    with pytest.raises(ValueError, match=r"balance=\[1, 1\] sums to 2 but the module has 3"):
        stages(nn.Sequential(StashFoo(), Pass(), PopFoo()), [1, 1])
