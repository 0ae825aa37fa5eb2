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

Hugging Face models (GPT-2, Llama, BERT, T5, Mixtral in ``transformers`` 5) trace as they
are, with four things plain fx lacks (checked in ``tests/test_hf_models.py``: every
gradient equals plain training's to round-off):

- the root is a generated function naming exactly the inputs given, which calls the
  model's forward, so a decorated forward (``@can_return_tuple``) runs as in a call;
- a condition on shapes, ranks or dtypes (``if q_length == 1``, ``mask.ndim < 4``) takes
  the example's branch, as torch.export would specialize it, with a guard in the graph
  that fails an input taking the other branch; ``len()`` of a shape is its rank;
- ``x[i] = v`` is recorded; a ``ModelOutput`` is built again, so the pipe returns it;
- ``use_cache`` not given is False: a cache is for generation, not a pipeline.

torch.export was not taken even so: it inlines every module, so there are no leaves
(Mixtral's data-dependent expert loop needs one: ``leaf_modules=[MixtralExperts]``) and
no submodule calls for split points and user's modules to hold the parameters.
"""

from __future__ import annotations

import collections
import inspect
import operator
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.immutable_collections import immutable_dict

from gpipe.split.errors import is_user_frame, untraceable
from gpipe.split.shadow import (
    Shadow,
    finfo_of_traced_dtypes,
    kept_buffers,
)
from gpipe.split.trace_patches import lengths_of_shapes, traceable_factories

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


_PLAIN_DICTS = (dict, collections.OrderedDict, immutable_dict)


class _Tracer(fx.Tracer):
    """torch.fx's tracer, with the user's leaves, proxied buffers, blame on failure, and the
    example run alongside (see :mod:`gpipe.split.shadow`)."""

    # NOTE: a buffer sliced by a traced length (GPT-2's causal `bias[:T, :T]`) needs the
    # buffer to be a graph value too; plain fx hands the real tensor to the slice and fails.
    proxy_buffer_attributes = True

    def __init__(
        self,
        names: set[str],
        types: tuple[type[nn.Module], ...],
        shadow: Shadow | None = None,
        root_fn: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self._root_fn = root_fn
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

    def create_args_for_root(
        self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        if self._root_fn is not None:
            root_fn, concrete_args = self._root_fn, None
        return super().create_args_for_root(root_fn, is_module, concrete_args)

    def create_arg(self, a: Any) -> Any:
        # NOTE: fx records a dict subclass (Hugging Face's ModelOutput) as a plain dict; the
        # graph builds the model's own type again, so the pipe returns what the model does.
        if isinstance(a, dict) and type(a) not in _PLAIN_DICTS:
            items = {key: super(_Tracer, self).create_arg(value) for key, value in a.items()}
            return self.create_node("call_function", type(a), (), items)
        return super().create_arg(a)

    def to_bool(self, obj: fx.Proxy) -> bool:
        """The example's truth of a condition on shapes (``if q_length == 1``), kept by a
        guard in the graph; a condition on what tensors hold still fails.

        NOTE: Hugging Face's mask code branches on ranks and lengths; torch.export would
        specialize them the same way. The guard makes an input that would take the
        other branch fail loudly instead of running the example's branch.
        """
        shadow = self.shadow
        if shadow is None or not shadow.of_metadata(obj.node):
            return super().to_bool(obj)
        truth = bool(shadow.value(obj.node))
        condition = obj if truth else self.create_proxy("call_function", operator.not_, (obj,), {})
        frame = next(
            (f for f in reversed(traceback.extract_stack()) if is_user_frame(f.filename)), None
        )
        where = (
            f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)" if frame else ""
        )
        self.create_proxy(
            "call_function",
            torch._assert,
            (
                condition,
                f"gpipe.split traced the model where a condition on shapes{where} was "
                f"{truth} for the example inputs; these inputs make it {not truth}, a "
                "branch the trace does not hold: call gpipe.split with example inputs "
                "shaped like these (the same batch size, for a condition on it)",
            ),
            {},
        )
        return truth

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        """The items of a shape (``(*x.shape[:-1], -1)``), each a graph value: how many
        there are is the tensor's rank, which no input changes."""
        shadow = self.shadow
        if shadow is not None and shadow.of_metadata(obj.node):
            value = shadow.value(obj.node)
            if isinstance(value, tuple | list):
                return iter([obj[i] for i in range(len(value))])  # type: ignore[index]
        return super().iter(obj)

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
    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in bound:
        # NOTE: a Hugging Face model defaults to its config's use_cache=True and returns a
        # key-value cache, an object no stage can hand on; a pipeline trains, and a cache
        # is for generation.
        constants["use_cache"] = False
    shadow = Shadow(model, dict(bound) | concrete)
    tracer = _Tracer(names, types, shadow, _root_function(model, given, constants))
    try:
        with (
            traceable_factories(),
            finfo_of_traced_dtypes(shadow),
            lengths_of_shapes(shadow),
            kept_buffers(model),
        ):
            graph = tracer.trace(model)
    except Exception as error:
        module, module_type = getattr(error, "_gpipe_module", ("", type(model)))
        raise untraceable(error, module, module_type if module else None) from error
    nodes = [node for node in graph.nodes if node.op == "placeholder"]
    call_order = tuple(
        name for name in inspect.signature(model.forward).parameters if name in bound
    )
    return Traced(
        graph,
        tuple(given),
        dict(zip(given, nodes)),
        frozenset(tracer.called_leaves),
        constants,
        call_order,
    )


def _root_function(
    model: nn.Module, given: list[str], constants: dict[str, Any]
) -> Callable[..., Any]:
    """A function of ``(self, *given)`` that calls the model's forward with those inputs and
    the ``constants``, by name, for torch.fx to trace in place of the forward.

    NOTE: torch.fx rewrites the code of a forward that takes ``*args``/``**kwargs`` to bind
    its placeholders, which fails on a forward wrapped by a decorator (every Hugging Face
    model's: "co_varnames is too small"); and it would make ``**kwargs`` one traced input.
    This function names exactly the inputs the call gives, and the decorators run as in a
    plain call; the defaults of inputs not given apply as Python applies them.
    """
    forward = type(model).forward
    parameters = inspect.signature(forward).parameters
    positional = [
        name
        for name, p in parameters.items()
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and (name in given or name in constants)
    ]
    passed = [name if name in given else f"_constants[{name!r}]" for name in positional]
    passed += [f"{name}={name}" for name in given if name not in positional]
    passed += [f"{name}=_constants[{name!r}]" for name in constants if name not in positional]
    source = (
        f"def forward(self, {', '.join(given)}):\n    return _forward(self, {', '.join(passed)})\n"
    )
    scope: dict[str, Any] = {"_forward": forward, "_constants": constants}
    exec(compile(source, f"<gpipe.split: {type(model).__name__}.forward>", "exec"), scope)
    function: Callable[..., Any] = scope["forward"]
    return function
