"""verify_skippables: every stash has exactly one later pop, and the error says how to fix it."""

from __future__ import annotations

import re

import pytest
from torch import nn

from gpipe.skip import Namespace, skippable, verify_skippables


@skippable(stash=["foo"])
class StashFoo(nn.Module):
    pass


@skippable(pop=["foo"])
class PopFoo(nn.Module):
    pass


@skippable(pop=["foo"], stash=["bar"])
class PopFooStashBar(nn.Module):
    pass


@skippable(pop=["bar"])
class PopBar(nn.Module):
    pass


@skippable(stash=["foo"], pop=["foo"])
class StashPopFoo(nn.Module):
    pass


def test_matching_pairs_pass() -> None:
    verify_skippables(nn.Sequential(StashFoo(), nn.ReLU(), PopFoo()))
    verify_skippables(nn.Sequential(StashFoo(), PopFooStashBar(), PopBar()))
    verify_skippables(nn.Sequential(nn.ReLU()))


def test_the_same_name_twice_passes_when_each_pair_is_isolated() -> None:
    ns1, ns2 = Namespace(), Namespace()
    verify_skippables(
        nn.Sequential(
            StashFoo().isolate(ns1),
            StashFoo().isolate(ns2),
            PopFoo().isolate(ns2),
            PopFoo().isolate(ns1),
        )
    )


@pytest.mark.parametrize(
    ("layers", "messages"),
    [
        (
            [StashFoo],
            [r"layer '0' stashes 'foo', but no later layer pops it: pop it in a later layer"],
        ),
        ([PopFoo], [r"layer '0' pops 'foo', but no layer before it stashes it: stash it"]),
        (
            [PopFoo, StashFoo],
            ["layer '0' pops 'foo', but no layer before it", "layer '1' stashes 'foo', but no"],
        ),
        (
            [StashFoo, StashFoo, PopFoo],
            [r"layer '1' stashes 'foo' again \(layer '0' stashes it first\).*own Namespace"],
        ),
        ([StashFoo, PopFoo, PopFoo], [r"layer '2' pops 'foo' again \(layer '1' pops it first\)"]),
        (
            [StashFoo, PopFoo, StashFoo, PopFoo],
            ["layer '2' stashes 'foo' again", "layer '3' pops 'foo' again"],
        ),
        ([StashPopFoo], [r"layer '0' declares 'foo' both to stash and to pop.*different names"]),
    ],
)
def test_unpaired_stashes_and_pops_are_each_listed_with_the_fix(
    layers: list[type[nn.Module]], messages: list[str]
) -> None:
    with pytest.raises(TypeError, match="do not pair up") as error:
        verify_skippables(nn.Sequential(*[layer() for layer in layers]))
    for message in messages:
        assert re.search(message, str(error.value)), str(error.value)
    assert str(error.value).count("\n* ") == len(messages)


def test_a_pair_split_across_namespaces_names_the_namespace() -> None:
    ns1, ns2 = Namespace(), Namespace()
    with pytest.raises(TypeError) as error:
        verify_skippables(nn.Sequential(StashFoo().isolate(ns1), PopFoo().isolate(ns2)))
    assert f"pops 'foo' (isolated in {ns2!r}), but no layer before it" in str(error.value)
    assert f"stashes 'foo' (isolated in {ns1!r}), but no later layer" in str(error.value)


def test_a_layer_used_twice_counts_at_both_positions() -> None:
    stash = StashFoo()
    with pytest.raises(TypeError, match="layer '2' stashes 'foo' again"):
        verify_skippables(nn.Sequential(stash, PopFoo(), stash, PopFoo()))


def test_only_a_sequential_is_verified() -> None:
    with pytest.raises(TypeError, match=r"checks an nn\.Sequential, got Linear"):
        verify_skippables(nn.Linear(1, 1))  # type: ignore[arg-type]
