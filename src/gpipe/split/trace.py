"""Tracing a model into one torch.fx graph that calls the user's own submodules.

torch.fx and not ``torch.export``. Measured on the models of ``tests/split_models.py``
(``cd tests && python test_split_tracers.py`` prints this; "yes": output, every gradient and
the running statistics equal plain training, on the user's own tensors; module calls: the
user's submodules the graph still calls)::

    model               symbolic_trace  gpipe's fx       fx + leaf  calls  export  calls
    gpt (tied, mask)    yes             yes              -          33     yes     0
    resnet (BatchNorm)  yes             yes              -          20     yes     0
    unet (long skips)   yes             yes              -          13     yes     0
    encoder-decoder     yes             yes              -          11     yes     0
    lstm                yes             yes              -          4      yes     0
    data-dependent if   no: TraceError  no: Untraceable  yes        3      no      -
    hf-style kwargs     no: TypeError   yes              -          24     yes     0

Both follow six of the seven. With the model's ``if`` inside a leaf, fx follows all seven;
export has no leaves and refuses a data-dependent ``if`` anywhere
(GuardOnDataDependentSymNode: it would need ``torch.cond`` in the user's code). And only fx
keeps the user's submodules as calls: a leaf stays opaque, a split point can name any
submodule, and stage modules read like the model (``state_dict`` keys, ``print``); export
inlines every module into ATen operations. Plain ``symbolic_trace`` fails the HF-style
model at a buffer sliced by a traced length (GPT-2's causal ``bias[:T, :T]``); gpipe's
tracer proxies buffers, which follows it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from gpipe.split.errors import untraceable
from gpipe.split.shadow import (
    Shadow,
    finfo_of_traced_dtypes,
    kept_buffers,
    torch_functions_wrapped,
)

__all__ = ["Traced", "trace"]

LeafSpec = Sequence[str | type[nn.Module]]


@dataclass(frozen=True)
class Traced:
    """A model's forward as one fx graph.

    Attributes:
        graph: the graph; ``call_module`` and ``get_attr`` targets are paths in the model.
        inputs: the names of the model's inputs the graph takes, in the forward's order
            (arguments the call left at their defaults are baked in, not inputs).
        placeholders: the graph's placeholder node for each input name.
        leaves: the qualified names of the submodules called as a whole.
        constants: the arguments the example call gave flag-like values (``True``, an
            int, ``None``, a string), baked into the trace like defaults.
        call_order: every argument the example call gave, inputs and constants, in the
            forward's order (how positional arguments line up).
    """

    graph: fx.Graph
    inputs: tuple[str, ...]
    placeholders: dict[str, fx.Node]
    leaves: frozenset[str]
    constants: dict[str, Any] = field(default_factory=dict)
    call_order: tuple[str, ...] = ()


class _Tracer(fx.Tracer):
    """torch.fx's tracer, with the user's leaves, proxied buffers, blame on failure, and the
    example run alongside (see :mod:`gpipe.split.shadow`)."""

    # NOTE: a buffer sliced by a traced length (GPT-2's causal `bias[:T, :T]`) needs the
    # buffer to be a graph value too; plain fx hands the real tensor to the slice and fails.
    proxy_buffer_attributes = True

    def __init__(
        self, names: set[str], types: tuple[type[nn.Module], ...], shadow: Shadow | None = None
    ) -> None:
        super().__init__()
        self._leaf_names = names
        self._leaf_types = types
        self.called_leaves: set[str] = set()
        self.shadow = shadow
        self._shadowing = False  # running the example: modules and attributes act as usual

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if self.shadow is not None and not self._shadowing:
            self._shadowing = True
            try:
                self.shadow.record(node)
            finally:
                self._shadowing = False
        return node

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self._shadowing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self._leaf_names or isinstance(m, self._leaf_types):
            leaf = True
        else:
            leaf = super().is_leaf_module(m, module_qualified_name)
        if leaf:
            self.called_leaves.add(module_qualified_name)
        return leaf

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self._shadowing:
            return forward(*args, **kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as error:
            # the innermost submodule claims the failure first
            if not hasattr(error, "_gpipe_module"):
                error._gpipe_module = (self.path_of_module(m), type(m))  # type: ignore[attr-defined]
            raise


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
def _traceable_factories() -> Iterator[None]:
    """Let ``torch.ones(t, t)`` take traced lengths while tracing.

    NOTE: torch.fx records ``torch.ones((t, t))`` but raises TypeError on ``torch.ones(t, t)``
    with ``t = x.shape[1]`` (the varargs overload does not dispatch on a Proxy), a common way
    to build a causal mask; packing the sizes into one tuple is the same call.
    """
    with torch_functions_wrapped(_SIZED_FACTORIES, _sizes_as_tuple):
        yield


def _leaf_spec(
    model: nn.Module, leaf_modules: LeafSpec | None
) -> tuple[set[str], tuple[type, ...]]:
    """The leaf names and types, each checked against the model."""
    names: set[str] = set()
    types: list[type] = []
    known = dict(model.named_modules())
    for leaf in leaf_modules or ():
        if isinstance(leaf, str):
            if leaf not in known or leaf == "":
                raise ValueError(
                    f"leaf_modules names {leaf!r}, which is no submodule of the model; "
                    f"submodules are named as in model.named_modules(), e.g. "
                    f"{[n for n in known if n][:6]}"
                )
            names.add(leaf)
        elif isinstance(leaf, type) and issubclass(leaf, nn.Module):
            types.append(leaf)
        else:
            raise TypeError(
                f"leaf_modules takes submodule names (str) or nn.Module classes, got {leaf!r}"
            )
    return names, tuple(types)


def _concrete_args(
    model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[list[str], dict[str, Any]]:
    """The forward's input names the call gives, and the defaults of those it does not."""
    signature = inspect.signature(model.forward)
    variadic = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"example_inputs/example_kwargs do not fit {type(model).__name__}.forward"
            f"{signature}: {error}"
        ) from None
    if any(name in bound.arguments for name in variadic):
        raise TypeError(
            f"gpipe.split traces named arguments only, but the example call fills "
            f"{type(model).__name__}.forward's *args/**kwargs ({variadic}); pass those values "
            "by their own names, or wrap the model in a module whose forward names them"
        )
    given = [name for name in signature.parameters if name in bound.arguments]
    # NOTE: a flag (a bool, an int, None, a string) is baked in like a default: as a traced
    # input, `if return_dict:` would fail and `if mask is not None:` take the wrong branch.
    constants = {
        name: bound.arguments[name] for name in given if is_constant(bound.arguments[name])
    }
    given = [name for name in given if name not in constants]
    concrete = constants | {
        p.name: p.default
        for p in signature.parameters.values()
        if p.name not in bound.arguments and p.name not in variadic
    }
    return given, concrete


