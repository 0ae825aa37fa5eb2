"""StageSet: the stage modules of a pipe, where they live and the threads that run them, which
stay the same across steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpipe.randomness import Streams
from gpipe.runtime.routes import Routes
from gpipe.runtime.threads import DeviceThreads
from gpipe.tied import TiedParameters

__all__ = ["StageSet", "lanes_of"]


def lanes_of(devices: Sequence[torch.device]) -> list[list[int]]:
    """Which pipeline devices each thread runs: every device on one GPU in one lane, every
    other device in a lane of its own.

    NOTE: a stage on a GPU queues kernels and moves on, so one thread queuing every stage
    of that GPU, in one order, keeps it as busy as a thread per stage would; threads would
    only compete for the GIL, a switch at every op: 4 stages of 1F1B on one H200 took 1.039x
    plain training's step on a thread each, 1.85 ms of CPU per action beyond plain, and
    1.006x in one lane, 35 us (benchmarks/runs/gpu_check_h200_lanes.txt). A CPU stage's ops
    run on its thread, so CPU stages overlap only on threads of their own.
    """
    lanes: list[list[int]] = []
    gpus: dict[torch.device, list[int]] = {}
    for d, device in enumerate(devices):
        if device.type != "cuda":
            lanes.append([d])
        elif device in gpus:
            gpus[device].append(d)
        else:
            gpus[device] = [d]
            lanes.append(gpus[device])
    return lanes


@dataclass
class StageSet:
    """What stays the same from step to step: the stage modules, where they live and the
    threads that run them.

    Args:
        modules: one module per model stage; None for a stage this process does not hold
            (a distributed pipe keeps only its own).
        devices: one ``torch.device`` per pipeline device.
        placement: ``placement[s]`` is the device index of stage ``s``.
        routes: how the stages pass values when they form a dataflow (see
            :mod:`gpipe.runtime.routes`); None for a chain (an ``nn.Sequential``).
        balance: the model units each stage holds, for a dataflow's random streams: a
            stage module without its own per-layer ``positions`` draws from one stream,
            keyed by the position of its first unit.
        tied: the copies of Parameters that stages on different devices share (see
            :mod:`gpipe.tied`); None when there are none to keep.
    """

    modules: Sequence[nn.Module | None]
    devices: list[torch.device]
    placement: tuple[int, ...]
    routes: Routes | None = None
    balance: Sequence[int] | None = None
    tied: TiedParameters | None = None
    # Whether a stage's forward writes into its input tensors (an in-place op on the input or
    # a view of it, in any layer), per (stage, training mode): such a stage gets a copy of its
    # input. Learned from the first forward, which runs on a copy to be safe (see
    # gpipe.runtime.input_writes).
    copies_input: dict[tuple[int, bool], bool] = field(default_factory=dict)
    # How each layer draws random numbers (per layer key and training mode), learned as the
    # layers run: which run on their own random stream (see gpipe.randomness).
    streams: Streams = field(init=False)
    # Bytes a forward keeps for backward, per stage, training mode, input and target shapes
    # and autocast: counted once per key (see gpipe.runtime.stage_call.call_stage_counted).
    saved_bytes: dict[tuple[Any, ...], int] = field(default_factory=dict)
    # A thread per device but the caller's, kept from step to step (see DeviceThreads).
    threads: DeviceThreads = field(default_factory=DeviceThreads, repr=False, compare=False)
    # Per stage, the random stream keys of its forward and whether the module runs each
    # layer in a scope of its own (a Partition) or draws from one stream as a whole.
    keys: list[tuple[list[int], bool]] = field(init=False)
    # The pipeline devices each thread runs, in order: one lane per GPU, one per other device
    # (see lanes_of).
    lanes: list[list[int]] = field(init=False)
    # Per action lists run, the order one thread runs several devices' actions in, cached by
    # the lists' identity (see Step.run).
    orders: dict[int, tuple[Any, list[Any]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.lanes = lanes_of(self.devices)
        held = {self.placement[s] for s, module in enumerate(self.modules) if module is not None}
        self.streams = Streams({d: self.devices[d] for d in sorted(held)})
        balance = self.balance or [1] * len(self.modules)
        self.keys = []
        for stage, module in enumerate(self.modules):
            positions: Any = getattr(module, "positions", None)
            if positions is not None and hasattr(module, "layer_scope"):
                self.keys.append((list(positions), True))
            else:
                self.keys.append(([sum(balance[:stage])], False))

    @property
    def count(self) -> int:
        """S, the number of model stages (K·v)."""
        return len(self.placement)

    @property
    def last(self) -> int:
        """The last model stage, which computes the loss."""
        return len(self.placement) - 1

    def module(self, stage: int) -> nn.Module:
        """The module of ``stage``, which this process must hold."""
        module = self.modules[stage]
        if module is None:
            raise RuntimeError(f"stage {stage} is not held by this process")
        return module

    def parameters(self, stage: int) -> list[torch.Tensor]:
        """The parameters ``stage``'s forward reads: its module's, with this device's copy in
        place of a tied Parameter whose owner lives on another device."""
        params: list[torch.Tensor] = list(self.module(stage).parameters())
        if self.tied is None:
            return params
        return [self.tied.read_by(stage, p) for p in params]

    def device_of(self, stage: int) -> torch.device:
        """The ``torch.device`` stage ``stage`` runs on."""
        return self.devices[self.placement[stage]]
