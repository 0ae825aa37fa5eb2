"""skippable, stash and pop: a Sequential's layers hand tensors to later layers by name.

torchgpipe's interface: a layer declares the skips it stashes and pops, and its forward is
a generator that yields commands::

    @skippable(stash=["1to3"])
    class Layer1(nn.Module):
        def forward(self, x):
            yield stash("1to3", x)
            return self.conv(x)

    @skippable(pop=["1to3"])
    class Layer3(nn.Module):
        def forward(self, x):
            skip = yield pop("1to3")
            return self.conv(x) + skip

Run plainly, the stash waits in the thread's tracker until the later layer pops it; in a
pipe, :func:`gpipe.skip.stages` sends it straight from the stage that stashes it to the
stage that pops it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any, ClassVar, TypeVar

from torch import nn

from gpipe.skip.namespace import Namespace
from gpipe.skip.tracker import SkipKey, current_tracker

__all__ = ["Skippable", "pop", "skippable", "stash"]

S = TypeVar("S", bound="Skippable")


class stash:  # NOTE: lower case, as torchgpipe names it: ``yield stash(name, value)``
    """The command ``yield stash(name, value)``: keep ``value`` for the layer that pops ``name``.

    ``value`` is usually a tensor; ``None`` and other values pass as they are.
    """

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: Any) -> None:
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"stash({self.name!r}, ...)"


class pop:  # NOTE: lower case, as torchgpipe names it: ``skip = yield pop(name)``
    """The command ``value = yield pop(name)``: take the value an earlier layer stashed."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"pop({self.name!r})"


