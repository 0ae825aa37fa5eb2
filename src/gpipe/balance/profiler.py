"""Profiling: what each layer of an nn.Sequential costs in time and memory, measured."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpipe.runtime.saved import SavedBytes, gradient_bytes, storage_keys, tensor_bytes
from gpipe.runtime.split_backward import backward_input
from gpipe.structure import leaves, map_tensors
from gpipe.units import format_bytes

__all__ = ["COST_KINDS", "Profile", "optimizer_state_factor", "profile"]

#: What :meth:`Profile.costs` can weigh layers by.
COST_KINDS = ("time", "memory", "params")

# Optimizer state per parameter, in parameter-sized tensors (scalar step counters ignored).
_STATE_BY_NAME: dict[str, int] = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
_STATE_BY_CLASS: dict[type, int] = {
    torch.optim.SGD: 0,  # momentum is off by default; name "sgd-momentum" when it is on
    torch.optim.Adagrad: 1,
    torch.optim.RMSprop: 1,
    torch.optim.Adadelta: 2,
    torch.optim.Adam: 2,
    torch.optim.AdamW: 2,
    torch.optim.Adamax: 2,
    torch.optim.NAdam: 2,
    torch.optim.RAdam: 2,
}


@dataclass(frozen=True)
class Profile:
    """Measured per-layer costs of a model, index ``i`` for layer ``i``.

    Times are in seconds (median of the timed repeats), sizes in bytes.

    Attributes:
        names: each layer's class name.
        forward: forward time.
        backward: backward time (input and weight gradients); 0 if nothing is differentiable.
        output_bytes: bytes of the tensors the layer returns.
        activation_bytes: bytes autograd saves for backward that this layer is the first to
            save, once per storage, parameters and buffers excluded. The layers run as one
            chain, so a tensor two neighbours both save (a Tanh's output that the next Linear
            saves as its input) counts once, for the Tanh: the entries add up.
        parameter_bytes: bytes of the layer's parameters.
        gradient_bytes: bytes of the gradients of its trainable parameters.
        optimizer_bytes: bytes of optimizer state for its trainable parameters.
        input_bytes: bytes of the tensors the layer receives (a stage starting here keeps them
            for its backward).
        saved_input_bytes: the part of ``activation_bytes`` that is the layer's own input.
        cpu: CPU seconds the calling thread spent on the layer's forward + backward:
            ``cpu / (forward + backward)`` is near 1 when the layer computes on the CPU (its
            intra-op threads busy alongside) and near 0 when it waits on an accelerator.
            (The calling thread only: idle OpenMP workers spin, which would count as work.)
        weight: the part of ``backward`` that is the weight gradient (what a zero-bubble W
            runs): backward time minus the input gradient alone. Measured only with
            ``profile(..., split_backward=True)``, else empty.
        deferred_bytes: what a zero-bubble B keeps for W from this layer: the gradients at
            its parameter forks (its input taking a gradient). Measured only with
            ``profile(..., split_backward=True)``, else empty.
    """

    names: list[str]
    forward: list[float]
    backward: list[float]
    output_bytes: list[int]
    activation_bytes: list[int]
    parameter_bytes: list[int]
    gradient_bytes: list[int]
    optimizer_bytes: list[int]
    input_bytes: list[int] = field(default_factory=list)
    saved_input_bytes: list[int] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)
    deferred_bytes: list[int] = field(default_factory=list)

    @property
    def layers(self) -> int:
        """How many layers were profiled."""
        return len(self.names)

    def stage_activation_bytes(self, start: int, end: int) -> int:
        """What one micro-batch of a stage holding layers ``start..end-1`` keeps for backward.

        The stage input (the pipeline keeps it) plus every activation its layers save, each
        storage once: exactly what the runtime counts in ``Event.memory``.

        Args:
            start: the stage's first layer.
            end: one past its last layer.

        Returns:
            Bytes.

        Raises:
            ValueError: an empty or out-of-range layer span.
        """
        if not 0 <= start < end <= self.layers:
            raise ValueError(f"need 0 <= start < end <= {self.layers}, got {start=}, {end=}")
        saved = sum(self.activation_bytes[start:end])
        # NOTE: a first layer that saves its input (Linear) holds the stage input already.
        return self.input_bytes[start] + saved - self.saved_input_bytes[start]

    def costs(self, kind: str = "time") -> list[float]:
        """One cost per layer, ready for :func:`gpipe.balance.balance_costs`.

        Args:
            kind: ``"time"`` (forward + backward seconds), ``"memory"`` (bytes of parameters,
                gradients, optimizer state and saved activations of one micro-batch) or
                ``"params"`` (parameter bytes).

        Returns:
            A non-negative cost per layer.

        Raises:
            ValueError: an unknown ``kind``.
        """
        if kind == "time":
            return [f + b for f, b in zip(self.forward, self.backward)]
        if kind == "memory":
            parts = zip(
                self.parameter_bytes,
                self.gradient_bytes,
                self.optimizer_bytes,
                self.activation_bytes,
            )
            return [float(sum(layer)) for layer in parts]
        if kind == "params":
            return [float(size) for size in self.parameter_bytes]
        raise ValueError(f"kind must be one of {', '.join(map(repr, COST_KINDS))}, got {kind!r}")

    def __str__(self) -> str:
        header = ("layer", "forward", "backward", "output", "saved", "params", "optimizer")
        rows = [header]
        for i in range(self.layers):
            rows.append(
                (
                    f"{i} {self.names[i]}",
                    _format_seconds(self.forward[i]),
                    _format_seconds(self.backward[i]),
                    format_bytes(self.output_bytes[i]),
                    format_bytes(self.activation_bytes[i]),
                    format_bytes(self.parameter_bytes[i]),
                    format_bytes(self.optimizer_bytes[i]),
                )
            )
        rows.append(
            (
                "total",
                _format_seconds(sum(self.forward)),
                _format_seconds(sum(self.backward)),
                "",
                format_bytes(sum(self.activation_bytes)),
                format_bytes(sum(self.parameter_bytes)),
                format_bytes(sum(self.optimizer_bytes)),
            )
        )
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(width) if c == 0 else cell.rjust(width)
                for c, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in rows
        ]
        return "\n".join(lines)


def optimizer_state_factor(optimizer: str | type[torch.optim.Optimizer] | None) -> int:
    """Optimizer state per trainable parameter, in multiples of the parameter's size.

    Args:
        optimizer: None or ``"sgd"`` (no state), ``"sgd-momentum"`` (one buffer), ``"adam"``
            or ``"adamw"`` (two moments), or an optimizer class such as ``torch.optim.Adam``.

    Returns:
        0, 1 or 2.

    Raises:
        ValueError: an optimizer this does not know.
    """
    if optimizer is None:
        return 0
    if isinstance(optimizer, str) and optimizer.lower() in _STATE_BY_NAME:
        return _STATE_BY_NAME[optimizer.lower()]
    if isinstance(optimizer, type):
        for cls in optimizer.__mro__:
            if cls in _STATE_BY_CLASS:
                return _STATE_BY_CLASS[cls]
    names = ", ".join(map(repr, _STATE_BY_NAME))
    raise ValueError(
        f"unknown optimizer {optimizer!r}: pass None, one of {names}, or a torch.optim class "
        "such as torch.optim.Adam"
    )


def profile(
    module: nn.Sequential,
    sample: Any,
    *,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    optimizer: str | type[torch.optim.Optimizer] | None = None,
    split_backward: bool = False,
) -> Profile:
    """Measure every layer of ``module`` on ``sample``, one layer at a time.

    The sample flows as in ``nn.Sequential``: each layer's output is the next layer's input.
    Saved bytes come from one more pass through all layers as one graph, as a stage runs, so
    a tensor that neighbouring layers both save counts once, for the first (they add up).
    Each layer runs forward on a fresh copy of its input (floating tensors requiring grad),
    then backward from a gradient of ones for every floating output that requires grad. The
    model runs in train mode; afterwards its modes, parameter gradients, buffers (BatchNorm
    statistics) and the random number generators are as they were.

    Args:
        module: the model; layers not on ``device`` are profiled on a copy moved there.
        sample: one micro-batch of input (a tensor, or tensors in tuples, lists, dicts).
        device: where to run.
        repeats: timed runs per layer; the median is kept.
        warmup: untimed runs before them.
        optimizer: which optimizer's state to count, see :func:`optimizer_state_factor`.
        split_backward: also time each layer's input gradient alone, to split its backward
            into B and W for zero-bubble schedules (``Profile.weight``).

    Returns:
        The per-layer :class:`Profile`.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: an empty module or sample, ``repeats < 1``, ``warmup < 0``, or an unknown
            optimizer.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"profile needs an nn.Sequential, got {type(module).__name__}; wrap the layers: "
            "nn.Sequential(*layers)"
        )
    if len(module) == 0:
        raise ValueError("profile needs a module with at least one layer, got an empty one")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats=}, {warmup=}")
    _check_sample(sample)
    factor = optimizer_state_factor(optimizer)
    device = torch.device(device)

    measured: list[_LayerCost] = []
    with _preserved(module, device):
        module.train()
        value = map_tensors(lambda t: t.detach().to(device), sample)
        for layer in module:
            cost, value = _measure(
                _on_device(layer, device), value, device, repeats, warmup, split_backward
            )
            measured.append(cost)
        layers = [_on_device(layer, device) for layer in module]
        chain = _attribute(layers, map_tensors(lambda t: t.detach().to(device), sample))

    return Profile(
        names=[type(layer).__name__ for layer in module],
        forward=[c.forward for c in measured],
        backward=[c.backward for c in measured],
        output_bytes=[c.output_bytes for c in measured],
        activation_bytes=chain.saved,
        parameter_bytes=[c.parameter_bytes for c in measured],
        gradient_bytes=[c.trainable_bytes for c in measured],
        optimizer_bytes=[factor * c.trainable_bytes for c in measured],
        input_bytes=chain.inputs,
        saved_input_bytes=chain.saved_inputs,
        cpu=[c.cpu for c in measured],
        weight=[c.weight for c in measured] if split_backward else [],
        deferred_bytes=[c.deferred_bytes for c in measured] if split_backward else [],
    )


