"""Balancing a model by what its layers measure: time, memory, or parameter count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpipe.arguments import NOT_A_CHAIN
from gpipe.balance.exact import balance_costs, balance_weighted
from gpipe.balance.optimizer_state import OptimizerSpec
from gpipe.balance.profiler import profile

__all__ = ["balance_by_memory", "balance_by_params", "balance_by_time"]


def balance_by_time(
    module: nn.Sequential,
    sample: Any,
    stages: int,
    *,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    warmup: int = 2,
) -> list[int]:
    """Layers per stage so every stage takes about the same forward + backward time.

    torchgpipe's argument order, ``balance_by_time(stages, module, sample)``, works too.

    Args:
        module: the model.
        sample: one micro-batch of input.
        stages: how many stages to cut into.
        device: where to time the layers.
        repeats: timed runs per layer (the median is kept).
        warmup: untimed runs before them.

    Returns:
        The balance: layers per stage.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` or ``stages`` not an int.
        ValueError: ``stages`` out of range or an empty sample.
    """
    module, sample, stages = _in_our_order(module, sample, stages)
    _check_stages(module, stages)
    measured = profile(module, sample, device=device, repeats=repeats, warmup=warmup)
    return balance_costs(measured.costs("time"), stages)


def balance_by_memory(
    module: nn.Sequential,
    sample: Any,
    stages: int,
    *,
    optimizer: OptimizerSpec = None,
    kept_microbatches: Sequence[int] | int = 1,
    device: str | torch.device = "cpu",
) -> list[int]:
    """Layers per stage so the stage holding the most memory holds as little as possible.

    A stage holds its parameters, their gradients and optimizer state once, and the
    activations autograd saves for ``kept_microbatches`` micro-batches at once.
    torchgpipe's argument order (its ``balance_by_size(stages, module, sample)``) works too.

    Args:
        module: the model.
        sample: one micro-batch of input.
        stages: how many stages to cut into.
        optimizer: whose state to count, see
            :func:`gpipe.balance.optimizer_state.optimizer_state_factor`.
        kept_microbatches: micro-batches of activations each stage keeps under the schedule:
            one number for all stages, or one per stage (``[M] * K`` for GPipe without
            re-materialization, ``[min(K - k, M) for k in range(K)]`` for 1F1B).
        device: where to run the layers.

    Returns:
        The balance: layers per stage.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` or ``stages`` not an int.
        ValueError: ``stages`` out of range, an empty sample, an unknown optimizer, or
            ``kept_microbatches`` with a negative entry or not one entry per stage.
    """
    module, sample, stages = _in_our_order(module, sample, stages)
    _check_stages(module, stages)
    if isinstance(kept_microbatches, int):
        kept = [kept_microbatches] * stages
    else:
        kept = list(kept_microbatches)
    if len(kept) != stages or any(k < 0 for k in kept):
        raise ValueError(
            f"kept_microbatches must be a count >= 0 or one per stage ({stages}), got "
            f"{kept_microbatches!r}"
        )
    # Only bytes matter here, so one untimed pass is enough.
    measured = profile(module, sample, device=device, repeats=1, warmup=0, optimizer=optimizer)
    fixed = [
        float(p + g + o)
        for p, g, o in zip(
            measured.parameter_bytes, measured.gradient_bytes, measured.optimizer_bytes
        )
    ]
    return balance_weighted(fixed, [float(a) for a in measured.activation_bytes], kept)


def _in_our_order(module: Any, sample: Any, stages: Any) -> tuple[Any, Any, Any]:
    """``(module, sample, stages)``, given in ours or torchgpipe's ``(stages, module, sample)``."""
    if isinstance(module, int) and isinstance(sample, nn.Sequential):
        return sample, stages, module
    return module, sample, stages


def balance_by_params(module: nn.Sequential, stages: int) -> list[int]:
    """Layers per stage so every stage holds about the same number of parameters.

    Parameter-free layers count as one parameter, so they spread rather than pile up.

    Args:
        module: the model.
        stages: how many stages to cut into.

    Returns:
        The balance: layers per stage.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential`` or ``stages`` not an int.
        ValueError: ``stages`` out of range.
    """
    _check_stages(module, stages)
    costs = [max(1, sum(p.numel() for p in layer.parameters())) for layer in module]
    return balance_costs(costs, stages)


def _check_stages(module: nn.Module, stages: int) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"balancing needs an nn.Sequential, got {type(module).__name__}; wrap layers that "
            f"run one after the other: nn.Sequential(*layers); {NOT_A_CHAIN}"
        )
    if not isinstance(stages, int) or isinstance(stages, bool):
        raise TypeError(f"stages must be an int, got {stages!r}")
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if stages > len(module):
        raise ValueError(
            f"cannot cut {len(module)} layers into {stages} stages: use at most "
            f"{len(module)} stages, or a module with more layers"
        )
