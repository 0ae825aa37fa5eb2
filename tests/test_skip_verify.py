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
            [r"no module declared 'foo' as poppable but stashed by layer '0': pop it in a later"],
        ),
        ([PopFoo], [r"'0' declared 'foo' as poppable but it was not stashed by any layer before"]),
        (
            [PopFoo, StashFoo],
            ["'0' declared 'foo' as poppable but it was not", "but stashed by layer '1'"],
        ),
        (
            [StashFoo, StashFoo, PopFoo],
            [r"'1' redeclared 'foo' as stashable.*layer '0' stashes it first.*own Namespace"],
        ),
        (
            [StashFoo, PopFoo, PopFoo],
            [r"'2' redeclared 'foo' as poppable.*layer '1' pops it first"],
        ),
        (
            [StashFoo, PopFoo, StashFoo, PopFoo],
            ["'2' redeclared 'foo' as stashable", "'3' redeclared 'foo' as poppable"],
        ),
        ([StashPopFoo], [r"'0' declared 'foo' both as stashable and as poppable.*different names"]),
    ],
)
def test_unpaired_stashes_and_pops_are_each_listed_with_the_fix(
    layers: list[type[nn.Module]], messages: list[str]
) -> None:
    with pytest.raises(TypeError, match="pairs of stash and pop do not match") as error:
        verify_skippables(nn.Sequential(*[layer() for layer in layers]))
    for message in messages:
        assert re.search(message, str(error.value)), str(error.value)
    assert str(error.value).count("\n* ") == len(messages)


def test_a_pair_split_across_namespaces_names_the_namespace() -> None:
    ns1, ns2 = Namespace(), Namespace()
    with pytest.raises(TypeError) as error:
        verify_skippables(nn.Sequential(StashFoo().isolate(ns1), PopFoo().isolate(ns2)))
    assert f"as poppable but it was not stashed (isolated in {ns2!r})" in str(error.value)
    assert f"as poppable but stashed (isolated in {ns1!r}) by layer '0'" in str(error.value)


def test_a_layer_used_twice_counts_at_both_positions() -> None:
    stash = StashFoo()
    with pytest.raises(TypeError, match="'2' redeclared 'foo' as stashable"):
        verify_skippables(nn.Sequential(stash, PopFoo(), stash, PopFoo()))


def test_only_a_sequential_is_verified() -> None:
    with pytest.raises(TypeError, match=r"checks an nn\.Sequential, got Linear"):
        verify_skippables(nn.Linear(1, 1))  # type: ignore[arg-type]
