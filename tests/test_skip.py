"""gpipe.skip's interface: skippable, stash, pop and Namespace behave as in torchgpipe."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

from gpipe.skip import Namespace, pop, skippable, stash
from gpipe.skip.tracker import SkipTracker, current_tracker, use_tracker


@skippable(stash=["foo"])
class StashFoo(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("foo", x)
        return x * 2


@skippable(pop=["foo"])
class PopFoo(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        foo = yield pop("foo")
        return x + foo


@skippable(stash=["skip"])
class Scaled(nn.Module):
    """A skippable layer with parameters and an __init__ of its own."""

    def __init__(self, width: int, scale: float = 1.0) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x * self.scale)
        return self.linear(x)


def test_namespaces_are_all_different_but_a_copy_is_equal() -> None:
    a, b = Namespace(), Namespace()
    assert a != b
    assert copy.copy(a) == a and copy.copy(a) is not a
    assert copy.deepcopy(a) == a
    assert len({a, b, copy.copy(a)}) == 2


def test_skippable_keeps_the_users_class_name_parameters_and_init() -> None:
    layer = Scaled(3, scale=2.0)
    assert type(layer).__name__ == "Scaled"
    assert layer.scale == 2.0
    assert [name for name, _ in layer.named_parameters()] == ["linear.weight", "linear.bias"]
    assert repr(layer).startswith("@skippable(Scaled(")
    assert "(linear): Linear(in_features=3, out_features=3, bias=True)" in repr(layer)


def test_a_stash_waits_in_the_tracker_until_a_later_layer_pops_it() -> None:
    tracker = SkipTracker()
    with use_tracker(tracker):
        hidden = StashFoo()(torch.tensor(21.0))
        assert list(tracker.waiting) == [(None, "foo")]
        assert tracker.waiting[(None, "foo")].item() == 21.0
        output = PopFoo()(hidden)
    assert output.item() == 63.0
    assert tracker.waiting == {}


def test_a_skippable_sequential_runs_as_plain_pytorch() -> None:
    output = nn.Sequential(StashFoo(), nn.Identity(), PopFoo())(torch.tensor(5.0))
    assert output.item() == 15.0
    assert current_tracker().waiting == {}


def test_each_thread_has_its_own_tracker() -> None:
    seen: list[SkipTracker] = []
    thread = threading.Thread(target=lambda: seen.append(current_tracker()))
    thread.start()
    thread.join()
    assert seen[0] is not current_tracker()


def test_a_forward_without_yield_returns_its_output() -> None:
    @skippable()
    class Plain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    assert Plain()(torch.tensor(1.0)).item() == 2.0


def test_stashing_none_is_allowed() -> None:
    @skippable(stash=["foo"])
    class StashNone(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            yield stash("foo", None)
            return x

    @skippable(pop=["foo"])
    class PopNone(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            foo = yield pop("foo")
            assert foo is None
            return x

    assert nn.Sequential(StashNone(), PopNone())(torch.tensor(4.0)).item() == 4.0


def test_a_layer_may_stash_and_pop_several_skips() -> None:
    @skippable(stash=["alice", "bob"])
    class Two(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            yield stash("alice", x * 2)
            yield stash("bob", x * 3)
            return x

    @skippable(pop=["bob"], stash=["carol"])
    class Middle(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            bob = yield pop("bob")
            yield stash("carol", bob + 1)
            return x

    @skippable(pop=["alice", "carol"])
    class Last(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            carol = yield pop("carol")
            alice = yield pop("alice")
            return x + alice * 100 + carol

    assert nn.Sequential(Two(), Middle(), Last())(torch.tensor(1.0)).item() == 1 + 200 + 4


@pytest.mark.parametrize(
    ("forward", "message"),
    [
        ("declared_not_stashed", r"declares \['foo'\] as stashed but its forward did not"),
        ("undeclared_stash", r"stashed 'bar', which it does not declare"),
        ("stash_twice", r"stashed 'foo' twice"),
        ("not_a_command", r"yielded 42: a skippable layer yields only"),
    ],
)
def test_a_stash_the_declaration_does_not_allow_is_a_runtime_error(
    forward: str, message: str
) -> None:
    @skippable(stash=["foo"])
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            if forward == "declared_not_stashed":
                return x
            if forward == "undeclared_stash":
                yield stash("bar", x)
            if forward == "stash_twice":
                yield stash("foo", x)
                yield stash("foo", x)
            if forward == "not_a_command":
                yield 42
            return x

    with pytest.raises((RuntimeError, TypeError), match=message):
        Bad()(torch.tensor(1.0))
    assert current_tracker().waiting == {}


def test_a_pop_with_nothing_stashed_is_a_runtime_error_naming_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"no earlier layer stashed it.*verify_skippables"):
        PopFoo()(torch.tensor(1.0))


def test_a_declared_pop_the_forward_skips_is_a_runtime_error_and_leaves_nothing() -> None:
    @skippable(pop=["foo"])
    class Forgets(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(RuntimeError, match=r"declares \['foo'\] as popped but its forward"):
        nn.Sequential(StashFoo(), Forgets())(torch.tensor(1.0))
    assert current_tracker().waiting == {}


def test_an_undeclared_pop_is_a_runtime_error() -> None:
    @skippable()
    class Sneaky(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            foo = yield pop("foo")
            return foo

    tracker = SkipTracker()
    with use_tracker(tracker), pytest.raises(RuntimeError, match="popped 'foo', which it does"):
        Sneaky()(StashFoo()(torch.tensor(1.0)))


def test_isolated_pairs_with_one_name_do_not_mix() -> None:
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(
        StashFoo().isolate(ns1),  # stashes 1, returns 2
        StashFoo().isolate(ns2),  # stashes 2, returns 4
        PopFoo().isolate(ns1),  # 4 + 1
        PopFoo().isolate(ns2),  # 5 + 2
    )
    assert model(torch.tensor(1.0)).item() == 7.0


def test_isolate_only_some_names() -> None:
    @skippable(stash=["alice", "bob"])
    class Two(nn.Module):
        pass

    ns = Namespace()
    layer = Two().isolate(ns, only="alice")
    assert layer.stashable() == [(ns, "alice"), (None, "bob")]
    with pytest.raises(ValueError, match=r"declares the skips \['alice', 'bob'\], not \['carol'\]"):
        layer.isolate(ns, only=["carol"])
    with pytest.raises(TypeError, match=r"takes a gpipe\.skip\.Namespace"):
        layer.isolate("ns")  # type: ignore[arg-type]


def test_a_model_with_skips_deep_copies_and_pickles_with_its_pairs() -> None:
    ns = Namespace()
    model = nn.Sequential(StashFoo().isolate(ns), PopFoo().isolate(ns))
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert copied[0].stashable() == [(ns, "foo")]
        assert copied(torch.tensor(2.0)).item() == 6.0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"stash": "foo"}, r"got the string 'foo': write @skippable\(stash=\['foo'\]\)"),
        ({"pop": [1]}, r"takes a list of names \(str\), got \[1\]"),
    ],
)
def test_skippable_refuses_names_that_are_not_a_list_of_strings(
    arguments: dict, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        skippable(**arguments)


def test_skippable_decorates_only_modules() -> None:
    with pytest.raises(TypeError, match=r"decorates an nn\.Module class"):
        skippable()(int)  # type: ignore[arg-type]
