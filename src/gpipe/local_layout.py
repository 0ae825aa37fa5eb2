"""Where a local pipe's stages go: its devices resolved, its balance found or checked, and
its stage tensors refused where they cannot be, or are no longer, on their devices.

:class:`~gpipe.GPipe` runs every stage in one process; this is the part of building it
that decides the layout, apart from running it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe.arguments import check_stages_balance
from gpipe.balance import balance_by_memory, balance_by_params, balance_by_time
from gpipe.dataflow import Stages
from gpipe.microbatch import BatchDims, scatter
from gpipe.partition import check_balance
from gpipe.runtime.devices import as_devices
from gpipe.runtime.stage_set import StageSet

__all__ = [
    "Device",
    "DeviceCountError",
    "check_device_count",
    "check_placement",
    "find_balance",
    "fit_devices",
    "given_devices",
    "refuse_meta",
    "stages_layout",
]

Device = torch.device | str | int


class DeviceCountError(ValueError, IndexError):
    """``balance`` and ``devices`` disagree, most often fewer devices than stages: a
    ValueError, and an IndexError as torchgpipe raises for too few devices."""


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _default_stage_count(module: nn.Sequential) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(1, min(len(module), gpus or 2))


def _empty_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 0


def given_devices(
    module: nn.Sequential,
    balance: Sequence[int] | str | None,
    devices: Sequence[Device] | None,
    virtual_stages: int,
) -> tuple[Sequence[int] | str | None, list[torch.device]]:
    """The devices of a pipe over ``module`` before its balance is known: as given, else
    "cpu" for each stage ``balance`` lists, else one per GPU, else 2.

    Returns ``balance`` too, which is ``[]`` for torchgpipe's empty pipe (no layer, no
    stage, no device: the identity).
    """
    if len(module) == 0 and (balance is None or _empty_list(balance)):
        return [], []
    if devices is None:
        count = None
        if balance is not None and not isinstance(balance, str):
            count = len(balance) // virtual_stages
        devices = ["cpu"] * (count or _default_stage_count(module))
    return balance, as_devices(devices)


def fit_devices(
    module: nn.Sequential,
    balance: Sequence[int],
    devices: list[torch.device],
    virtual_stages: int,
) -> tuple[list[int], list[torch.device]]:
    """``balance`` checked against ``module``, and the devices its stages use.

    Raises:
        DeviceCountError: the balance lists another number of stages than the devices hold.
        ValueError: a balance that does not fit ``module``.
    """
    checked = check_balance(module, balance)
    used = devices[: math.ceil(len(checked) / virtual_stages)]  # extras unused
    check_device_count(len(checked), len(used), virtual_stages)
    return checked, used


def check_device_count(stages: int, devices: int, virtual_stages: int, what: str = "") -> None:
    """Refuse ``stages`` that ``devices`` x ``virtual_stages`` do not hold one each.

    Raises:
        DeviceCountError: they differ.
    """
    held = devices * virtual_stages
    if stages == held:
        return
    listed = what or f"balance lists {_plural(stages, 'stage')}"
    raise DeviceCountError(
        f"{listed} but devices lists {_plural(devices, 'device')} (x {virtual_stages} "
        f"virtual stages = {held}): give one device per {virtual_stages} stage(s)"
        + ("" if what else ", or one balance entry per stage")
    )


def find_balance(
    module: nn.Sequential,
    how: str,
    stages: int,
    *,
    sample: Any,
    optimizer: Any,
    chunks: int,
    batch_dims: BatchDims,
    kept: Callable[[], list[int]],
) -> list[int]:
    """A balance of ``module`` over ``stages`` by ``how``: "params", "time" or "memory".

    ``kept()`` gives the micro-batches each stage keeps under the pipe's schedule (for
    "memory").

    Raises:
        ValueError: more stages than layers, an unknown ``how``, or no ``sample`` to measure.
    """
    if stages > len(module):
        raise ValueError(
            f"more stages ({stages}) than layers ({len(module)}): use at most {len(module)} devices"
        )
    if how == "params":
        return balance_by_params(module, stages)
    if how not in ("time", "memory"):
        raise ValueError(
            "balance must be a list of layers per stage or one of 'params', 'time', "
            f"'memory'; got {how!r}"
        )
    if sample is None:
        raise ValueError(f"balance={how!r} measures the model: pass sample=<a mini-batch> as well")
    microbatch = scatter(sample, chunks, batch_dims)[0]
    if how == "time":
        return balance_by_time(module, microbatch, stages)
    return balance_by_memory(
        module, microbatch, stages, optimizer=optimizer, kept_microbatches=kept()
    )


def stages_layout(
    stages: Stages,
    balance: Sequence[int] | str | None,
    devices: Sequence[Device] | None,
    virtual_stages: int,
) -> tuple[list[int], list[torch.device]]:
    """The balance and devices of a pipe over ``stages``: theirs, unless devices are given.

    Raises:
        ValueError: no stage, a ``balance`` other than theirs, or a stage count that
            ``virtual_stages`` does not divide.
        DeviceCountError: fewer devices than the stages need.
    """
    count, v = len(stages), virtual_stages
    if count == 0:
        raise ValueError("the Stages hold no stage: split the model into at least one")
    check_stages_balance(balance, stages.balance)
    if count % v:
        raise ValueError(
            f"{count} stages cannot be spread over devices with virtual_stages={v}: "
            f"the stage count must be a multiple of {v}"
        )
    if devices is None:
        devices = stages.devices if stages.devices is not None else ["cpu"] * (count // v)
    resolved = as_devices(devices)[: count // v]  # extras unused
    check_device_count(count, len(resolved), v, what=f"the Stages hold {count} stages")
    return list(stages.balance), resolved


def refuse_meta(model: nn.Module) -> None:
    """A local pipe moves the model's own tensors: ones on meta hold no values to move."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise ValueError(
                f"{name!r} is on the meta device (the model was built under "
                "torch.device('meta')): GPipe moves the model's own values and these have "
                "none. Build it on a real device, or call model.to_empty(device='cpu') and "
                "initialize it first; gpipe.distributed.DistributedGPipe takes a meta model "
                "and materializes only each rank's own layers"
            )


def check_placement(partitions: Iterable[nn.Module], stages: StageSet) -> None:
    """Refuse a step whose stage tensors were moved off the devices the pipe put them on.

    Raises:
        ValueError: a parameter or buffer is not on its stage's device.
    """
    tied = stages.tied
    for stage, partition in enumerate(partitions):
        device = stages.device_of(stage)
        for name, tensor in [*partition.named_parameters(), *partition.named_buffers()]:
            if tied is not None:  # what the stage reads: a tied Parameter's copy
                tensor = tied.read_by(stage, tensor)
            if tensor.device != device and not (
                device.type == tensor.device.type and device.index is None
            ):
                raise ValueError(
                    f"{name!r} of stage {stage} is on {tensor.device} but the stage runs "
                    f"on {device}: the pipe owns device placement, so don't move its "
                    "layers after wrapping; pass devices=[...] to GPipe instead"
                )
