"""The caller's side of a step: micro-batches in, and the outputs joined to the caller's graph.

Stage 0 receives each micro-batch cut from the caller's graph (in a dataflow, every stage
that reads the pipe's inputs receives the values it reads); their input gradients are
carried back into the caller's tensors afterwards, summed over the stages that read each
input. For ``pipe(x)``, the last stage's outputs pass through :class:`PipelineBackward`, so
the caller's ``loss.backward()`` runs the pipelined backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from gpipe.runtime.step import Step
from gpipe.runtime.transport import ACTIVATION, GRADIENT
from gpipe.schedule import Schedule
from gpipe.structure import leaves, map_tensors

__all__ = ["PipelineBackward", "backward_into_input", "collect_outputs", "feed", "to_stage"]

Held = Callable[[int], bool]


def to_stage(microbatch: Any) -> Any:
    """What stage 0 receives: the micro-batch cut from the caller's graph."""
    return map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), microbatch)


def feed(step: Step, parts: list[Any], held: Held | None = None) -> None:
    """Hand each micro-batch to the stages that read it (those ``held`` here)."""
    routes = step.stages.routes
    for i, mb in enumerate(parts):
        if routes is None:
            step.transport.send((ACTIVATION, 0, i), to_stage(mb))
        else:
            routes.feed(step.transport, i, mb, to_stage, held)


def collect_outputs(step: Step, count: int) -> list[Any]:
    """The last stage's output of each of ``count`` micro-batches, once the forwards ran."""
    routes = step.stages.routes
    if routes is None:
        end = step.stages.count
        return [step.transport.collect((ACTIVATION, end, i)) for i in range(count)]
    return [step.transport.collect(routes.output_tag(i)) for i in range(count)]


def _input_gradients(step: Step, i: int, microbatch: Any, held: Held | None) -> list[Any]:
    """The gradient of each leaf of micro-batch ``i`` (None: none), as the stages sent it."""
    routes = step.stages.routes
    if routes is None:
        return list(step.transport.collect((GRADIENT, -1, i)))
    return routes.input_gradients(step.transport, i, microbatch, held)


def _input_leaves(microbatch: Any) -> list[torch.Tensor]:
    return [
        leaf for leaf in leaves(microbatch) if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]


def backward_into_input(step: Step, parts: list[Any], held: Held | None = None) -> None:
    """Carry the input gradients on into the caller's tensors (if they want them); an input
    several stages read gets the sum of their gradients."""
    roots, grads = [], []
    for i, mb in enumerate(parts):
        if not _input_leaves(mb):
            continue
        received = _input_gradients(step, i, mb, held)
        for leaf, grad in zip(leaves(mb), received):
            if grad is not None and isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                roots.append(leaf)
                grads.append(grad.to(leaf.device))
    if roots:
        torch.autograd.backward(roots, grads)


class PipelineBackward(torch.autograd.Function):
    """Joins the pipeline to the caller's graph: its backward runs the pipelined backward.

    The forward passes the last stage's outputs through; when autograd reaches it with the
    output gradients, the backward hands them to the last stage, runs every stage's backward
    on its own worker, and returns the gradients of the caller's inputs.
    """

    @staticmethod
    def connect(step: Step, backward: Schedule, parts: list[Any], outputs: list[Any]) -> list[Any]:
        out_flat = [pytree.tree_flatten(out) for out in outputs]
        differentiable = [
            [
                isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
                for leaf in flat
            ]
            for flat, _ in out_flat
        ]
        inputs = [_input_leaves(mb) for mb in parts]
        masks = [
            [isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves(mb)]
            for mb in parts
        ]
        tensors = [t for group in inputs for t in group]
        tensors += [
            leaf.detach()
            for (flat, _), mask in zip(out_flat, differentiable)
            for leaf, keep in zip(flat, mask)
            if keep
        ]
        # NOTE: a phony input that requires grad makes the outputs require grad even when
        # neither the caller's input nor the passed-through outputs do.
        phony = torch.empty(0, requires_grad=True)
        meta = (step, backward, parts, inputs, masks, differentiable)
        results = iter(PipelineBackward.apply(meta, phony, *tensors))
        connected = []
        for (flat, spec), mask in zip(out_flat, differentiable):
            joined = [next(results) if keep else leaf for leaf, keep in zip(flat, mask)]
            connected.append(pytree.tree_unflatten(joined, spec))
        return connected

    @staticmethod
    def forward(ctx: Any, meta: Any, phony: torch.Tensor, *tensors: torch.Tensor) -> Any:
        _, _, _, inputs, _, _ = meta
        ctx.meta = meta
        # NOTE: saved so that autograd itself frees it after a backward without
        # retain_graph: a second backward then fails as it does in plain PyTorch.
        ctx.save_for_backward(phony)
        ctx.set_materialize_grads(False)
        n_inputs = sum(len(group) for group in inputs)
        return tuple(t.view_as(t) for t in tensors[n_inputs:])

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        ctx.saved_tensors  # noqa: B018 -- raises autograd's own error on a second backward
        if torch.is_grad_enabled():  # NOTE: in a backward, grad mode is on iff create_graph
            raise RuntimeError(
                "backward with create_graph=True (a double backward, e.g. a gradient "
                "penalty) does not go through a GPipe: each stage runs its own backward "
                "on its worker, outside your graph, so the gradients would silently not "
                "be differentiable; compute such a term on the plain model"
            )
        step, backward, parts, inputs, masks, differentiable = ctx.meta
        retain = _retains_graph()
        if not retain:
            ctx.meta = None  # free the step's saved state once the backward is done
        step.state.retain_graph = retain
        last, routes = step.stages.last, step.stages.routes
        grads = iter(grad_outputs)
        for i, mask in enumerate(differentiable):
            tag = (GRADIENT, last, i) if routes is None else routes.output_gradient_tag(i)
            step.transport.send(tag, [next(grads) if keep else None for keep in mask])
        step.run(backward.actions)
        input_grads: list[torch.Tensor | None] = []
        for i, (group, mask) in enumerate(zip(inputs, masks)):
            if not group:
                continue
            received = _input_gradients(step, i, parts[i], None)
            chosen = [g for g, wanted in zip(received, mask) if wanted]
            input_grads += [
                None if g is None else g.to(leaf.device) for g, leaf in zip(chosen, group)
            ]
        return (None, None, *input_grads, *([None] * (len(grad_outputs))))


def _retains_graph() -> bool:
    """Whether the running backward keeps the graph for another (``retain_graph=True``).

    NOTE: autograd has no public way to ask; this is the call PyTorch's own compiled
    autograd functions make (torch/_functorch/_aot_autograd). Without it, say yes: keeping
    the stages' state until the graph goes is safe, freeing it too early is not.
    """
    ask = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if ask is None else bool(ask())
