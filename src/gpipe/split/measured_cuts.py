"""Choosing the cuts by measurement: profile each unit of a traced model, then balance.

Each unit is cut into a stage of its own, and the stages are chained so each carries every
value along (a dict growing unit by unit): a chain the profiler of :mod:`gpipe.balance` can
time and weigh unit by unit, as it does the layers of an nn.Sequential.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gpipe.balance.exact import balance_costs
from gpipe.balance.profiler import profile
from gpipe.split.cuts import cut_by_balance, ordered_units
from gpipe.split.stage import build_stages
from gpipe.split.trace import Traced

__all__ = ["measured_balance"]

KINDS = ("time", "memory")


class _Carry(nn.Module):
    """One unit in a chain: reads what it takes from the carried dict, adds what it gives.

    Graph names are unique, so the carried dict is keyed by name alone.
    """

    def __init__(self, stage: nn.Module, takes: tuple[tuple[str, int], ...], last: bool):
        super().__init__()
        self.stage = stage
        self.names = [name for name, _ in takes]
        self.last = last

    def forward(self, carried: dict[str, Any]) -> dict[str, Any]:
        made = self.stage({name: carried[name] for name in self.names})
        if self.last:
            return {**carried, "<output>": made}
        return {**carried, **made}


def measured_balance(
    model: nn.Module, traced: Traced, inputs: dict[str, Any], kind: str, stages: int
) -> list[int]:
    """Units per stage so each of ``stages`` stages costs about the same ``kind``.

    Args:
        model: the model.
        traced: its graph.
        inputs: the example inputs, by name.
        kind: ``"time"`` (forward + backward) or ``"memory"`` (parameters, gradients and
            saved activations).
        stages: how many stages.

    Raises:
        ValueError: an unknown kind, or more stages than units.
    """
    if kind not in KINDS:
        raise ValueError(f"balance must be a list of ints, 'time' or 'memory'; got {kind!r}")
    every = cut_by_balance(model, traced.graph, [1] * len(ordered_units(model, traced.graph)))
    if not 1 <= stages <= every.stages:
        raise ValueError(
            f"num_stages={stages}: the model has {every.stages} units to cut between "
            f"({every.units}); ask for 1 to {every.stages} stages"
        )
    modules, dataflow = build_stages(model, traced, every)
    chain = nn.Sequential(
        *(
            _Carry(module, dataflow.takes[s], last=s == dataflow.count - 1)
            for s, module in enumerate(modules)
        )
    )
    measured = profile(chain, dict(inputs), repeats=3, warmup=1)
    return balance_costs(measured.costs(kind), stages)
