"""Deferred batch norm: running statistics as if the whole mini-batch went through at once.

A BatchNorm layer in a pipeline sees one micro-batch at a time, so its running mean and
variance would be updated M times per step, each from a fraction of the batch. The deferred
version normalizes each micro-batch by its own statistics (as BatchNorm always does in
training) but only adds the micro-batch's sums up; the pipe commits them once per step, so
the running statistics equal those of plain training on the whole mini-batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "DeferredBatchNorm",
    "committing",
    "convert_deferred_batch_norm",
    "recomputing",
    "refuse_reused_batch_norm",
]

_state = threading.local()


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the forwards run in this thread as re-materialization (they count nothing)."""
    before = getattr(_state, "recomputing", False)
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = before


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose running statistics are committed once per mini-batch."""

    sum: torch.Tensor
    sum_squares: torch.Tensor

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        like = next((t for t in (self.running_mean, self.weight) if t is not None), None)
        zeros = torch.zeros(
            self.num_features,
            dtype=like.dtype if like is not None else None,
            device=like.device if like is not None else None,
        )
        self.register_buffer("sum", zeros, persistent=False)
        self.register_buffer("sum_squares", zeros.clone(), persistent=False)
        self.counted = 0

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"expected at least 2D input (batch, channels, ...), got {input.dim()}D"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or not self.track_running_stats:
            return super().forward(input)
        if not getattr(_state, "recomputing", False):
            with torch.no_grad():
                dims = [d for d in range(input.dim()) if d != 1]
                values = input.detach().to(self.sum.dtype)
                self.sum += values.sum(dims)
                self.sum_squares += (values * values).sum(dims)
                self.counted += input.numel() // input.shape[1]
        return F.batch_norm(
            input, None, None, self.weight, self.bias, training=True, momentum=0.0, eps=self.eps
        )

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the sums of this step's micro-batches into the running statistics."""
        if self.counted == 0:
            return
        mean = self.sum / self.counted
        variance = self.sum_squares / self.counted - mean * mean
        if self.counted > 1:
            variance *= self.counted / (self.counted - 1)  # unbiased, as BatchNorm keeps it
        running_mean, running_var = self.running_mean, self.running_var
        tracked = self.num_batches_tracked
        assert running_mean is not None and running_var is not None and tracked is not None
        tracked += 1
        # momentum None means a cumulative moving average, as in BatchNorm
        momentum = self.momentum
        factor = 1.0 / float(tracked) if momentum is None else momentum
        running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        running_var.mul_(1 - factor).add_(variance, alpha=factor)
        self.discard()

    @torch.no_grad()
    def discard(self) -> None:
        """Drop the sums added since the last commit (a failed step must count for nothing)."""
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counted = 0


@contextmanager
def committing(layers: Sequence[DeferredBatchNorm]) -> Iterator[None]:
    """Run one step's forwards inside: their statistics are folded in once, if it succeeds.

    Sums left from forwards outside a step count for nothing, and a step that raises leaves
    the running statistics as they were.
    """
    for layer in layers:
        layer.discard()
    try:
        yield
    except BaseException:
        for layer in layers:
            layer.discard()
        raise
    for layer in layers:
        layer.commit()


def refuse_reused_batch_norm(module: nn.Module) -> None:
    """Refuse a BatchNorm layer object the model uses at more than one place.

    Plain training updates such a layer's running statistics once per use; a deferred one
    would fold every use into one update per step, and converting it would replace only its
    first use. Each use needs its own layer.

    Raises:
        ValueError: a BatchNorm is used twice; the message names its positions.
    """
    uses: dict[int, list[str]] = {}
    norms: dict[int, nn.Module] = {}

    def walk(parent: nn.Module, prefix: str) -> None:
        for name, child in parent._modules.items():
            if child is None:
                continue
            path = f"{prefix}{name}"
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                uses.setdefault(id(child), []).append(path)
                norms[id(child)] = child
            walk(child, path + ".")

    walk(module, "")
    for key, paths in uses.items():
        if len(paths) > 1:
            raise ValueError(
                f"the {type(norms[key]).__name__} at positions {' and '.join(paths)} is one "
                "layer used twice: plain training updates its running statistics once per "
                "use, deferred_batch_norm once per step, so they would differ; give each use "
                "its own BatchNorm"
            )


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """``module`` with every BatchNorm layer (1d/2d/3d) replaced by a DeferredBatchNorm.

    The replacements take over the layers' parameters and buffers; other layers are kept.
    Returns the new top-level module if ``module`` itself is a BatchNorm layer.
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, DeferredBatchNorm
    ):
        deferred = DeferredBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            device=module.running_mean.device if module.running_mean is not None else None,
            dtype=module.running_mean.dtype if module.running_mean is not None else None,
        )
        if module.affine:
            deferred.weight = module.weight
            deferred.bias = module.bias
        if module.track_running_stats:
            deferred.running_mean = module.running_mean
            deferred.running_var = module.running_var
            deferred.num_batches_tracked = module.num_batches_tracked
        deferred.train(module.training)
        return deferred
    for name, child in module.named_children():
        converted = convert_deferred_batch_norm(child)
        if converted is not child:
            setattr(module, name, converted)
    return module
