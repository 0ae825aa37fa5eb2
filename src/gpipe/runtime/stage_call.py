"""Calling a stage: each layer on its own random stream, redone until every layer drew on it.

A forward (and a recomputation, which must draw the same masks) calls the stage module, and on
the last stage of a train_step the loss, each layer and the loss in the scope of its own
(layer, micro-batch) random stream (see :mod:`gpipe.randomness`). A layer that drew off its
stream (it began to draw, or its draws bypass routing) is caught after the call, and the call is
redone on the streams before anything leaves it. Under autograd, the call also counts the bytes
it keeps for backward (see :mod:`gpipe.runtime.saved`), once per input shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gpipe.batchnorm import recomputing
from gpipe.randomness import LOSS_KEY
from gpipe.runtime.input_writes import cloned
from gpipe.runtime.saved import SavedBytes
from gpipe.structure import leaves

if TYPE_CHECKING:
    from gpipe.runtime.worker import StageWorker

__all__ = ["call_stage", "call_stage_counted"]


def call_stage(
    worker: StageWorker, stage: int, mb: int, inputs: Any, source: Any = None
) -> tuple[Any, torch.Tensor | None]:
    """The stage's forward, and on the last stage of train_step the weighted loss.

    If a layer drew off its stream, the forward is redone on a fresh copy of ``source`` if
    ``inputs`` is a copy of it (the first attempt may have written into it), and the worker
    is marked as having redone it (``worker._redone``).
    """
    step = worker.state
    module: Any = worker.stages.module(stage)
    keys, layered = worker.stages.keys[stage]
    loss = step.loss if stage == worker._last else None
    streams = worker.stages.streams.forward(
        [*keys, *([LOSS_KEY] if loss is not None else [])],
        device=worker.device,
        training=module.training,
        step_seed=step.seed,
        microbatch=mb + step.microbatch_offset,
        stage=stage,
        watched=worker._watched,
    )
    worker._watched = None  # until this forward settles

    def call(given: Any) -> tuple[Any, torch.Tensor | None]:
        if layered:
            scope = streams.layer_scope
            # NOTE: nn.Module.__setattr__ is slow: the attribute is set only when needed
            if scope is None:  # every layer runs as it is: the common case
                output = module(given)
            else:
                module.layer_scope = scope
                try:
                    output = module(given)
                finally:
                    module.layer_scope = None
        else:  # NOTE: a dataflow's stage module draws from one stream as a whole
            with streams.scope(keys[0]):
                output = module(given)
        if loss is None:
            return output, None
        with streams.scope(LOSS_KEY):
            value = loss.fn(output, loss.targets[mb])
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"loss_fn must return a tensor (the scalar to differentiate), got "
                f"{type(value).__name__} {value!r}: return the loss itself, not "
                "float(loss) or loss.item()"
            )
        if value.numel() != 1:
            raise ValueError(
                f"loss_fn must return a scalar, got a tensor of shape {tuple(value.shape)}: "
                "reduce it over the micro-batch (reduction='mean' or 'sum' in torch's loss "
                "functions, not 'none'), or return value.mean()"
            )
        step.losses[mb] = value.detach()
        return output, value * loss.weights[mb]

    streams.attempt()
    result = call(inputs)
    while not streams.settled():
        worker._redone = True
        streams.attempt()
        with recomputing():  # NOTE: batch statistics count once
            result = call(inputs if source is None else cloned(source))
    worker._watched = streams.watched
    return result


def call_stage_counted(
    worker: StageWorker, stage: int, mb: int, inputs: Any, source: Any = None
) -> tuple[Any, Any, int]:
    """:func:`call_stage` under autograd, and the bytes it keeps for backward (0 untracked).

    The bytes are counted exactly, by a hook on every tensor autograd saves, the first
    time a stage sees inputs of a given shape (and mode); later forwards with the same
    shapes reuse the count. NOTE: the hook is a Python call per saved tensor, too dear to
    run on every micro-batch. A model whose saved tensors change with the data itself (not
    its shape) is counted by its first micro-batch.
    """
    step = worker.state
    known: int | None = 0
    if step.track_memory:
        module = worker.stages.module(stage)
        target = _shapes(_target(worker, stage, mb))
        autocast = worker._autocast_key
        key = (stage, module.training, _shapes(inputs), target, *autocast)
        known = worker.stages.saved_bytes.get(key)
    if known is not None:
        worker._redone = False
        with torch.enable_grad():
            output, root = call_stage(worker, stage, mb, inputs, source)
        if worker._redone and step.track_memory:  # a layer began to draw: count afresh
            del worker.stages.saved_bytes[key]
        return output, root, known
    counter = SavedBytes(worker._param_storages(stage), borrowed=_target(worker, stage, mb))
    counter.keep(inputs)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(*counter.hooks()):
        worker._redone = False
        output, root = call_stage(worker, stage, mb, inputs, source)
    if not worker._redone:  # a redone forward counted its first attempt too
        worker.stages.saved_bytes[key] = counter.nbytes
    return output, root, counter.nbytes


def _target(worker: StageWorker, stage: int, mb: int) -> Any:
    """The loss target of micro-batch ``mb`` if ``stage`` computes the loss, else None."""
    loss = worker.state.loss
    if loss is None or stage != worker._last:
        return None
    return loss.targets[mb]


def _shapes(value: Any) -> tuple[Any, ...]:
    """What the bytes a forward saves depend on: each tensor's shape, dtype and grad flag."""
    if isinstance(value, torch.Tensor):  # NOTE: the common case, twice per forward
        return ((value.shape, value.dtype, value.requires_grad),)
    return tuple(
        (tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
        if isinstance(leaf, torch.Tensor)
        else leaf
        if isinstance(leaf, (int, float, bool, str, type(None)))
        else type(leaf)
        for leaf in leaves(value)
    )
