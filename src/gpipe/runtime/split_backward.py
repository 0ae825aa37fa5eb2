"""Zero-bubble backward: input gradients now (B), weight gradients later (W), no work twice.

B runs autograd only as far as the stage inputs need. Where the graph forks toward
parameters (a Linear's addmm feeds both its input and its weight), a hook keeps the gradient
arriving at the fork; W later resumes autograd at each fork, asking only for the parameters
below it on branches B skipped. Every node runs once in B or once in W (a fork runs in
both, each time for its own outputs), and the forward is never rerun.

NOTE: resuming all forks in one autograd call would walk from an upper fork down the input
path into lower forks and count their parameters twice; one call per fork, restricted to
that fork's own parameters, cannot. Where two forks reach one parameter (weights tied inside
a stage), W falls back to a full backward over the retained graph: still exact, not free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightGradient", "backward_input", "backward_weight"]

Roots = Sequence[tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class WeightGradient:
    """What W needs: per resume point, the gradient there and the parameters below it."""

    parts: list[tuple[list[Any], list[torch.Tensor | None], list[torch.Tensor]]] = field(
        default_factory=list
    )


def _reachability(
    roots: list[Any], inputs: set[Any], params: set[Any]
) -> dict[Any, tuple[bool, bool]]:
    """For every node below ``roots``: (reaches an input, reaches a parameter)."""
    reach: dict[Any, tuple[bool, bool]] = {}
    stack = [(node, False) for node in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            children = [reach[c] for c, _ in node.next_functions if c is not None]
            reach[node] = (
                node in inputs or any(i for i, _ in children),
                node in params or any(p for _, p in children),
            )
        elif node not in reach:
            reach[node] = (node in inputs, node in params)  # provisional: marks it seen
            stack.append((node, True))
            stack.extend(
                (child, False)
                for child, _ in node.next_functions
                if child is not None and child not in reach
            )
    return reach


def _params_below(nodes: list[Any], params: dict[Any, torch.Tensor]) -> list[torch.Tensor]:
    """The parameters whose accumulator lies below ``nodes`` (a parameters-only subgraph)."""
    seen: set[Any] = set()
    found: list[torch.Tensor] = []
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in params:
            found.append(params[node])
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return found


def backward_input(
    roots: Roots, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor | None], WeightGradient]:
    """B: the gradients of ``inputs``, and what :func:`backward_weight` needs later.

    Args:
        roots: (output, gradient) pairs to differentiate from; gradient None for a scalar loss.
        inputs: the stage inputs that need gradients.
        params: the parameters whose gradients W will accumulate.
    """
    later = WeightGradient()
    everything = ([r for r, _ in roots], [g for _, g in roots], list(params))
    if not inputs or not params:  # nothing to split: one side has all the work
        if params:
            later.parts.append(everything)
        return _input_grads(roots, inputs), later
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    param_nodes = {get_gradient_edge(p).node: p for p in params}
    reach = _reachability(
        [r.grad_fn for r, _ in roots if r.grad_fn is not None], input_nodes, set(param_nodes)
    )
    forks: dict[Any, list[torch.Tensor]] = {}
    for node, (to_input, to_param) in reach.items():
        if not (to_input and to_param):
            continue
        branches = [
            child
            for child, _ in node.next_functions
            if child is not None and reach[child] == (False, True)
        ]
        if branches:
            forks[node] = _params_below(branches, param_nodes)
    owned = [id(p) for below in forks.values() for p in below]
    if len(owned) != len(set(owned)):  # tied weights: see the module note
        later.parts.append(everything)
        return _input_grads(roots, inputs), later
    for root, grad in roots:  # an output fed by parameters alone goes to W whole
        if root.grad_fn is not None and reach[root.grad_fn] == (False, True):
            later.parts.append(([root], [grad], _params_below([root.grad_fn], param_nodes)))

    arrived: dict[Any, tuple[torch.Tensor | None, ...]] = {}

    def keep(node: Any) -> Any:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            arrived[node] = grad_outputs

        return hook

    handles = [node.register_prehook(keep(node)) for node in forks]
    try:
        found = _input_grads(roots, inputs)
    finally:
        for handle in handles:
            handle.remove()
    for node, below in forks.items():
        grads = arrived.get(node, ())
        edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        if edges:
            later.parts.append((edges, [g for g in grads if g is not None], below))
    return found, later


def _input_grads(roots: Roots, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    if not inputs or not roots:
        return [None] * len(inputs)
    return list(
        torch.autograd.grad(
            [r for r, _ in roots],
            list(inputs),
            [g for _, g in roots],
            retain_graph=True,
            allow_unused=True,
        )
    )


def backward_weight(later: WeightGradient) -> None:
    """W: accumulate the parameters' gradients from where B left off."""
    for outputs, grads, params in later.parts:
        if outputs and params:
            torch.autograd.backward(outputs, grads, inputs=params, retain_graph=True)
