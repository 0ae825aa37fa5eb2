"""The checks on :func:`gpipe.plan`'s arguments, each error naming the value that fixes it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from gpipe.arguments import NOT_A_CHAIN
from gpipe.dataflow import Stages
from gpipe.recompute import check_checkpoint
from gpipe.schedule import SCHEDULES
from gpipe.units import parse_bytes

__all__ = [
    "check_action_overhead",
    "check_int",
    "check_loss_target",
    "check_plan_arguments",
    "check_verify",
    "checkpoint_modes",
    "chunk_counts",
    "memory_budget",
]


def check_plan_arguments(
    module: nn.Module,
    batch_size: int,
    top: int,
    dp: int,
    zero: bool,
    allreduce_bandwidth: float | None,
    headroom: float,
) -> None:
    """Raise TypeError or ValueError unless the model, counts and factors can be planned."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"plan needs the model, an nn.Module, got {type(module).__name__}: an "
            f"nn.Sequential, gpipe.Stages, or any module gpipe.split can trace"
        )
    wrap = f"wrap layers that run one after the other: nn.Sequential(*layers); {NOT_A_CHAIN}"
    if isinstance(module, (nn.Sequential, Stages)):
        if len(module) == 0:
            raise ValueError("plan needs a module with at least one layer, got an empty one")
    elif isinstance(module, nn.ModuleList):
        raise TypeError(f"plan got an nn.ModuleList, which has no forward; {wrap}")
    elif not any(module.children()):
        raise TypeError(
            f"plan got one layer, {type(module).__name__}, with nothing to cut between; {wrap}"
        )
    check_int("batch_size", batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (samples per mini-batch), got {batch_size}")
    check_int("top", top)
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    check_int("dp", dp)
    if dp < 1 or batch_size % dp:
        raise ValueError(
            f"dp={dp} must be >= 1 and divide batch_size={batch_size} (each replica takes "
            f"batch_size / dp samples); pick a batch size that is a multiple of {max(dp, 1)}"
        )
    if not isinstance(zero, bool):
        raise TypeError(f"zero must be True or False, got {zero!r}")
    if allreduce_bandwidth is not None and not allreduce_bandwidth > 0:
        raise ValueError(
            f"allreduce_bandwidth must be > 0 bytes per second, got {allreduce_bandwidth!r}"
        )
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)):
        raise TypeError(f"headroom must be a number, got {headroom!r}")
    if not 1.0 <= headroom < math.inf:
        raise ValueError(
            f"headroom must be a finite factor >= 1 on the predicted peaks, got {headroom!r}: "
            "take it from report.best.calibrate(pipe) after a real step"
        )


def memory_budget(value: int | str) -> int:
    """``memory_per_device`` in bytes, from a byte count or text like ``"200MB"``."""
    size = parse_bytes(value) if isinstance(value, str) else value
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(
            f"memory_per_device must be a positive byte count or text like '200MB', got {value!r}"
        )
    return size


def checkpoint_modes(schedules: Sequence[str], checkpoints: Sequence[str]) -> list[str]:
    """The checkpoint modes to plan, once every schedule name is known to exist."""
    for name in schedules:
        if name not in SCHEDULES:
            raise ValueError(f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}")
    modes = [check_checkpoint(mode) for mode in checkpoints]
    if not schedules or not modes:
        raise ValueError("give at least one schedule and one checkpoint mode")
    return modes


def chunk_counts(batch_size: int, chunks: Sequence[int] | None) -> list[int]:
    """The chunk counts to plan, ascending: ``chunks``, or every divisor of ``batch_size``."""
    if chunks is None:
        return [m for m in range(1, batch_size + 1) if batch_size % m == 0]
    counts = sorted(set(chunks))
    if not counts or any(isinstance(m, bool) or not isinstance(m, int) for m in counts):
        raise TypeError(f"chunks must list ints, got {chunks!r}")
    if counts[0] < 1 or counts[-1] > batch_size:
        raise ValueError(f"chunks must be between 1 and batch_size={batch_size}, got {chunks!r}")
    return counts


def check_loss_target(loss_fn: Callable[[Any, Any], Any] | None, target: Any) -> None:
    """Raise ValueError for a ``loss_fn`` with no example targets to profile it on."""
    if loss_fn is not None and target is None:
        raise ValueError("loss_fn needs example targets: pass target=<targets like sample's>")


def check_action_overhead(action_overhead: float | None) -> None:
    """Raise ValueError unless ``action_overhead`` is None (measure it) or seconds >= 0."""
    if action_overhead is not None and not action_overhead >= 0:
        raise ValueError(f"action_overhead must be >= 0 seconds, got {action_overhead!r}")


def check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")


def check_verify(
    verify: bool,
    top: int,
    steps: int,
    calibration: object,
    action_overhead: float | None,
    headroom: float,
) -> None:
    """Raise TypeError or ValueError unless the verification and calibration arguments fit."""
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {verify!r}")
    check_int("verify_top", top)
    check_int("verify_steps", steps)
    if top < 1 or steps < 1:
        raise ValueError(
            f"verify_top and verify_steps must be >= 1, got {top} and {steps}: verification "
            "runs at least one plan for at least one timed step"
        )
    if calibration is None:
        return
    from gpipe.planning.verify import Calibration

    if not isinstance(calibration, Calibration):
        raise TypeError(
            "calibration must be report.calibration of a plan(..., verify=True), got "
            f"{type(calibration).__name__}"
        )
    if action_overhead is not None or headroom != 1.0:
        raise ValueError(
            "calibration already holds the per-action cost and the memory headroom: pass "
            f"it alone, without action_overhead={action_overhead!r} or headroom={headroom!r}"
        )


def check_engine(data_parallel: object, zero: bool) -> None:
    """Refuse a data-parallel engine ``DistributedGPipe`` does not have, or ZeRO under FSDP.

    Raises:
        TypeError, ValueError: as ``DistributedGPipe`` would, naming the choices.
    """
    from gpipe.distributed.data_parallel import ENGINES

    if not isinstance(data_parallel, str):
        raise TypeError(f"data_parallel must be one of {ENGINES}, got {data_parallel!r}")
    if data_parallel not in ENGINES:
        raise ValueError(f"data_parallel must be one of {ENGINES}, got {data_parallel!r}")
    if zero and data_parallel != "replicate":
        raise ValueError(
            f"zero=True with data_parallel={data_parallel!r}: ZeRO is the 'replicate' engine's "
            "(FSDP shards the optimizer state itself): drop zero, or plan 'replicate'"
        )
