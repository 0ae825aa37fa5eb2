"""Layers of known latency: they sleep like an accelerator kernel runs, releasing the GIL."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

__all__ = ["SleepLayer", "delay", "sleep_stages"]


class _Delay(torch.autograd.Function):
    """Identity that sleeps ``forward`` seconds on the way in, ``backward`` on the way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: float, backward: float) -> torch.Tensor:
        ctx.backward = backward
        if forward:
            time.sleep(forward)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.backward:
            time.sleep(ctx.backward)
        return grad, None, None


def delay(x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
    """``x`` unchanged, after sleeping ``forward_s``; its gradient sleeps ``backward_s``.

    The building block of latency layers: time that passes like an accelerator kernel's,
    releasing the GIL, without using the CPU.
    """
    return _Delay.apply(x, forward_s, backward_s)


class SleepLayer(nn.Module):
    """A stage of known latency: forward F ms, input gradient B ms, weight gradient W ms.

    The input and weight gradients sit on separate branches of the graph, so a schedule that
    splits them (zero-bubble) pays B and W separately, and one that does not pays B + W.
    When the input needs no gradient (the first stage), B moves onto the weight branch, so
    every stage's backward costs B + W and the ideal step time is the textbook one.
    Sleeping releases the GIL, as real kernels do, so stages overlap even on one core.
    """

    def __init__(self, forward_ms: float, backward_ms: float, weight_ms: float = 0.0) -> None:
        super().__init__()
        self.forward_s = forward_ms / 1000
        self.backward_s = backward_ms / 1000
        self.weight_s = weight_ms / 1000
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        needs_grad = x.requires_grad and torch.is_grad_enabled()
        delayed = delay(x, self.forward_s, self.backward_s if needs_grad else 0.0)
        weight_s = self.weight_s + (0.0 if needs_grad else self.backward_s)
        return delayed + delay(self.weight, 0.0, weight_s)


def sleep_stages(
    stages: int, forward_ms: float, backward_ms: float, weight_ms: float = 0.0
) -> nn.Sequential:
    """``stages`` :class:`SleepLayer` s in an nn.Sequential, one per stage."""
    return nn.Sequential(*[SleepLayer(forward_ms, backward_ms, weight_ms) for _ in range(stages)])