def _check_sample(sample: Any) -> None:
    """Raise ValueError unless ``sample`` holds at least one tensor and no empty tensor."""
    tensors = [leaf for leaf in leaves(sample) if isinstance(leaf, torch.Tensor)]
    if not tensors or any(t.numel() == 0 for t in tensors):
        raise ValueError(
            "the sample must be a non-empty batch the size of one micro-batch, e.g. "
            f"torch.randn(8, 512); got {_describe(sample)}"
        )


@dataclass(frozen=True)
class _LayerCost:
    forward: float
    backward: float
    output_bytes: int
    parameter_bytes: int
    trainable_bytes: int
    cpu: float
    weight: float
    deferred_bytes: int


@dataclass(frozen=True)
class _Chain:
    saved: list[int]
    inputs: list[int]
    saved_inputs: list[int]


def _attribute(layers: list[nn.Module], sample: Any) -> _Chain:
    """Saved bytes per layer when the layers run as one graph, each storage to its first saver.

    This is how a stage runs in the pipeline, so per-layer numbers add up to the stage's, and
    they follow the runtime's rule (:mod:`gpipe.runtime.saved`).
    """
    # Parameters saved for backward (Linear saves its weight) are not activations.
    own = [t for layer in layers for t in (*layer.parameters(), *layer.buffers())]
    counter = SavedBytes(storage_keys(own))
    saved, inputs, saved_inputs = [], [], []
    value = _fresh(sample)
    # NOTE: every output stays referenced, so no counted storage is freed (a graph cut by an
    # argmax would be) and its address reused by a later tensor that would then go uncounted.
    kept = [value]
    with (
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack),
    ):
        for layer in layers:
            given = [leaf for leaf in leaves(value) if isinstance(leaf, torch.Tensor)]
            before, counted_before = counter.nbytes, [counter.counted(t) for t in given]
            value = layer(value)
            kept.append(value)
            saved.append(counter.nbytes - before)
            inputs.append(gradient_bytes(given))
            # what this layer counted for its own input, which a stage starting here keeps
            # anyway (each storage once)
            newly = {
                next(iter(storage_keys([t])), id(t)): counter.counted(t) - was
                for t, was in zip(given, counted_before)
                if counter.counted(t) > was
            }
            saved_inputs.append(sum(newly.values()))
    return _Chain(saved, inputs, saved_inputs)


