"""verify_skippables: the static check that every stash of a Sequential has its one pop."""

from __future__ import annotations

from torch import nn

from gpipe.skip.skippable import Skippable
from gpipe.skip.tracker import SkipKey

__all__ = ["describe", "has_skippables", "verify_skippables"]


def has_skippables(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Sequential`` with a :func:`skippable` layer."""
    return isinstance(module, nn.Sequential) and any(
        isinstance(layer, Skippable) for layer in module._modules.values()
    )


def describe(key: SkipKey) -> str:
    """A skip as messages show it: its name, and its namespace if it is isolated."""
    ns, name = key
    return repr(name) if ns is None else f"{name!r} (isolated in {ns!r})"


def verify_skippables(module: nn.Sequential) -> None:
    """Check that each skip is stashed by one layer and popped by one later layer.

    Only the Sequential's own layers count (a skippable nested deeper pairs within its
    parent). A layer used at two positions counts at both.

    Args:
        module: the model.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or some stash and pop do not
            pair up; the message lists every such skip, with the fix.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"verify_skippables checks an nn.Sequential, got {type(module).__name__}")
    stashed_by: dict[SkipKey, str] = {}
    popped_by: dict[SkipKey, str] = {}
    problems: list[str] = []
    # NOTE: each problem begins with torchgpipe's own sentence for it, so code (and tests)
    # written against torchgpipe's messages still match; the fix follows.
    for layer_name, layer in module._modules.items():
        if not isinstance(layer, Skippable):
            continue
        both = set(layer.stashable_names) & set(layer.poppable_names)
        for name in sorted(both):
            problems.append(
                f"'{layer_name}' declared '{name}' both as stashable and as poppable: a layer "
                "needs no skip to reach itself; give the stash and the pop different names"
            )
        for key in layer.stashable():
            if key[1] in both:
                continue
            if key in stashed_by:
                problems.append(
                    f"'{layer_name}' redeclared '{key[1]}' as stashable but not isolated by "
                    f"namespace{_within(key)}: layer '{stashed_by[key]}' stashes it first; "
                    "rename one, or isolate each stash-pop pair in its own Namespace, e.g. "
                    "`ns = Namespace(); Stash().isolate(ns), ..., Pop().isolate(ns)`"
                )
            else:
                stashed_by[key] = layer_name
        for key in layer.poppable():
            if key[1] in both:
                continue
            if key in popped_by:
                problems.append(
                    f"'{layer_name}' redeclared '{key[1]}' as poppable but not isolated by "
                    f"namespace{_within(key)}: layer '{popped_by[key]}' pops it first, and a "
                    "skip is popped once; rename one, or isolate each stash-pop pair in its "
                    "own Namespace"
                )
            elif key not in stashed_by:
                problems.append(
                    f"'{layer_name}' declared '{key[1]}' as poppable but it was not stashed"
                    f"{_within(key)} by any layer before it: stash it in an earlier layer "
                    "(@skippable(stash=[...]) and `yield stash(name, value)`), in the same "
                    "Namespace"
                )
            else:
                popped_by[key] = layer_name
    for key, layer_name in stashed_by.items():
        if key not in popped_by:
            problems.append(
                f"no module declared '{key[1]}' as poppable but stashed{_within(key)} by layer "
                f"'{layer_name}': pop it in a later layer (@skippable(pop=[...]) and "
                "`value = yield pop(name)`), in the same Namespace, or stop stashing it"
            )
    if problems:
        raise TypeError(
            "one or more pairs of stash and pop do not match (the stashes and pops of this "
            "nn.Sequential do not pair up):\n\n" + "\n".join(f"* {problem}" for problem in problems)
        )


def _within(key: SkipKey) -> str:
    """`` (isolated in <ns>)`` for a skip in a Namespace, else nothing."""
    return "" if key[0] is None else f" (isolated in {key[0]!r})"
