"""The backward actions: B (input gradient, and weight gradients unless split off) and W.

B receives the output gradient (or, on the last stage, starts from the weighted loss),
recomputes the forward if the micro-batch was checkpointed, and sends the input gradient back.
Under a zero-bubble schedule it leaves the weight gradients to W (see
:mod:`gpipe.runtime.split_backward`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from gpipe.batchnorm import recomputing
from gpipe.recompute import checkpointed
from gpipe.runtime.input_writes import cloned
from gpipe.runtime.saved import gradient_bytes
from gpipe.runtime.split_backward import backward_input, backward_weight
from gpipe.runtime.stage_call import call_stage_counted
from gpipe.runtime.state import Saved
from gpipe.runtime.transport import GRADIENT
from gpipe.schedule import Action
from gpipe.structure import leaves

if TYPE_CHECKING:
    from gpipe.runtime.worker import StageWorker

__all__ = ["backward", "receive_gradients", "weight"]

_ENGINE: Any = torch.autograd.Variable._execution_engine


def receive_gradients(worker: StageWorker, action: Action) -> Any:
    """Wait for B(stage, micro-batch)'s output gradient and take it: None on the stage that
    computes the loss (its backward starts from it), a dataflow's messages per reader."""
    stage, mb = action.stage, action.microbatch
    if worker.state.loss is not None and stage == worker._last:
        return None
    if worker.routes is None:
        return worker.transport.recv((GRADIENT, stage, mb))
    return worker.routes.receive_gradients(worker.transport, stage, mb)


_UNTAKEN: Any = object()


def backward(worker: StageWorker, action: Action, received: Any = _UNTAKEN) -> None:
    """Run B(stage, micro-batch) on ``worker``. ``received``: taken already by
    :func:`receive_gradients` (a fused action takes both parts' before it starts)."""
    step, stage, mb = worker.state, action.stage, action.microbatch
    saved = step.saved[stage, mb]
    routes = worker.routes
    if received is _UNTAKEN:
        received = receive_gradients(worker, action)
    grads, messages = received, None
    if routes is not None and received is not None:
        messages = received
        grads = [g for _, message in messages for g in message]
    start = worker._begin()
    recomputed = 0  # bytes the recomputation keeps beyond the stashed input
    if saved.outputs is None:  # re-materialize: same inputs, same random streams
        key = (stage, worker.stages.module(stage).training)
        given, source = saved.inputs, None
        if worker.stages.copies_input.get(key, True):
            with torch.enable_grad():  # NOTE: a backward runs with grad mode off
                given, source = cloned(given), saved.inputs
        restore = worker._autocast_restored  # recompute under the forward's autocast
        with recomputing(), restore() if restore else contextlib.nullcontext():
            output, root, kept = call_stage_counted(worker, stage, mb, given, source)
        saved.outputs = output if root is None else root
        recomputed = kept - saved.nbytes
    if grads is None:
        # NOTE: a micro-batch of loss weight 0 adds nothing: no root, not 0 x its loss,
        # which may be nan (a mean over no tokens) and would poison every gradient
        weightless = step.loss is not None and not step.loss.weights[mb]
        roots: list[tuple[Any, torch.Tensor | None]]
        roots = [] if weightless else [(saved.outputs, None)]
    elif routes is not None:
        assert messages is not None  # received from the readers when not the loss's stage
        roots = routes.roots(saved.outputs, messages)
    else:
        roots = [
            (out, grad)
            for out, grad in zip(leaves(saved.outputs), grads)
            if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad
        ]
    inputs = _grad_leaves(saved.inputs)
    wanted = [leaf for leaf in inputs if leaf is not None]
    if step.split_backward:
        try:
            found, saved.weight = backward_input(roots, wanted, worker._trainable(stage))
        except RuntimeError as error:
            if "donated buffers" not in str(error):
                raise
            # NOTE: the split backward keeps the graph for W, which a compiled
            # backward that reuses ("donates") its saved buffers cannot allow
            raise RuntimeError(
                "a torch.compile'd layer donates its saved buffers to its backward, "
                "which a zero-bubble schedule runs in two parts (B, then W): set "
                "torch._functorch.config.donated_buffer = False before the layers first "
                "run, or use schedule='1f1b'"
            ) from error
    else:
        if roots:
            _run_backward(roots, step.retain_graph)
        found = [leaf.grad for leaf in wanted]
        for leaf in wanted:  # sent on below; a second backward must not add to it
            leaf.grad = None
    if routes is not None:
        routes.send_gradients(
            worker.transport, stage, mb, saved.inputs, dict(zip(map(id, wanted), found))
        )
    elif stage > 0 or wanted:
        found_iter = iter(found)
        worker.transport.send(
            (GRADIENT, stage - 1, mb),
            [None if leaf is None else next(found_iter) for leaf in inputs],
        )
    peak = worker.held + recomputed
    if step.track_memory:
        received, sent = gradient_bytes(grads), gradient_bytes(found)
        peak += received + sent
        if saved.weight is not None:  # W needs the recomputed activations and gradients
            deferred = gradient_bytes([grads for _, grads, _ in saved.weight.parts])
            # NOTE: a stage whose input takes no gradient defers its whole backward,
            # keeping the very gradients it received: counted once.
            peak += deferred if wanted else max(0, deferred - received)
            saved.nbytes += recomputed + deferred
            worker.held += recomputed + deferred
    if not step.split_backward:
        if step.retain_graph:
            _retain(worker, mb, saved)
        else:
            _release(worker, stage, mb)
    worker._record(action, start, peak)