def _measure(
    layer: nn.Module, value: Any, device: torch.device, repeats: int, warmup: int, split: bool
) -> tuple[_LayerCost, Any]:
    """One layer's cost on input ``value``, and its output (detached) for the next layer."""
    params = list({id(p): p for p in layer.parameters()}.values())
    inputs = _fresh(value)
    output = layer(inputs)
    output_bytes = sum(
        leaf.numel() * leaf.element_size()
        for leaf in {id(x): x for x in leaves(output) if isinstance(x, torch.Tensor)}.values()
    )
    next_value = map_tensors(torch.Tensor.detach, output)
    del inputs, output

    forward: list[float] = []
    backward: list[float] = []
    input_only: list[float] = []
    cpu: list[float] = []
    for run in range(warmup + repeats):
        inputs = _fresh(value)
        for p in params:
            p.grad = None
        _synchronize(device)
        start_cpu = time.thread_time()
        start = time.perf_counter()
        output = layer(inputs)
        _synchronize(device)
        middle = time.perf_counter()
        roots = [
            leaf for leaf in leaves(output) if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]
        grads = [torch.ones_like(root) for root in roots]
        begin = time.perf_counter()
        if roots:
            torch.autograd.backward(roots, grads)
        _synchronize(device)
        end = time.perf_counter()
        if run >= warmup:
            forward.append(middle - start)
            backward.append(end - begin if roots else 0.0)
            cpu.append(time.thread_time() - start_cpu)
            if split:
                input_only.append(_input_gradient_seconds(layer, value, device))
        del inputs, output, roots, grads
    for p in params:
        p.grad = None

    cost = _LayerCost(
        forward=statistics.median(forward),
        backward=statistics.median(backward),
        output_bytes=output_bytes,
        parameter_bytes=sum(_nbytes(p) for p in params),
        trainable_bytes=sum(_nbytes(p) for p in params if p.requires_grad),
        cpu=statistics.median(cpu),
        weight=max(0.0, statistics.median(backward) - statistics.median(input_only))
        if split
        else 0.0,
        deferred_bytes=_deferred_bytes(layer, value) if split else 0,
    )
    return cost, next_value


