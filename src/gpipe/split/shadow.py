"""``torch.finfo(x.dtype)`` in a traced forward: the example call, run alongside.

torch.fx hands the model's forward Proxies, so ``x.dtype`` is one more graph value and
``torch.finfo(x.dtype).min`` (Hugging Face's mask fill value) fails. The tracer here runs
each recorded operation once more on the example inputs as it records it, so finfo can be
given the example's dtype. Everything else stays traced: shapes (the batch a pipe runs is
not the example's), dtypes and devices (a stage runs where the pipe puts it).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import fx, nn

__all__ = ["Shadow", "finfo_of_traced_dtypes", "kept_buffers", "torch_functions_wrapped"]

_UNKNOWN = object()


class Shadow:
    """The example's value of each node the tracer has made, where it could be computed.

    Args:
        root: the model being traced.
        examples: the example inputs by argument name (and the defaults baked in).
    """

    def __init__(self, root: nn.Module, examples: Mapping[str, Any]) -> None:
        self._root = root
        self._examples = {
            name: value.detach().clone() if isinstance(value, torch.Tensor) else value
            for name, value in examples.items()
        }
        self._values: dict[fx.Node, Any] = {}
        self._of_metadata: set[fx.Node] = set()

    def record(self, node: fx.Node) -> None:
        """Compute ``node``'s value from its inputs' (nothing if any is unknown or it fails)."""
        try:
            with torch.no_grad():
                value = self._compute(node)
        except Exception:  # a value the shadow cannot know just stays traced
            value = _UNKNOWN
        if value is not _UNKNOWN:
            self._values[node] = value
            if _reads_metadata(node) or (
                node.op in ("call_function", "call_method")
                and node.all_input_nodes
                and all(arg in self._of_metadata for arg in node.all_input_nodes)
            ):
                self._of_metadata.add(node)

    def value(self, node: fx.Node) -> Any:
        """The example's value of ``node``, or raise KeyError."""
        return self._values[node]

    def of_metadata(self, node: fx.Node) -> bool:
        """Whether ``node``'s value follows from tensors' shapes, ranks, dtypes and devices
        alone (``x.shape[1] == 1``, ``mask.ndim < 4``), never from what they hold."""
        return node in self._of_metadata

    def _compute(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            # NOTE: fx renames an argument's placeholder that would shadow a name (`mask_1`)
            target = str(node.target)
            return self._examples.get(target, self._examples.get(target[:-2], _UNKNOWN))
        if node.op == "get_attr":
            return operator.attrgetter(str(node.target))(self._root)
        known = True

        def look(arg: fx.Node) -> Any:
            nonlocal known
            if arg not in self._values:
                known = False
                return None
            return self._values[arg]

        args = fx.node.map_arg(node.args, look)
        kwargs = fx.node.map_arg(node.kwargs, look)
        if not known:
            return _UNKNOWN
        if node.op == "call_function":
            return node.target(*args, **kwargs)  # type: ignore[operator]
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        if node.op == "call_module":
            return self._root.get_submodule(str(node.target))(*args, **kwargs)
        return _UNKNOWN


_METADATA = frozenset({"shape", "ndim", "dtype", "size", "dim", "is_floating_point"})


def _reads_metadata(node: fx.Node) -> bool:
    """Whether ``node`` reads a tensor's metadata (``x.shape``, ``x.size()``, ``x.dtype``)."""
    if node.op == "call_method":
        return node.target in _METADATA
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return node.args[1] in _METADATA
    return False


@contextlib.contextmanager
def finfo_of_traced_dtypes(shadow: Shadow) -> Iterator[None]:
    """Let ``torch.finfo(x.dtype)`` and ``torch.iinfo(x.dtype)`` take a traced dtype.

    NOTE: only these two: ``x.dtype`` and ``x.device`` otherwise stay graph values, so a
    stage follows the dtype and device it runs in (``.to(x.dtype)``, ``device=x.device``);
    the numbers finfo gives (a mask's fill value) are those of the example's dtype.
    """

    def concrete(info: Any) -> Any:
        def call(dtype: Any = None) -> Any:
            if isinstance(dtype, fx.Proxy):
                try:
                    dtype = shadow.value(dtype.node)
                except KeyError:
                    raise TypeError(
                        f"torch.{info.__name__}() of a dtype the trace cannot know"
                    ) from None
            return info() if dtype is None else info(dtype)

        return call

    with torch_functions_wrapped(("finfo", "iinfo"), concrete):
        yield


@contextlib.contextmanager
def torch_functions_wrapped(names: Iterable[str], wrap: Callable[[Any], Any]) -> Iterator[None]:
    """Replace ``torch.<name>`` by ``wrap(torch.<name>)`` for the block, and put it back."""
    originals = {name: getattr(torch, name) for name in names}
    try:
        for name, function in originals.items():
            setattr(torch, name, wrap(function))
        yield
    finally:
        for name, function in originals.items():
            setattr(torch, name, function)


@contextlib.contextmanager
def kept_buffers(model: nn.Module) -> Iterator[None]:
    """Put every buffer back as it was (the shadow run updates BatchNorm's statistics), and
    leave the global random state alone (its dropout draws)."""
    saved = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)
