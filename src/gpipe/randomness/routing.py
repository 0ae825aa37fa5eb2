"""Routing: a dispatch mode that hands every random op a private generator of one stream.

Random aten ops take ``generator=`` (or have an overload that does: ``rand`` ->
``rand.generator``), so a dispatch mode can give each one the generator of the layer's
stream, and the device's default generator, which other threads use at the same time, is
not touched. The few that take none (``native_dropout``, CUDA's fused dropout; fused
attention) run with the stream lent to the default generator, under its lock, for that op.
Either way an op draws what it would draw from the default generator seeded from the stream,
so a layer draws the same numbers routed as on a generator its worker owns.

NOTE: a Python dispatch mode costs CPU on every op run under it (``benchmarks/dropout.py``
measures it), random or not, so it is only active around layers that draw on a generator
other workers share (see ``streams``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from gpipe.randomness.generators import generator_name, lent
from gpipe.randomness.seeds import LayerKey, stream_seed

__all__ = ["Routing", "layer_stream"]

_Route = Callable[["Routing", Any, tuple[Any, ...], dict[str, Any]], Any]
_ROUTES: dict[Any, _Route | None] = {}


def _route_of(func: Any) -> _Route | None:
    """How a random op is given the stream's generator (None: it draws nothing), cached."""
    if func in _ROUTES:
        return _ROUTES[func]
    route: _Route | None = None
    if not isinstance(func, torch._ops.OpOverload):  # a higher-order op: its body's ops come
        _ROUTES[func] = None  # through here one by one
        return None
    schema = func._schema
    if any(arg.name == "generator" for arg in schema.arguments):
        route = _pass_generator(schema)
    elif torch.Tag.nondeterministic_seeded in func.tags:
        sibling = _generator_overload(func)
        if sibling is not None:
            route = _pass_generator(sibling._schema, sibling)
        else:
            route = _lend_default_generator
    _ROUTES[func] = route
    return route


def _generator_overload(func: Any) -> Any:
    """The overload of ``func`` that also takes a generator (``rand`` -> ``rand.generator``)."""

    def signature(schema: Any) -> list[tuple[str, str]]:
        return [(a.name, str(a.type)) for a in schema.arguments if a.name != "generator"]

    packet = func.overloadpacket
    for name in packet.overloads():
        other = getattr(packet, name)
        takes_one = any(a.name == "generator" for a in other._schema.arguments)
        if takes_one and signature(other._schema) == signature(func._schema):
            return other
    return None


def _pass_generator(schema: Any, target: Any = None) -> _Route:
    index = next(i for i, a in enumerate(schema.arguments) if a.name == "generator")
    positional = not schema.arguments[index].kwarg_only

    def route(routing: Routing, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = target or func
        if positional and index < len(args):
            if args[index] is not None:  # the caller's own generator: theirs to keep
                return call(*args, **kwargs)
            args = (*args[:index], routing.generator(args, kwargs), *args[index + 1 :])
            return call(*args, **kwargs)
        if kwargs.get("generator") is not None:
            return call(*args, **kwargs)
        return call(*args, **{**kwargs, "generator": routing.generator(args, kwargs)})

    return route


def _lend_default_generator(routing: Routing, func: Any, args: Any, kwargs: Any) -> Any:
    """A random op that takes no generator (fused dropout and attention on CUDA...): run it
    with the stream lent to its device's default generator, so it draws what it would draw
    from that generator seeded from the stream."""
    name = generator_name(routing.device_of(args, kwargs))
    if name is None:  # a device type whose default generator gpipe does not handle
        return func(*args, **kwargs)
    with lent(name, routing.generator(args, kwargs)):
        return func(*args, **kwargs)


class Routing(TorchDispatchMode):
    """Hands every random op run under it a private generator of one stream.

    Ops on a device whose default generator the worker owns (named in ``own``) are left
    alone: they draw from that generator, seeded with the same seed, which draws the same
    numbers. ``drew`` says whether any op was routed. Compiled code runs compiled under this
    mode (``ignore_compile_internals``): the mode sees the random ops compiled code still
    calls, such as Inductor's seed draw, and routes them too.

    Args:
        seed: the stream's seed; each device's private generator starts from it.
        own: the default generators the worker owns and has seeded with ``seed``.
    """

    def __init__(self, seed: int, own: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.seed = seed
        self.drew = False
        self._own = own
        self._private: dict[torch.device, torch.Generator] = {}

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        route = _ROUTES[func] if func in _ROUTES else _route_of(func)
        if route is None or (self._own and self._owned(args, kwargs)):
            return func(*args, **(kwargs or {}))
        self.drew = True
        return route(self, func, tuple(args), dict(kwargs or {}))

    def _owned(self, args: Any, kwargs: Any) -> bool:
        return generator_name(self.device_of(args, kwargs)) in self._own

    @staticmethod
    def device_of(args: Any, kwargs: Any) -> torch.device:
        """The device an op runs on: its first tensor's, else its ``device`` argument."""
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                return leaf.device
        device = (kwargs or {}).get("device")
        return torch.device(device) if device is not None else torch.device("cpu")

    def generator(self, args: Any, kwargs: dict[str, Any]) -> torch.Generator:
        """The stream's private generator on the device the op runs on."""
        device = self.device_of(args, kwargs)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        generator = self._private.get(device)
        if generator is None:
            generator = torch.Generator(device).manual_seed(self.seed)
            self._private[device] = generator
        return generator

    @staticmethod
    def warm_up() -> None:
        """Enter a routing mode once, so its one-time cost is paid now, not in a step.

        NOTE: the first dispatch mode a process enters imports torch._dynamo (seconds),
        which otherwise lands in the first forward of the first step and stretches it on
        every timeline.
        """
        with Routing(0).active():
            torch.empty(0)

    @contextmanager
    def active(self) -> Iterator[Routing]:
        """Route the body's random ops (on this thread only)."""
        # NOTE: pushed on this thread's mode stack directly: ``with mode:`` also flips
        # process-wide flags, which concurrent threads would leave in a wrong state.
        torch._C._push_on_torch_dispatch_stack(self)
        try:
            yield self
        finally:
            torch._C._pop_torch_dispatch_stack(None)


@contextmanager
def layer_stream(step_seed: int, key: LayerKey, microbatch: int) -> Iterator[None]:
    """Run plain code on the random stream a pipe's layer ``key`` draws from for ``microbatch``.

    So a pipe's random draws (dropout masks) can be reproduced without the pipe: with the
    same step seed, ``with layer_stream(seed, i, m): h = model[i](h)`` draws what the pipe's
    layer ``i`` drew for micro-batch ``m``, whatever the balance, schedule or device count::

        torch.manual_seed(0)
        seed = draw_step_seed()  # the seed of the pipe's next training step
        for m, (x, t) in enumerate(zip(scatter(input, chunks), scatter(target, chunks))):
            for i, layer in enumerate(model):
                with layer_stream(seed, i, m):
                    x = layer(x)
            with layer_stream(seed, LOSS_KEY, m):
                loss = loss_fn(x, t)

    A pipe's layers draw the same numbers on CPU and on one GPU per stage, except ops
    rewritten or held for lack of a generator argument (CUDA's fused dropout and attention).

    Args:
        step_seed: the step's seed (:func:`~gpipe.randomness.draw_step_seed`).
        key: the layer's position in the user's model, or ``LOSS_KEY`` for the loss.
        microbatch: the micro-batch index.
    """
    with Routing(stream_seed(step_seed, key, microbatch)).active():
        yield
