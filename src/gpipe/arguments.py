"""Checks of a pipe's arguments that the local and the distributed pipe share."""

from __future__ import annotations

import numbers
import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = [
    "NOT_A_CHAIN",
    "check_balance_type",
    "check_chunks",
    "check_flag",
    "check_model",
    "check_stages_balance",
    "check_target_size",
    "check_virtual",
    "refuse_keywords",
]


NOT_A_CHAIN = (
    "a model that is not a chain of layers (a residual stream, a transformer, a U-Net) is "
    "cut with gpipe.split(model, split_points=[...], example_inputs=(...)), or balanced "
    "by it with balance='time', num_stages=K"
)
"""What every "needs an nn.Sequential" error adds: the way for a model that is not one."""


def check_model(module: Any, who: str) -> None:
    """Raise unless ``module`` is an ``nn.Sequential`` whose layers the pipe can call."""
    _refuse_compiled_whole(module, who)
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"{who} takes an nn.Sequential or gpipe.Stages, got {type(module).__name__}; "
            f"wrap layers that run one after the other in nn.Sequential(...); {NOT_A_CHAIN}, "
            f"and {who} takes the Stages it returns"
        )


def check_chunks(chunks: Any) -> int:
    """``chunks`` as an int >= 1; an integral float (``8.0``) is taken, as torchgpipe does."""
    if isinstance(chunks, float) and chunks.is_integer():
        chunks = int(chunks)
    if isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral):
        raise TypeError(f"chunks must be an int >= 1 (micro-batches per batch), got {chunks!r}")
    if chunks < 1:
        raise ValueError(f"chunks must be an int >= 1 (micro-batches per batch), got {chunks!r}")
    return int(chunks)


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_virtual(virtual_stages: Any) -> int:
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
        raise TypeError(f"virtual_stages must be an int, got {virtual_stages!r}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    return virtual_stages


def check_balance_type(balance: Any) -> None:
    """Raise TypeError unless ``balance`` is a list of layer counts, a name or None."""
    if balance is None or isinstance(balance, str):
        return
    if not isinstance(balance, Sequence):
        raise TypeError(
            f"balance must be a list of layers per stage ([3, 2, 3]) or one of 'params', "
            f"'time', 'memory', got {balance!r}; for {balance!r} stages, pass "
            f"devices=[...] with {balance!r} entries and leave balance out"
        )


def _refuse_compiled_whole(module: Any, who: str) -> None:
    """A compiled whole model would never be called (the pipe calls its layers): say so."""
    fix = (
        "compile the layers instead: `for layer in model: layer.compile()` (or "
        f"nn.Sequential(*(torch.compile(layer) for layer in layers))), then {who}(model, ...)"
    )
    why = "the pipe calls the model's layers stage by stage, never the compiled whole"
    # NOTE: looked up only if Dynamo is loaded (importing it takes seconds): else nothing is
    # compiled.
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule):
        raise TypeError(f"{who} got torch.compile(model): {why}; {fix}")
    if getattr(module, "_compiled_call_impl", None) is not None:
        raise ValueError(f"{who} got model.compile(): {why}, so nothing would compile; {fix}")


def check_stages_balance(balance: Any, cut: list[int]) -> None:
    """Refuse a ``balance`` other than the one ``gpipe.Stages`` were already cut with."""
    if balance is not None and (isinstance(balance, str) or list(balance) != cut):
        raise ValueError(
            f"balance={balance!r} conflicts with the Stages' own balance {cut}: the stages are "
            "already cut; leave balance out (choose the cuts when splitting, e.g. "
            "gpipe.split(..., balance=...))"
        )


def check_target_size(target_size: int, total: int) -> None:
    """Refuse a target whose batch size is not the input's."""
    if target_size != total:
        raise ValueError(
            f"target has batch size {target_size} but input has {total}; give one target per "
            "sample, or declare where the target is batched with "
            "train_step(..., target_batch_dims=...)"
        )


def refuse_keywords(kwargs: Any) -> None:
    """A pipe over an ``nn.Sequential`` takes one input: refuse keyword inputs."""
    raise TypeError(
        f"a pipe over an nn.Sequential takes one input, got keyword inputs {sorted(kwargs)}: "
        "pass one tensor (or tuple/dict of them), or split the model into gpipe.Stages, which "
        "take named inputs"
    )