# NOTE: what steers control flow or sizes is baked in (`if return_dict:`, `range(n)`); a
# float stays a traced input (a `scale` may change from call to call, and arithmetic on it
# traces).
_CONSTANT_TYPES = (bool, int, str, type(None), torch.dtype, torch.device)


def is_constant(value: Any) -> bool:
    """Whether ``value`` is a flag-like Python value the trace bakes in (a bool, an int,
    None, a string, a dtype or device, or a tuple of them), not a traced input."""
    if isinstance(value, tuple | list):
        return all(is_constant(item) for item in value)
    return isinstance(value, _CONSTANT_TYPES)


def trace(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    leaf_modules: LeafSpec | None = None,
) -> Traced:
    """Trace ``model(*args, **kwargs)`` into one graph over the user's submodules.

    Args:
        model: the model.
        args: example positional inputs (only flag-like values among them are used: they
            are baked in, see :attr:`Traced.constants`).
        kwargs: example keyword inputs; forward arguments not given keep their defaults.
        leaf_modules: submodule names or classes to call as a whole (besides torch.nn's own
            layers, which torch.fx never traces into).

    Returns:
        The :class:`Traced` graph.

    Raises:
        UntraceableError: torch.fx cannot follow the forward; the message names the
            operation, the user's line and the submodule to mark as a leaf.
        TypeError: the example call does not fit the forward, or fills ``*args``.
        ValueError: a leaf name that is no submodule.
    """
    names, types = _leaf_spec(model, leaf_modules)
    given, concrete = _concrete_args(model, args, kwargs)
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    constants = {name: value for name, value in bound.items() if name not in given}
    shadow = Shadow(model, dict(bound) | concrete)
    tracer = _Tracer(names, types, shadow)
    try:
        with _traceable_factories(), finfo_of_traced_dtypes(shadow), kept_buffers(model):
            graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as error:
        module, module_type = getattr(error, "_gpipe_module", ("", type(model)))
        raise untraceable(error, module, module_type if module else None) from error
    placeholders = _name_placeholders(graph, model, given, concrete)
    call_order = tuple(
        name for name in inspect.signature(model.forward).parameters if name in bound
    )
    return Traced(
        graph,
        tuple(given),
        placeholders,
        frozenset(tracer.called_leaves),
        constants,
        call_order,
    )


def _name_placeholders(
    graph: fx.Graph, model: nn.Module, given: list[str], concrete: dict[str, Any]
) -> dict[str, fx.Node]:
    """Each given input's placeholder; those of arguments baked in as defaults are removed.

    fx makes one placeholder per named argument, in the forward's order (renaming one that
    would shadow a name, ``mask_1``), so the order tells which is which.
    """
    for node in list(graph.nodes):
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            graph.erase_node(node)  # fx's guard that a None default stays None
    nodes = [node for node in graph.nodes if node.op == "placeholder"]
    names = [n for n in inspect.signature(model.forward).parameters if n in concrete or n in given]
    if len(nodes) != len(names):
        raise RuntimeError(f"torch.fx made placeholders {nodes} for the arguments {names}")
    found: dict[str, fx.Node] = {}
    for node, name in zip(nodes, names):
        if name in concrete:
            _drop_guards(graph, node)
            if node.users:
                raise RuntimeError(f"the default of {name!r} is still read by {list(node.users)}")
            graph.erase_node(node)
        else:
            found[name] = node
    return found


def _drop_guards(graph: fx.Graph, node: fx.Node) -> None:
    """Erase fx's guard that a default baked into the trace keeps its value.

    NOTE: for a default other than None (``scale=1.0``, ``use_cache=False``) fx adds
    ``torch._assert(arg == default)``; the argument is no input of the stages, so the guard
    would read a value nobody passes.
    """
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.eq:
            for guard in list(user.users):
                if guard.op == "call_function" and guard.target is torch._assert:
                    graph.erase_node(guard)
            if not user.users:
                graph.erase_node(user)