def _input_gradient_seconds(layer: nn.Module, value: Any, device: torch.device) -> float:
    """Seconds of the input gradient alone (what a zero-bubble B runs): no weight gradient."""
    inputs = _fresh(value)
    output = layer(inputs)
    roots = [t for t in leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    wanted = [t for t in leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    _synchronize(device)
    start = time.perf_counter()
    if roots and wanted:
        grads = [torch.ones_like(r) for r in roots]
        torch.autograd.grad(roots, wanted, grads, allow_unused=True)
    _synchronize(device)
    return time.perf_counter() - start


def _deferred_bytes(layer: nn.Module, value: Any) -> int:
    """What a zero-bubble B of ``layer`` keeps for its W: the gradients at its forks."""
    inputs = _fresh(value)
    output = layer(inputs)
    roots = [t for t in leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    wanted = [t for t in leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in layer.parameters() if p.requires_grad]
    if not roots or not wanted:
        return 0
    _, later = backward_input([(r, torch.ones_like(r)) for r in roots], wanted, params)
    return gradient_bytes([grads for _, grads, _ in later.parts])


def _fresh(value: Any) -> Any:
    """A new input: leaves that take gradients if floating, cloned off those leaves."""

    def fresh(tensor: torch.Tensor) -> torch.Tensor:
        differentiable = tensor.is_floating_point() or tensor.is_complex()
        leaf = tensor.detach().requires_grad_(differentiable)
        # NOTE: an in-place layer (ReLU(inplace=True)) may not write into a leaf that requires
        # grad, nor into the value every repeat starts from; a clone is neither.
        return leaf.clone()

    return map_tensors(fresh, value)


def _on_device(layer: nn.Module, device: torch.device) -> nn.Module:
    """``layer`` itself if it lives on ``device``, else a copy moved there (never the user's)."""
    tensors = [*layer.parameters(), *layer.buffers()]
    if all(_same_device(t.device, device) for t in tensors):
        return layer
    return copy.deepcopy(layer).to(device)


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    if actual.type != wanted.type:
        return False
    return wanted.index is None or actual.index == wanted.index


@contextmanager
def _preserved(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore ``module``'s train/eval modes, gradients and buffers, and the RNG, on exit."""
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.grad) for p in module.parameters()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    for p, _ in grads:
        p.grad = None
    rng_devices = []
    if device.type == "cuda":
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]
    try:
        with torch.random.fork_rng(devices=rng_devices):
            yield
    finally:
        for m, training in modes:
            m.training = training
        for p, grad in grads:
            p.grad = grad
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _synchronize(device: torch.device) -> None:
    # CUDA runs asynchronously: without this the clock would time the launch, not the work.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor_bytes(tensor)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if len(repr(value)) < 60 else type(value).__name__


def _format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
