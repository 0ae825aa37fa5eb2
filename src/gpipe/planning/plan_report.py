"""Plans and the planner's report: what each candidate is, what it is predicted to cost."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, overload

from gpipe.units import format_bytes

if TYPE_CHECKING:
    from gpipe.planning.verify import Calibration
    from gpipe.schedule import Schedule

__all__ = ["Plan", "PlanOrReport", "PlanReport", "Rejection"]


@dataclass(frozen=True)
class Plan:
    """One way to run the model as a pipeline, with what the planner predicts for it.

    Attributes:
        stages: devices the pipeline uses (the first ``stages`` of those given).
        chunks: micro-batches per mini-batch.
        checkpoint: "never", "except_last" or "always".
        schedule: the schedule's name.
        virtual_stages: model stages per device (2 for "interleaved", else 1).
        balance: layers per model stage (``stages * virtual_stages`` entries).
        devices: one device per pipeline stage.
        predicted_step: seconds one training step takes, as simulated.
        bubble: the idle fraction of the simulated step.
        peak_memory: bytes per device at its peak: parameters, gradients and optimizer state
            of its stages, plus ``activation_memory``.
        activation_memory: bytes per device held for backward at its peak (what
            ``GPipe.timeline.peak_memory`` measures).
        built: the schedule itself where its name alone does not rebuild it ("auto",
            searched under this plan's measured costs and memory budget).
        dp: data-parallel replicas of this pipeline (memory and devices are per replica).
        zero: whether the optimizer state is sharded over the replicas (ZeRO-1).
        headroom: the factor on ``peak_memory`` the budget is checked against (see
            :meth:`calibrate`); 1.0 uncalibrated.
        world_size: the processes of the ``DistributedGPipe`` job this plan lays out
            (``stages * dp``; build it with ``DistributedGPipe.from_plan``); None for a
            layout planned without ``world_size``.
        predicted_high: the step predicted from the first quartile of each layer's profiled
            runs rather than the fastest (see :attr:`predicted_range`); None where not known.
        measured_step: seconds, the median step of real runs of this plan when the planner
            verified it (``plan(..., verify=True)``); None otherwise.
        measured_range: the first and third quartiles of those runs.
        split_points: for a model :func:`gpipe.split` cuts, the submodules stages 1, 2, ...
            begin with; None for an ``nn.Sequential`` or ``Stages``.
        pieces: for a ``gpipe.Stages``, how many of its stages each stage of the plan
            groups (``balance`` still counts the model's units); None otherwise.
        example_inputs: for a split model, the inputs :meth:`gpipe.GPipe.from_plan` traces
            it on again (the planner's sample, as ``gpipe.split`` takes it).
    """

    stages: int
    chunks: int
    checkpoint: str
    schedule: str
    virtual_stages: int
    balance: list[int]
    devices: list[str]
    predicted_step: float
    bubble: float
    peak_memory: list[int]
    activation_memory: list[int] = field(default_factory=list)
    built: Schedule | None = None
    dp: int = 1
    zero: bool = False
    data_parallel: str = "replicate"
    headroom: float = 1.0
    predicted_high: float | None = None
    world_size: int | None = None
    measured_step: float | None = None
    measured_range: tuple[float, float] | None = None
    split_points: tuple[str, ...] | None = None
    pieces: tuple[int, ...] | None = None
    example_inputs: Any = field(default=None, compare=False, repr=False)

    @property
    def predicted_range(self) -> tuple[float, float]:
        """Seconds: the step predicted from each layer's fastest run, and from the first
        quartile of its runs. This host's noise moved the profile within that range."""
        high = self.predicted_step if self.predicted_high is None else self.predicted_high
        return self.predicted_step, high

    @property
    def needed_memory(self) -> list[int]:
        """Bytes per device the budget must hold: ``peak_memory`` times ``headroom``."""
        return [math.ceil(b * self.headroom) for b in self.peak_memory]

    def calibrate(self, measured: Any) -> float:
        """The headroom a real step of this plan shows: its measured peak over the
        predicted one, at least 1; pass it to a later ``plan(..., headroom=...)``.

        Args:
            measured: the pipe built from this plan, after a real step (on CUDA its
                allocator's peaks, otherwise gpipe's own count), or the measured peak
                bytes per device. See :func:`gpipe.planning.headroom.measured_headroom`.
        """
        from gpipe.planning.headroom import measured_headroom

        return measured_headroom(self, measured)

    def pipe_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :class:`gpipe.GPipe` that build this plan's pipe (from
        :meth:`pipe_module`; Stages bring their own balance)."""
        kwargs = {
            "balance": list(self.balance),
            "devices": list(self.devices),
            "chunks": self.chunks,
            "checkpoint": self.checkpoint,
            "schedule": self.schedule if self.built is None else self.built,
            "virtual_stages": self.virtual_stages,
        }
        if self.split_points is not None or self.pieces is not None:
            del kwargs["balance"]
        return kwargs

    def pipe_module(self, module: Any) -> Any:
        """What :class:`gpipe.GPipe` pipes for this plan: ``module`` (an ``nn.Sequential``),
        its ``Stages`` grouped into this plan's stages, or the model cut by ``gpipe.split``
        at :attr:`split_points`. See :func:`gpipe.planning.model_units.pipe_module`."""
        from gpipe.planning.model_units import pipe_module

        return pipe_module(module, self)

    def cuts(self) -> str:
        """Where a model that is not an ``nn.Sequential`` is cut, in words ("" for one)."""
        if self.split_points is not None:
            points = ", ".join(self.split_points)
            return f"split points: {points}" if points else "split points: none (one stage)"
        if self.pieces is not None:
            return f"stages of the Stages per stage: {','.join(map(str, self.pieces))}"
        return ""

    def describe(self) -> str:
        """A short name: ``1f1b K=4 M=8 checkpoint=never``."""
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        engine = f" {self.data_parallel}" if self.data_parallel != "replicate" else ""
        shared = f"{' zero' if self.zero else ''}{engine}"
        dp = f" dp={self.dp}{shared}" if self.dp > 1 else ""
        if self.world_size is not None:
            dp = f" dp={self.dp}{shared} of {self.world_size} processes"
        return (
            f"{self.schedule} K={self.stages}{v} M={self.chunks} checkpoint={self.checkpoint}{dp}"
        )


@dataclass(frozen=True)
class Rejection:
    """A candidate the planner did not recommend, and why."""

    plan: Plan
    reason: str


class PlanReport(Sequence[Plan]):
    """The best plans, fastest first, and every other candidate with the reason it lost.

    Indexes like a list of :class:`Plan`; ``best`` is ``report[0]``.
    """

    def __init__(
        self,
        plans: list[Plan],
        rejected: list[Rejection],
        memory_per_device: int | None,
        notes: Sequence[str] = (),
    ) -> None:
        self.plans = plans
        self.rejected = rejected
        self.memory_per_device = memory_per_device
        #: What the ranking could not tell apart, and what a verification measured.
        self.notes = list(notes)
        #: What real steps taught the time and memory model (``plan(..., verify=True)``),
        #: for a later ``plan(..., calibration=report.calibration)``; None unverified.
        self.calibration: Calibration | None = None

    @property
    def best(self) -> Plan:
        """The fastest plan that fits."""
        return self.plans[0]

    def __len__(self) -> int:
        return len(self.plans)

    @overload
    def __getitem__(self, index: int) -> Plan: ...

    @overload
    def __getitem__(self, index: slice) -> list[Plan]: ...

    def __getitem__(self, index: int | slice) -> Plan | list[Plan]:
        return self.plans[index]

    def __iter__(self) -> Iterator[Plan]:
        return iter(self.plans)

    def __str__(self) -> str:
        header: tuple[str, ...] = (
            "#",
            "schedule",
            "K",
            "v",
            "M",
            "checkpoint",
            "balance",
            "predicted step",
            "bubble",
            "peak memory per device",
        )
        verified = any(p.measured_step is not None for p in self.plans)
        if verified:
            header = (*header[:8], "measured step", *header[8:])
        rows: list[tuple[str, ...]] = [header]
        for rank, p in enumerate(self.plans, 1):
            rows.append(
                (
                    str(rank),
                    p.schedule,
                    str(p.stages),
                    str(p.virtual_stages),
                    str(p.chunks),
                    p.checkpoint,
                    ",".join(map(str, p.balance)),
                    _milliseconds(p.predicted_range),
                    f"{p.bubble:.3f}",
                    " ".join(format_bytes(b) for b in p.peak_memory),
                )
            )
            if verified:
                measured = "" if p.measured_range is None else _milliseconds(p.measured_range)
                rows[-1] = (*rows[-1][:8], measured, *rows[-1][8:])
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        budget = "none" if self.memory_per_device is None else format_bytes(self.memory_per_device)
        headroom = max([p.headroom for p in self.plans] + [r.plan.headroom for r in self.rejected])
        if headroom != 1.0:
            budget += (
                f" (checked against the predicted peaks x {headroom:.2f}, the headroom "
                "calibrated from a measured step)"
            )
        over = [r for r in self.rejected if r.reason.startswith("over")]
        lines.append(
            f"memory budget per device: {budget}; {len(self.plans) + len(self.rejected)} "
            f"candidates, {len(over)} over the budget, {len(self.rejected) - len(over)} slower"
        )
        shown = over[:3] + [r for r in self.rejected if not r.reason.startswith("over")][:3]
        for r in shown:
            lines.append(f"  rejected {r.plan.describe()}: {r.reason}")
        lines += [f"#{n} {p.cuts()}" for n, p in enumerate(self.plans, 1) if p.cuts()]
        lines += self.notes
        return "\n".join(lines)


def _milliseconds(span: tuple[float, float]) -> str:
    """``12.40–13.05 ms``, or ``12.40 ms`` where the two ends agree to the hundredth."""
    low, high = (f"{t * 1e3:.2f}" for t in span)
    return f"{low} ms" if low == high else f"{low}–{high} ms"


#: What :meth:`gpipe.GPipe.from_plan` builds a pipe from: a plan, or a report (its best plan).
PlanOrReport: TypeAlias = Plan | PlanReport
