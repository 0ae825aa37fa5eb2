"""Routes: how the stages of a dataflow (a model that is not a chain) pass named values.

A stage reads from several stages, and a value made by one stage may be read by several
later ones; each such value goes directly from its maker to every reader, one message per
(source, reader) pair and micro-batch, never relayed through the stages in between. So a
message's tag names its source stage as well as its receiver:

    (ACTIVATION, reader, microbatch, source)    {name: value} a reader takes from a source
    (GRADIENT, source, microbatch, reader)      the gradients of that message, coming back

The pipe's own input values come from source :data:`~gpipe.dataflow.INPUT` (-1), the
caller; the last stage's output goes to stage S (one past the last), and its gradient comes
back from S. A value read by several stages gets the sum of their gradients.

A chain (an ``nn.Sequential``) has no routes: its tags stay ``(kind, stage, microbatch)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from gpipe.dataflow import INPUT, Dataflow
from gpipe.runtime.transport import ACTIVATION, GRADIENT, Transport
from gpipe.structure import leaves

__all__ = ["Routes"]

Prepare = Callable[[Any], Any]


class Routes:
    """Where each stage of a :class:`~gpipe.dataflow.Dataflow` sends and receives.

    Args:
        dataflow: which values each stage takes, and from where.
    """

    def __init__(self, dataflow: Dataflow) -> None:
        self.dataflow = dataflow
        self.count = dataflow.count
        self.last = dataflow.count - 1
        # per stage, (source, names) and (reader, names), in the dataflow's order
        self.sources = [tuple(dataflow.receives(s).items()) for s in range(self.count)]
        self.readers = [tuple(dataflow.sends(s).items()) for s in range(self.count)]
        self.inputs = tuple(dataflow.sends(INPUT).items())  # the stages reading the input
        self.reading_input = frozenset(reader for reader, _ in self.inputs)

    # -- the worker's side -------------------------------------------------------------

    def receive(self, transport: Transport, stage: int, mb: int) -> dict[str, Any]:
        """Every value ``stage`` takes, from each of its sources, in one dict."""
        values: dict[str, Any] = {}
        for source, _ in self.sources[stage]:
            values.update(transport.recv((ACTIVATION, stage, mb, source)))
        return values

    def send(
        self, transport: Transport, stage: int, mb: int, output: Any, prepare: Prepare | None
    ) -> None:
        """Send ``stage``'s output on: to each stage reading from it, or to the caller.

        ``prepare`` (detaching, for autograd) runs once per message, so every reader gets
        tensors of its own.

        Raises:
            ValueError: a stage but the last did not return a dict holding every name a
                later stage reads from it.
        """
        if stage == self.last:
            value = output if prepare is None else prepare(output)
            transport.send((ACTIVATION, self.count, mb, stage), value)
            return
        readers = self.readers[stage]
        self.check_output(stage, output)
        for reader, names in readers:
            message = {name: output[name] for name in names}
            transport.send(
                (ACTIVATION, reader, mb, stage), message if prepare is None else prepare(message)
            )

    def check_output(self, stage: int, output: Any) -> None:
        """Raise a ValueError unless ``output`` holds every name ``stage`` gives."""
        if isinstance(output, Mapping) and all(
            name in output for _, names in self.readers[stage] for name in names
        ):
            return
        wanted = sorted({name for _, names in self.readers[stage] for name in names})
        got = sorted(output) if isinstance(output, Mapping) else type(output).__name__
        raise ValueError(
            f"stage {stage} returned {got}, but later stages read {wanted} from it: a stage "
            "of a dataflow returns a dict holding every name it gives"
        )

    def receive_gradients(
        self, transport: Transport, stage: int, mb: int
    ) -> list[tuple[tuple[str, ...] | None, Any]]:
        """The gradients of ``stage``'s output, one message per reader (the caller's for the
        last stage), each with the names it covers (None: the whole output)."""
        if stage == self.last:
            return [(None, transport.recv((GRADIENT, stage, mb, self.count)))]
        return [
            (names, transport.recv((GRADIENT, stage, mb, reader)))
            for reader, names in self.readers[stage]
        ]

    @staticmethod
    def roots(
        outputs: Any, received: list[tuple[tuple[str, ...] | None, Any]]
    ) -> list[tuple[Any, torch.Tensor | None]]:
        """(output tensor, gradient) pairs to differentiate from; a tensor several stages
        read gets the sum of their gradients."""
        summed: dict[int, tuple[Any, torch.Tensor]] = {}
        for names, grads in received:
            value = outputs if names is None else {name: outputs[name] for name in names}
            for out, grad in zip(leaves(value), grads):
                if grad is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
                    continue
                known = summed.get(id(out))
                summed[id(out)] = (out, grad if known is None else known[1] + grad)
        return list(summed.values())

    def send_gradients(
        self,
        transport: Transport,
        stage: int,
        mb: int,
        inputs: Mapping[str, Any],
        grads: Mapping[int, torch.Tensor | None],
    ) -> None:
        """Send the gradients of ``stage``'s inputs back, one message per source.

        ``grads`` maps ``id(input tensor)`` to its gradient. The caller hears only about
        input messages that hold a tensor wanting a gradient (it listens for no other).
        """
        for source, names in self.sources[stage]:
            parts = leaves({name: inputs[name] for name in names})
            if source == INPUT and not any(
                isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in parts
            ):
                continue
            message = [
                grads.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None for leaf in parts
            ]
            transport.send((GRADIENT, source, mb, stage), message)

    # -- the caller's side -------------------------------------------------------------

    def feed(
        self,
        transport: Transport,
        mb: int,
        microbatch: Mapping[str, Any],
        prepare: Prepare,
        held: Callable[[int], bool] | None = None,
    ) -> None:
        """Hand micro-batch ``mb`` of the pipe's inputs to every stage that reads them
        (only to the stages ``held`` says this process holds)."""
        for reader, names in self.inputs:
            if held is None or held(reader):
                message = {name: microbatch[name] for name in names}
                transport.send((ACTIVATION, reader, mb, INPUT), prepare(message))

    def output_tag(self, mb: int) -> tuple[str, int, int, int]:
        """The tag of the last stage's output of micro-batch ``mb`` (the caller collects)."""
        return (ACTIVATION, self.count, mb, self.last)

    def output_gradient_tag(self, mb: int) -> tuple[str, int, int, int]:
        """The tag of the output's gradient the caller hands to the last stage."""
        return (GRADIENT, self.last, mb, self.count)

    def input_gradients(
        self,
        transport: Transport,
        mb: int,
        microbatch: Mapping[str, Any],
        held: Callable[[int], bool] | None = None,
    ) -> list[torch.Tensor | None]:
        """The gradient of each leaf of the input micro-batch ``mb`` (None: no gradient),
        summed over the stages that read it (those ``held`` says this process holds)."""
        spans: dict[str, range] = {}
        start = 0
        for name, value in microbatch.items():
            count = len(leaves(value))
            spans[name] = range(start, start + count)
            start += count
        flat = leaves(microbatch)
        total: list[torch.Tensor | None] = [None] * start
        for reader, names in self.inputs:
            if held is not None and not held(reader):
                continue
            indices = [i for name in names for i in spans[name]]
            if not any(
                isinstance(flat[i], torch.Tensor) and flat[i].requires_grad for i in indices
            ):
                continue
            received = transport.collect((GRADIENT, INPUT, mb, reader))
            for i, grad in zip(indices, received):
                if grad is not None:
                    known = total[i]
                    total[i] = grad if known is None else known + grad.to(known.device)
        return total