def weight(worker: StageWorker, action: Action) -> None:
    """Run W(stage, micro-batch) on ``worker``: the weight gradients its B left."""
    step, stage, mb = worker.state, action.stage, action.microbatch
    start = worker._begin()
    deferred = step.saved[stage, mb].weight
    if deferred is not None:
        backward_weight(deferred)
    peak = worker.held
    _release(worker, stage, mb)
    worker._record(action, start, peak)


def _run_backward(roots: list[tuple[Any, torch.Tensor | None]], retain_graph: bool) -> None:
    """``torch.autograd.backward`` of ``roots`` (output, its gradient or None for a scalar).

    NOTE: for plain tensors this goes to the autograd engine directly, skipping the Python
    wrapper's per-call work (argument checks, a gradient made for each scalar, a context
    stashed for the engine's device threads, which a worker never uses: it runs its backward
    itself). The engine still checks each gradient against its output (shape, dtype,
    device). Anything else (a tensor subclass, a non-scalar output without a gradient) takes
    the wrapper, which handles and explains it.
    """
    outputs, grads = [], []
    for output, grad in roots:
        if type(output) is not torch.Tensor or not (
            type(grad) is torch.Tensor or (grad is None and output.dim() == 0)
        ):
            torch.autograd.backward(
                [r for r, _ in roots], [g for _, g in roots], retain_graph=retain_graph
            )
            return
        outputs.append(output)
        grads.append(torch.ones_like(output) if grad is None else grad)
    _ENGINE.run_backward(
        tuple(outputs),
        tuple(grads),
        retain_graph,
        False,  # create_graph
        (),  # inputs: every leaf
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _grad_leaves(value: Any) -> list[torch.Tensor | None]:
    """The flattened leaves of ``value``, with None for those that take no gradient."""
    return [
        leaf if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
        for leaf in leaves(value)
    ]


def _release(worker: StageWorker, stage: int, mb: int) -> None:
    """Drop what the micro-batch kept for backward."""
    saved = worker.state.saved.pop((stage, mb))
    worker.held -= saved.nbytes


def _retain(worker: StageWorker, mb: int, saved: Saved) -> None:
    """Keep the micro-batch for another backward (``retain_graph=True``), as it was.

    A checkpointed micro-batch drops its recomputed graph again, so between backwards
    it holds only its input, as before the first.
    """
    if checkpointed(worker.state.checkpoint, mb, worker.state.microbatches):
        saved.outputs = None
