"""The forward action (F): receive the stage input, run the stage, keep what backward needs,
send the output on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gpipe.recompute import checkpointed
from gpipe.runtime.input_writes import cloned, learn_writes, versions
from gpipe.runtime.saved import kept_bytes
from gpipe.runtime.stage_call import call_stage, call_stage_counted
from gpipe.runtime.state import Saved
from gpipe.runtime.transport import ACTIVATION
from gpipe.schedule import Action
from gpipe.structure import map_tensors

if TYPE_CHECKING:
    from gpipe.runtime.worker import StageWorker

__all__ = ["forward", "receive_inputs"]


def receive_inputs(worker: StageWorker, action: Action) -> Any:
    """Wait for F(stage, micro-batch)'s input and take it."""
    if worker.routes is None:
        return worker.transport.recv((ACTIVATION, action.stage, action.microbatch))
    return worker.routes.receive(worker.transport, action.stage, action.microbatch)


_UNTAKEN: Any = object()


def forward(worker: StageWorker, action: Action, inputs: Any = _UNTAKEN) -> None:
    """Run F(stage, micro-batch) on ``worker``: without autograd when the micro-batch is
    checkpointed (keeping only its input), on a copy of the input when the stage writes
    into it (see :mod:`gpipe.runtime.input_writes`). ``inputs``: taken already by
    :func:`receive_inputs` (a fused action takes both parts' before it starts)."""
    step, stage, mb = worker.state, action.stage, action.microbatch
    routes = worker.routes
    if inputs is _UNTAKEN:
        inputs = receive_inputs(worker, action)
    start = worker._begin()
    inputs = _as_leaves(inputs)
    key = (stage, worker.stages.module(stage).training)
    copies_input = worker.stages.copies_input
    writes = copies_input.get(key)
    # A copy while it is not known whether the stage writes (its first forward in this
    # mode), and for a writer whose input is held elsewhere too: the input kept for backward
    # (under autograd), the caller's batch (stage 0), a dataflow's value (several readers).
    copied = writes is None or (writes and (step.grad or stage == 0 or routes is not None))
    given = inputs
    if copied:
        with torch.set_grad_enabled(step.grad):  # the copy joins the graph to the input
            given = cloned(inputs)
    before = versions(given)
    source = inputs if copied else None
    if not step.grad:
        with torch.no_grad():
            output, _ = call_stage(worker, stage, mb, given, source)
        learn_writes(copies_input, key, before, given, copied, harmless=True)
        if routes is None:
            worker.transport.send((ACTIVATION, stage + 1, mb), output)
        else:
            routes.send(worker.transport, stage, mb, output, None)
        worker._record(action, start)
        return
    if checkpointed(step.checkpoint, mb, step.microbatches):
        with torch.no_grad():
            output, root = call_stage(worker, stage, mb, given, source)
        kept = kept_bytes(inputs) if step.track_memory else 0
        saved = Saved(inputs, None, kept)
    else:
        output, root, kept = call_stage_counted(worker, stage, mb, given, source)
        saved = Saved(inputs, output if root is None else root, kept)
    learn_writes(copies_input, key, before, given, copied, harmless=False)
    step.saved[stage, mb] = saved
    worker.held += saved.nbytes
    if routes is not None:
        if root is None:
            routes.send(worker.transport, stage, mb, output, _for_next_stage)
        elif stage != routes.last:
            routes.check_output(stage, output)
    elif root is None:
        worker.transport.send((ACTIVATION, stage + 1, mb), _for_next_stage(output))
    worker._record(action, start)


def _as_leaves(value: Any) -> Any:
    """Cut ``value``'s tensors from any graph, keeping whether they need a gradient.

    A tensor that already is a leaf stays as it is. NOTE: a message is a leaf made for its
    receiver alone (``to_stage``, ``_for_next_stage``; without autograd, the sender's output,
    which the sender does not keep) unless the transport moved it to another device;
    detaching it again would cost a detach and a freed tensor, both calls that release the GIL.
    """
    return map_tensors(
        lambda t: t if t.is_leaf else t.detach().requires_grad_(t.requires_grad), value
    )


def _for_next_stage(value: Any) -> Any:
    """Detach outputs for the next stage; floating tensors there need gradients."""
    # NOTE: the dtype's flags, not t.is_floating_point(): that call releases the GIL, and each
    # release lets another worker's thread wake up for nothing.
    return map_tensors(
        lambda t: t.detach().requires_grad_(t.dtype.is_floating_point or t.dtype.is_complex),
        value,
    )
