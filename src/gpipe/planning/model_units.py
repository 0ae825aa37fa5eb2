"""What the planner cuts, for any model: its units, chained for the profiler, and the pipe a
balance over them builds.

Three kinds of model come in:

    nn.Sequential   its layers are the units; the chain is the module itself
    gpipe.Stages    its stage modules are the units ("pieces"): a plan groups consecutive
                    pieces, so it balances among the cuts the Stages were made with
    any nn.Module   cut by :func:`gpipe.split` into its finest units, or at the split
                    points given: a plan names the points it cuts at (``Plan.split_points``)

A Stages (given, or made by gpipe.split) is profiled as a chain of its pieces, each reading
what it takes from a dict carried along and adding what it gives; the dict drops each value
once no later piece reads it, so what enters a unit is what crosses the cut before it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpipe.arguments import NOT_A_CHAIN
from gpipe.dataflow import INPUT, Dataflow, Stages
from gpipe.grouping import group_stages
from gpipe.split import split
from gpipe.split.cuts import ordered_units
from gpipe.split.trace import trace

if TYPE_CHECKING:
    from gpipe.planning.plan_report import Plan

__all__ = ["Units", "call_inputs", "model_units", "pipe_module"]

SEQUENTIAL, STAGES, SPLIT = "sequential", "stages", "split"


@dataclass(frozen=True)
class Units:
    """The units of a model the planner profiles and balances, and how plans build its pipe.

    Attributes:
        chain: an ``nn.Sequential`` with one layer per unit, for the profiler.
        sample: the chain's input.
        names: one name per unit, for people: a layer's class, ``stage 3`` of a Stages, the
            submodule a split unit begins with.
        sizes: the model's units (layers, blocks) each of these holds: 1, or a piece's
            share of ``Stages.balance``.
        kind: ``"sequential"``, ``"stages"`` or ``"split"``.
        example_inputs: for ``"split"``, the inputs gpipe.split traces again to build the
            pipe, in its ``example_inputs`` form (a tuple, or a dict by name).
    """

    chain: nn.Sequential
    sample: Any
    names: list[str]
    sizes: list[int]
    kind: str
    example_inputs: Any = None

    @property
    def count(self) -> int:
        """How many units there are to balance."""
        return len(self.chain)

    def planned(self, plan: Plan) -> Plan:
        """``plan``, whose ``balance`` counts these units per stage, with the fields that
        build its pipe: model units per stage, and the pieces or split points to cut at."""
        if self.kind == SEQUENTIAL:
            return plan
        bounds = [0, *itertools.accumulate(plan.balance)]
        units = [sum(self.sizes[a:b]) for a, b in itertools.pairwise(bounds)]
        if self.kind == STAGES:
            return dataclasses.replace(plan, balance=units, pieces=tuple(plan.balance))
        return dataclasses.replace(
            plan,
            balance=units,
            split_points=tuple(self.names[b] for b in bounds[1:-1]),
            example_inputs=self.example_inputs,
        )


def model_units(module: nn.Module, sample: Any, split_points: Sequence[str] | None) -> Units:
    """The units :func:`gpipe.plan` weighs for ``module``, an ``nn.Sequential``, ``Stages``
    or any other module.

    Args:
        module: the model.
        sample: its example input: for an ``nn.Sequential`` its one input; otherwise a
            tensor (the one positional input), a tuple of positional inputs, or a dict of
            inputs by name, each tensor batched along dim 0.
        split_points: for a module that is neither, the submodule names the plan may cut
            before (None: every unit's start).

    Raises:
        TypeError: ``split_points`` for an ``nn.Sequential`` or ``Stages``, or a sample that
            does not fit the model's inputs.
        ValueError: a split point gpipe.split refuses, or a model it cannot trace.
    """
    if split_points is not None and isinstance(module, (nn.Sequential, Stages)):
        kind = "an nn.Sequential's layers" if isinstance(module, nn.Sequential) else "Stages"
        raise TypeError(
            f"split_points are for a model gpipe.split cuts; {kind} are already the units "
            "the plan balances: leave split_points out"
        )
    if isinstance(module, nn.Sequential):
        names = [type(layer).__name__ for layer in module]
        return Units(module, sample, names, [1] * len(module), SEQUENTIAL)
    args, kwargs = call_inputs(sample)
    if isinstance(module, Stages):
        inputs = module.bind(*args, **kwargs)
        names = [f"stage {s}" for s in range(len(module))]
        return Units(_chain(module), _carried(inputs), names, list(module.balance), STAGES)
    example = dict(kwargs) if kwargs else tuple(args)
    if split_points is None:
        units = ordered_units(module, trace(module, args, kwargs).graph)
        stages = split(module, balance=[1] * len(units), example_inputs=example)
    else:
        if isinstance(split_points, str):
            raise TypeError(f"split_points is a list of names, e.g. [{split_points!r}]")
        units = ["(start)", *split_points]
        stages = split(module, split_points=list(split_points), example_inputs=example)
    inputs = stages.bind(*args, **kwargs)
    return Units(_chain(stages), _carried(inputs), units, list(stages.balance), SPLIT, example)


def pipe_module(module: nn.Module, plan: Plan) -> nn.Module:
    """What :meth:`gpipe.GPipe.from_plan` pipes: ``module`` itself (an ``nn.Sequential``),
    its Stages grouped into the plan's stages, or the model split at the plan's points.

    Raises:
        TypeError: ``module`` is not the kind of model the plan was made for.
        ValueError: Stages with another number of pieces than the plan's.
    """
    if plan.pieces is not None:
        if not isinstance(module, Stages):
            raise TypeError(
                f"this plan groups the pieces of a gpipe.Stages, got {type(module).__name__}: "
                "pass the Stages that were planned"
            )
        if len(module) != sum(plan.pieces):
            raise ValueError(
                f"this plan groups {sum(plan.pieces)} stages, the Stages given hold "
                f"{len(module)}: pass the Stages that were planned"
            )
        return group_stages(module, list(plan.pieces))
    if plan.split_points is not None:
        if isinstance(module, (nn.Sequential, Stages)) or plan.example_inputs is None:
            raise TypeError(
                f"this plan splits a model with gpipe.split at {list(plan.split_points)}, "
                f"got {type(module).__name__}: pass the model that was planned"
            )
        return split(
            module, split_points=list(plan.split_points), example_inputs=plan.example_inputs
        )
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"this plan cuts an nn.Sequential's layers, got {type(module).__name__}: pass the "
            f"model that was planned; {NOT_A_CHAIN}, and gpipe.plan takes either"
        )
    return module


def call_inputs(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample as a call's positional and keyword inputs."""
    if isinstance(sample, Mapping):
        return (), dict(sample)
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    if isinstance(sample, torch.Tensor):
        return (sample,), {}
    raise TypeError(
        "sample must be a tensor, a tuple of positional inputs or a dict of inputs by name "
        f"for a model that is not an nn.Sequential, got {type(sample).__name__}"
    )


def _key(name: str, source: int) -> str:
    """The carried dict's key of value ``name`` made by stage ``source``: stages of a
    skippable Sequential all give their chain value one name."""
    return f"{source}:{name}"


def _carried(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The chain's input: the pipe's inputs, keyed as carried values."""
    return {_key(name, INPUT): value for name, value in inputs.items()}


def _chain(stages: Stages) -> nn.Sequential:
    """The pieces of ``stages`` as a chain the profiler times piece by piece."""
    flow = stages.dataflow
    return nn.Sequential(
        *(_Piece(module, flow.takes[s], s, _still_read(flow, s)) for s, module in enumerate(stages))
    )


def _still_read(flow: Dataflow, stage: int) -> list[str] | None:
    """The carried keys some stage after ``stage`` reads; None after the last."""
    if stage == flow.count - 1:
        return None
    later = flow.takes[stage + 1 :]
    return sorted({_key(n, source) for taken in later for n, source in taken if source <= stage})


class _Piece(nn.Module):
    """One piece in the chain: reads what it takes from the carried dict, adds what it gives,
    and carries on only what later pieces read (the last returns the model's output)."""

    def __init__(
        self,
        module: nn.Module,
        takes: tuple[tuple[str, int], ...],
        index: int,
        kept: list[str] | None,
    ) -> None:
        super().__init__()
        self.module = module
        self._takes = [(name, _key(name, source)) for name, source in takes]
        self._index = index
        self._kept = kept

    def forward(self, carried: dict[str, Any]) -> Any:
        made = self.module({name: carried[key] for name, key in self._takes})
        if self._kept is None:
            return made
        every = {**carried, **{_key(name, self._index): v for name, v in made.items()}}
        return {key: every[key] for key in self._kept}
