"""Dataflow: which named values each stage of a model that is not a chain reads, and from where.

A Sequential is a chain: stage ``s`` reads what stage ``s - 1`` returned. A model cut by
:func:`gpipe.split`, or a Sequential with skip connections (:mod:`gpipe.skip`), is a graph:
a stage may read values made several stages earlier (a U-Net's long skip, a residual
stream), or the pipe's own inputs (an attention mask every block reads). Such values go
directly from the stage that makes them to every stage that reads them, never relayed
through the stages in between.

The calling convention of a stage module in a dataflow:

- every stage but the last is called with one dict, ``{name: value}`` of exactly the names
  it takes, and returns a dict holding at least every name a later stage takes from it;
- the last stage is called the same way and returns the model's output (any pytree).

Source ``-1`` is the pipe's input: the caller hands each stage the input values it takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "INPUT",
    "Dataflow",
    "Stages",
    "named_batch_dims",
    "run_in_order",
]

INPUT = -1  # the source stage of the pipe's own input values


@dataclass(frozen=True)
class Dataflow:
    """Which named values each stage takes, and which stage makes each of them.

    Args:
        inputs: the names of the pipe's input values (source :data:`INPUT`), in order.
        takes: ``takes[s]`` is ``((name, source), ...)``: the values stage ``s`` reads and
            the stage that makes each one (an earlier stage, or :data:`INPUT`).

    Raises:
        ValueError: a stage reads from itself or a later stage, reads a name twice, or
            reads an input name that is not among ``inputs``.
    """

    inputs: tuple[str, ...]
    takes: tuple[tuple[tuple[str, int], ...], ...]

    def __post_init__(self) -> None:
        for stage, taken in enumerate(self.takes):
            names = [name for name, _ in taken]
            if len(set(names)) != len(names):
                raise ValueError(f"stage {stage} takes a name twice: {names}")
            for name, source in taken:
                if not INPUT <= source < stage:
                    raise ValueError(
                        f"stage {stage} takes {name!r} from stage {source}: a stage reads only "
                        f"from earlier stages or from the pipe's input ({INPUT})"
                    )
                if source == INPUT and name not in self.inputs:
                    raise ValueError(
                        f"stage {stage} takes input {name!r}, which is not among the pipe's "
                        f"inputs {self.inputs}"
                    )

    @classmethod
    def chain(cls, stages: int, name: str = "x") -> Dataflow:
        """A chain: stage 0 reads the input ``name``, every other stage its predecessor's."""
        return cls((name,), tuple(((name, s - 1),) for s in range(stages)))

    @property
    def count(self) -> int:
        """The number of stages."""
        return len(self.takes)

    def gives(self, stage: int) -> dict[str, tuple[int, ...]]:
        """The names ``stage`` (or :data:`INPUT`) makes that later stages read, each with the
        stages that read it, in order."""
        readers: dict[str, list[int]] = {}
        for reader, taken in enumerate(self.takes):
            for name, source in taken:
                if source == stage:
                    readers.setdefault(name, []).append(reader)
        return {name: tuple(stages) for name, stages in readers.items()}

    def sends(self, stage: int) -> dict[int, tuple[str, ...]]:
        """What ``stage`` (or :data:`INPUT`) sends: per reading stage, the names it reads
        from ``stage``. One message per reader, however far away it is."""
        out: dict[int, list[str]] = {}
        for reader, taken in enumerate(self.takes):
            for name, source in taken:
                if source == stage:
                    out.setdefault(reader, []).append(name)
        return {reader: tuple(names) for reader, names in out.items()}

    def receives(self, stage: int) -> dict[int, tuple[str, ...]]:
        """What ``stage`` receives: per source stage (or :data:`INPUT`), the names it reads."""
        out: dict[int, list[str]] = {}
        for name, source in self.takes[stage]:
            out.setdefault(source, []).append(name)
        return {source: tuple(names) for source, names in out.items()}

    def skips(self) -> list[tuple[int, int, tuple[str, ...]]]:
        """``(source, reader, names)`` of every message that jumps over at least one stage
        (inputs read by a stage other than the first included)."""
        return [
            (source, reader, names)
            for reader in range(self.count)
            for source, names in self.receives(reader).items()
            if reader - source > 1
        ]


