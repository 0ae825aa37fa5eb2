"""What tracing patches while it runs, so that common model code traces: sizes given as
several traced ints, and the length of a traced shape."""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any

from torch import fx

from gpipe.split.shadow import Shadow, torch_functions_wrapped

__all__ = ["lengths_of_shapes", "traceable_factories"]

# Factories whose size may be given as several positional ints: torch.ones(t, t).
_SIZED_FACTORIES = ("ones", "zeros", "empty", "rand", "randn")


def _sizes_as_tuple(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 1 and any(isinstance(a, fx.Proxy) for a in args):
            return factory(tuple(args), **kwargs)
        return factory(*args, **kwargs)

    return call


@contextlib.contextmanager
def traceable_factories() -> Iterator[None]:
    """Let ``torch.ones(t, t)`` take traced lengths while tracing.

    NOTE: torch.fx records ``torch.ones((t, t))`` but raises TypeError on ``torch.ones(t, t)``
    with ``t = x.shape[1]`` (the varargs overload does not dispatch on a Proxy), a common way
    to build a causal mask; packing the sizes into one tuple is the same call.
    """
    with torch_functions_wrapped(_SIZED_FACTORIES, _sizes_as_tuple):
        yield


@contextlib.contextmanager
def lengths_of_shapes(shadow: Shadow) -> Iterator[None]:
    """Let ``len(x.shape)`` (and ``(*x.shape[:-1], -1)``, which asks for it) be the rank,
    and record ``x[index] = value`` (Mixtral's expert routing) as the operation it is.

    NOTE: fx's Proxy refuses ``len()`` outright, not through the tracer as it does ``if``
    and iteration; the length of a shape is the tensor's rank, which no input changes.
    """
    refuse = fx.Proxy.__len__

    def length(proxy: fx.Proxy) -> int:
        if shadow.of_metadata(proxy.node):
            value = shadow.value(proxy.node)
            if isinstance(value, tuple | list):
                return len(value)
        return refuse(proxy)

    def setitem(proxy: fx.Proxy, key: Any, value: Any) -> None:
        proxy.tracer.create_proxy("call_function", operator.setitem, (proxy, key, value), {})

    fx.Proxy.__len__ = length  # type: ignore[method-assign]
    setattr(fx.Proxy, "__setitem__", setitem)  # noqa: B010
    try:
        yield
    finally:
        fx.Proxy.__len__ = refuse  # type: ignore[method-assign]
        delattr(fx.Proxy, "__setitem__")