class Skippable(nn.Module):
    """The base of every class :func:`skippable` makes; a layer that stashes or pops skips.

    The decorated class is a subclass of the user's own, so parameter names, ``isinstance``
    and the user's methods are as before; only ``forward`` changes: it runs the user's
    generator and serves its ``stash``/``pop`` commands from the current skip tracker.
    """

    stashable_names: ClassVar[tuple[str, ...]] = ()
    poppable_names: ClassVar[tuple[str, ...]] = ()

    @property
    def namespaces(self) -> dict[str, Namespace]:
        """The namespace each isolated skip name of this layer is in (see :meth:`isolate`)."""
        # NOTE: set lazily, in __dict__, so the user's __init__ (which runs instead of ours)
        # needs nothing from us, and copies of the layer keep their namespaces.
        found: dict[str, Namespace] = self.__dict__.setdefault("_skip_namespaces", {})
        return found

    def namespaced(self, name: str) -> SkipKey:
        """The key of this layer's skip ``name``: its namespace, if isolated, and the name."""
        return (self.namespaces.get(name), name)

    def stashable(self) -> list[SkipKey]:
        """The keys of the skips this layer stashes, in declaration order."""
        return [self.namespaced(name) for name in self.stashable_names]

    def poppable(self) -> list[SkipKey]:
        """The keys of the skips this layer pops, in declaration order."""
        return [self.namespaced(name) for name in self.poppable_names]

    def isolate(self: S, ns: Namespace, *, only: str | Iterable[str] | None = None) -> S:
        """Put this layer's skips (or only some) in namespace ``ns``; returns the layer.

        A stash pairs with a pop of the same name in the same namespace, so a class used
        twice keeps its pairs apart: ``Stash().isolate(ns1)`` ... ``Pop().isolate(ns1)``.

        Args:
            ns: the namespace.
            only: a name, or names, of this layer's skips to isolate; None: all of them.

        Raises:
            TypeError: ``ns`` is not a :class:`Namespace`.
            ValueError: ``only`` names a skip this layer does not declare.
        """
        if not isinstance(ns, Namespace):
            raise TypeError(
                f"isolate takes a gpipe.skip.Namespace, got {ns!r}: isolate(Namespace())"
            )
        declared = (*self.stashable_names, *self.poppable_names)
        names = declared if only is None else ([only] if isinstance(only, str) else list(only))
        unknown = [name for name in names if name not in declared]
        if unknown:
            raise ValueError(
                f"{self._get_name()} declares the skips {list(declared)}, not {unknown}: "
                "isolate(ns, only=...) takes names from its @skippable(stash=..., pop=...)"
            )
        for name in names:
            self.namespaces[name] = ns
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The user's forward, with its ``stash``/``pop`` commands served.

        Raises:
            RuntimeError: a declared pop with nothing stashed under its name, a command for
                an undeclared name, or a declared name the forward did not stash or pop.
            TypeError: the forward yielded something other than a ``stash`` or ``pop``.
        """
        tracker = current_tracker()
        where = self._get_name()
        missing = [name for name in self.poppable_names if not tracker.has(self.namespaced(name))]
        if missing:
            raise RuntimeError(
                f"{where} pops {missing}, but no earlier layer stashed it: a layer before it "
                f"must `yield stash({missing[0]!r}, value)` in the same namespace (check the "
                "model with gpipe.skip.verify_skippables(model))"
            )
        poppable = {name: tracker.take(self.namespaced(name)) for name in self.poppable_names}
        popped: set[str] = set()
        stashed: dict[str, Any] = {}

        def on_stash(command: stash) -> None:
            if command.name not in self.stashable_names:
                raise RuntimeError(
                    f"{where} stashed {command.name!r}, which it does not declare: add it to "
                    f"@skippable(stash=[...]) (it declares {list(self.stashable_names)})"
                )
            if command.name in stashed:
                raise RuntimeError(f"{where} stashed {command.name!r} twice in one forward")
            stashed[command.name] = command.value

        def on_pop(command: pop) -> Any:
            if command.name not in self.poppable_names:
                raise RuntimeError(
                    f"{where} popped {command.name!r}, which it does not declare: add it to "
                    f"@skippable(pop=[...]) (it declares {list(self.poppable_names)})"
                )
            if command.name in popped:
                raise RuntimeError(f"{where} popped {command.name!r} twice in one forward")
            popped.add(command.name)
            return poppable.pop(command.name)

        output = _serve(super().forward(*args, **kwargs), on_stash, on_pop, where)
        not_stashed = [name for name in self.stashable_names if name not in stashed]
        if not_stashed:
            raise RuntimeError(
                f"{where} declares {not_stashed} as stashed but its forward did not stash "
                f"them: `yield stash({not_stashed[0]!r}, value)` in forward (a value of "
                "None is fine), or drop the name from @skippable(stash=[...])"
            )
        if poppable:
            raise RuntimeError(
                f"{where} declares {list(poppable)} as popped but its forward did not pop "
                f"them: `value = yield pop({next(iter(poppable))!r})` in forward, or drop the "
                "name from @skippable(pop=[...]) and from its stash"
            )
        for name, value in stashed.items():
            tracker.save(self.namespaced(name), value)
        return output

    def __repr__(self) -> str:
        return f"@skippable({super().__repr__()})"


def _serve(
    result: Any,
    on_stash: Callable[[stash], None],
    on_pop: Callable[[pop], Any],
    where: str,
) -> Any:
    """Run a skippable forward's generator to its end, serving its commands; its result."""
    if not isinstance(result, Generator):
        return result  # a forward without yield returned its output at once
    try:
        command = next(result)
        while True:
            if isinstance(command, stash):
                on_stash(command)
                command = result.send(None)
            elif isinstance(command, pop):
                command = result.send(on_pop(command))
            else:
                raise TypeError(
                    f"{where}.forward yielded {command!r}: a skippable layer yields only "
                    "`stash(name, value)` or `pop(name)`, and returns its output"
                )
    except StopIteration as stop:
        return stop.value


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[type[nn.Module]], type[Skippable]]:
    """The class decorator that lets a layer stash skips for later layers and pop them.

    Every name a layer stashes must be popped by exactly one later layer of the same
    ``nn.Sequential`` (in the same :class:`Namespace`); :func:`verify_skippables` checks
    that, and ``GPipe`` does when it is given the model.

    Args:
        stash: the names of the skips the layer's forward stashes (``yield stash(name, x)``).
        pop: the names of the skips it pops (``x = yield pop(name)``).

    Returns:
        A decorator making a subclass of the decorated ``nn.Module`` class (same name).

    Raises:
        TypeError: ``stash``/``pop`` is a string rather than a list of names, or the
            decorated class is not an ``nn.Module``.
    """
    stashes, pops = _names(stash, "stash"), _names(pop, "pop")

    def decorate(cls: type[nn.Module]) -> type[Skippable]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, not {cls!r}")
        attrs = {
            "stashable_names": stashes,
            "poppable_names": pops,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        return type(cls.__name__, (Skippable, cls), attrs)

    return decorate


def _names(names: Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(names, str):
        raise TypeError(
            f"@skippable({what}=...) takes a list of names, got the string {names!r}: "
            f"write @skippable({what}=[{names!r}])"
        )
    listed = list(names)
    if not all(isinstance(name, str) for name in listed):
        raise TypeError(f"@skippable({what}=...) takes a list of names (str), got {listed!r}")
    return tuple(dict.fromkeys(listed))