def run_in_order(modules: Sequence[Any], dataflow: Dataflow, inputs: Mapping[str, Any]) -> Any:
    """Run the stages one after the other in this process, routing values by ``dataflow``.

    The plain reference for a dataflow (no micro-batches, no pipeline): what a pipe over
    the same stages must compute. Returns the last stage's output.

    Raises:
        ValueError: an input name is missing, or a stage did not return a name a later
            stage reads.
    """
    if len(modules) != dataflow.count:
        raise ValueError(f"{len(modules)} stage modules for a dataflow of {dataflow.count}")
    missing = [name for name in dataflow.inputs if name not in inputs]
    if missing:
        raise ValueError(f"inputs {missing} missing; the pipe's inputs are {dataflow.inputs}")
    made: dict[int, Mapping[str, Any]] = {INPUT: inputs}
    output: Any = None
    for stage, module in enumerate(modules):
        output = module({name: made[source][name] for name, source in dataflow.takes[stage]})
        if stage < dataflow.count - 1:
            wanted = dataflow.gives(stage)
            if not isinstance(output, Mapping) or any(n not in output for n in wanted):
                got = sorted(output) if isinstance(output, Mapping) else type(output).__name__
                raise ValueError(
                    f"stage {stage} returned {got}, but later stages read {sorted(wanted)} "
                    "from it: a stage of a dataflow returns a dict holding every name it gives"
                )
            made[stage] = output
    return output


class Stages(nn.ModuleList):
    """A model cut into stage modules that pass named values along a :class:`Dataflow`.

    What :func:`gpipe.split` and :func:`gpipe.skip.stages` return, and what
    :class:`gpipe.GPipe` and ``gpipe.distributed.DistributedGPipe`` accept in place of an
    ``nn.Sequential``. Each stage module holds the user's own submodules and parameters
    (not copies), so gradients land on the user's model.

    Args:
        modules: one module per stage, following the calling convention of this module.
        dataflow: which values each stage reads, and from where.
        balance: how many of the model's units (layers, blocks) each stage holds, as the
            ``balance`` of the Sequential path.
        devices: where each stage runs, when the splitter was told; None lets the pipe choose.
        constants: arguments of the model's forward baked into the stages (plain Python
            values the example call gave); a call may pass them again, with the same value.
        call_order: the names positional arguments fill, in order (inputs and constants);
            by default the dataflow's inputs.
        source: the model these stages were cut from (``gpipe.split`` keeps it), which
            ``pipe.generate`` decodes through.

    Raises:
        ValueError: the module count, the dataflow and the balance disagree.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        dataflow: Dataflow,
        balance: Sequence[int] | None = None,
        devices: Sequence[torch.device] | None = None,
        constants: Mapping[str, Any] | None = None,
        call_order: Sequence[str] | None = None,
        source: nn.Module | None = None,
    ) -> None:
        super().__init__(modules)
        # NOTE: kept out of the module tree (its parameters are the stages' already): what
        # generation calls the user's own decoder layers through.
        object.__setattr__(self, "source", source)
        if len(modules) != dataflow.count:
            raise ValueError(f"{len(modules)} stage modules for a dataflow of {dataflow.count}")
        self.dataflow = dataflow
        self.balance = [1] * len(modules) if balance is None else list(balance)
        if len(self.balance) != len(modules):
            raise ValueError(f"balance {self.balance} for {len(modules)} stages")
        self.devices = None if devices is None else [torch.device(d) for d in devices]
        self.constants = dict(constants or {})
        self.call_order = tuple(call_order or dataflow.inputs)

    def bind(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The named input values of a call ``model(*args, **kwargs)``.

        Positional arguments fill :attr:`Dataflow.inputs` in order; keyword arguments go by
        name.

        Raises:
            TypeError: an argument is missing, given twice, or unknown.
        """
        names = self.dataflow.inputs
        if len(args) > len(self.call_order):
            raise TypeError(f"{len(args)} positional inputs given; the stages take {names}")
        bound = dict(zip(self.call_order, args))
        for name, value in kwargs.items():
            if name not in names and name not in self.constants:
                raise TypeError(f"unknown input {name!r}; the stages take {names}")
            if name in bound:
                raise TypeError(f"input {name!r} given twice")
            bound[name] = value
        for name, baked in self.constants.items():
            if name in bound and not _same(bound.pop(name), baked):
                raise ValueError(
                    f"the stages were traced with {name}={baked!r}, which is baked into them; "
                    f"pass that value (or leave it out), or call gpipe.split again with the "
                    f"{name} you want in example_kwargs"
                )
        missing = [name for name in names if name not in bound]
        if missing:
            raise TypeError(f"inputs {missing} missing; the stages take {names}")
        return bound

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the stages in order, unpipelined: the reference a pipe must match."""
        return run_in_order(list(self), self.dataflow, self.bind(*args, **kwargs))

    def relayed(self) -> Stages:
        """The same stages, with every value relayed through the stages in between.

        Stage 0 reads all the pipe's inputs and every other stage only what its predecessor
        hands it: the values it needs itself and those a later stage needs, passed along by
        a wrapper around each stage module. The same computation (the same modules and
        parameters, the same random streams), so the same loss and gradients; only the
        messages differ. For measuring what sending values directly saves.
        """
        flow = self.dataflow
        count = flow.count
        later: list[set[tuple[int, str]]] = []  # per cut s | s+1: (source, name) still needed
        for cut in range(count):
            later.append(
                {
                    (source, name)
                    for reader in range(cut + 1, count)
                    for name, source in flow.takes[reader]
                    if source <= cut
                }
            )
        modules: list[nn.Module] = []
        for stage, module in enumerate(self):
            carried = sorted(later[stage]) if stage < count - 1 else None
            relay = _LayeredRelay if layered(module) else _Relay
            modules.append(relay(module, flow.inputs, flow.takes[stage], stage, carried))
        first = tuple((name, INPUT) for name in flow.inputs)
        takes = (first, *(((_RELAY, stage - 1),) for stage in range(1, count)))
        return Stages(
            modules,
            Dataflow(flow.inputs, takes),
            self.balance,
            self.devices,
            self.constants,
            self.call_order,
        )


_RELAY = "relayed"


def _same(given: Any, baked: Any) -> bool:
    """Whether a value passed for a baked-in argument is the one baked in."""
    if isinstance(given, torch.Tensor) or type(given) is not type(baked):
        return False
    if isinstance(given, tuple | list):
        return len(given) == len(baked) and all(map(_same, given, baked))
    return bool(given == baked)


def layered(module: nn.Module) -> bool:
    """Whether ``module`` runs each layer on a random stream of its own (a Partition)."""
    return hasattr(module, "positions") and hasattr(module, "layer_scope")


class _Relay(nn.Module):
    """One stage of :meth:`Stages.relayed`: runs its stage module on the values it takes,
    and hands the next stage, in one dict, everything a later stage still needs."""

    def __init__(
        self,
        module: nn.Module,
        inputs: tuple[str, ...],
        takes: tuple[tuple[str, int], ...],
        stage: int,
        carried: list[tuple[int, str]] | None,
    ) -> None:
        super().__init__()
        self.module = module
        self._inputs = inputs
        self._takes = takes
        self._stage = stage
        self._carried = carried  # None: the last stage, which returns the model's output

    def forward(self, values: dict[str, Any]) -> Any:
        if self._stage == 0:
            made = {f"{INPUT}.{name}": values[name] for name in self._inputs}
        else:
            made = dict(values[_RELAY])
        output = self.module({name: made[f"{source}.{name}"] for name, source in self._takes})
        if self._carried is None:
            return output
        if isinstance(output, Mapping):
            made.update({f"{self._stage}.{name}": value for name, value in output.items()})
        relayed = {}
        for source, name in self._carried:
            key = f"{source}.{name}"
            if key not in made:
                raise ValueError(
                    f"stage {source} returned no {name!r}, which a later stage reads: a stage "
                    "of a dataflow returns a dict holding every name it gives"
                )
            relayed[key] = made[key]
        return {_RELAY: relayed}


class _LayeredRelay(_Relay):
    """A relay around a stage module with a random stream per layer, which it passes on."""

    @property
    def positions(self) -> list[int]:
        return list(self.module.positions)  # type: ignore[arg-type]

    @property
    def layer_scope(self) -> Any:
        return self.module.layer_scope

    @layer_scope.setter
    def layer_scope(self, scope: Any) -> None:
        self.module.layer_scope = scope


def named_batch_dims(dims: Any, names: Sequence[str]) -> Any:
    """A pipe's ``input_batch_dims`` for named inputs, as a dict with one entry per name.

    An int or None applies to every input; a dict gives some names theirs (the others are
    batched on dim 0); a tuple or list gives the positional inputs theirs, in order.

    Raises:
        ValueError: a name that is not an input, or more entries than inputs.
    """
    if dims is None or isinstance(dims, int):
        return dims
    if isinstance(dims, Mapping):
        unknown = [name for name in dims if name not in names]
        if unknown:
            raise ValueError(
                f"input_batch_dims names {unknown}, which are not among the inputs {tuple(names)}"
            )
        return {name: dims.get(name, 0) for name in names}
    if isinstance(dims, (tuple, list)):
        if len(dims) > len(names):
            raise ValueError(
                f"input_batch_dims={dims!r} has {len(dims)} entries for the inputs "
                f"{tuple(names)}: give one per input, or a dict {{name: dim}}"
            )
        given = dict(zip(names, dims))
        return {name: given.get(name, 0) for name in names}
    return dims
