"""The profile: what each layer of an nn.Sequential costs in time and memory, per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpipe.units import format_bytes

__all__ = ["COST_KINDS", "Profile"]

#: What :meth:`Profile.costs` can weigh layers by.
COST_KINDS = ("time", "memory", "params")


@dataclass(frozen=True)
class Profile:
    """Measured per-layer costs of a model, index ``i`` for layer ``i``.

    Times are in seconds (the fastest of the timed repeats: other work on the host only
    adds time), sizes in bytes.

    Attributes:
        names: each layer's class name.
        forward: forward time.
        backward: backward time (input and weight gradients); 0 if nothing is differentiable.
        output_bytes: bytes of the tensors the layer returns.
        activation_bytes: bytes autograd saves for backward that this layer is the first to
            save, once per storage, parameters and buffers excluded. The layers run as one
            chain, so a tensor two neighbours both save (a Tanh's output that the next Linear
            saves as its input) counts once, for the Tanh: the entries add up.
        parameter_bytes: bytes of the layer's parameters.
        gradient_bytes: bytes of the gradients of its trainable parameters.
        optimizer_bytes: bytes of optimizer state for its trainable parameters.
        input_bytes: bytes of the tensors the layer receives (a stage starting here keeps them
            for its backward).
        saved_input_bytes: the part of ``activation_bytes`` that is the layer's own input.
        cpu: CPU seconds the calling thread spent on the layer's forward + backward:
            ``cpu / (forward + backward)`` is near 1 when the layer computes on the CPU (its
            intra-op threads busy alongside) and near 0 when it waits on an accelerator.
            (The calling thread only: idle OpenMP workers spin, which would count as work.)
        weight: the part of ``backward`` that is the weight gradient (what a zero-bubble W
            runs): backward time minus the input gradient alone. Measured only with
            ``profile(..., split_backward=True)``, else empty.
        deferred_bytes: what a zero-bubble B keeps for W from this layer: the gradients at
            its parameter forks (its input taking a gradient). Measured only with
            ``profile(..., split_backward=True)``, else empty.
        spread: how far the first quartile of the layer's repeats lay above the fastest, as
            a fraction (0.1: 10 % slower): the host's noise on this layer, which the planner
            turns into a range around each prediction. Empty where not measured.
    """

    names: list[str]
    forward: list[float]
    backward: list[float]
    output_bytes: list[int]
    activation_bytes: list[int]
    parameter_bytes: list[int]
    gradient_bytes: list[int]
    optimizer_bytes: list[int]
    input_bytes: list[int] = field(default_factory=list)
    saved_input_bytes: list[int] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)
    deferred_bytes: list[int] = field(default_factory=list)
    spread: list[float] = field(default_factory=list)

    @property
    def layers(self) -> int:
        """How many layers were profiled."""
        return len(self.names)

    def stage_activation_bytes(self, start: int, end: int) -> int:
        """What one micro-batch of a stage holding layers ``start..end-1`` keeps for backward.

        The stage input (the pipeline keeps it) plus every activation its layers save, each
        storage once: exactly what the runtime counts in ``Event.memory``.

        Args:
            start: the stage's first layer.
            end: one past its last layer.

        Returns:
            Bytes.

        Raises:
            ValueError: an empty or out-of-range layer span.
        """
        if not 0 <= start < end <= self.layers:
            raise ValueError(f"need 0 <= start < end <= {self.layers}, got {start=}, {end=}")
        saved = sum(self.activation_bytes[start:end])
        # NOTE: a first layer that saves its input (Linear) holds the stage input already.
        return self.input_bytes[start] + saved - self.saved_input_bytes[start]

    def costs(self, kind: str = "time") -> list[float]:
        """One cost per layer, ready for :func:`gpipe.balance.balance_costs`.

        Args:
            kind: ``"time"`` (forward + backward seconds), ``"memory"`` (bytes of parameters,
                gradients, optimizer state and saved activations of one micro-batch) or
                ``"params"`` (parameter bytes).

        Returns:
            A non-negative cost per layer.

        Raises:
            ValueError: an unknown ``kind``.
        """
        if kind == "time":
            return [f + b for f, b in zip(self.forward, self.backward)]
        if kind == "memory":
            parts = zip(
                self.parameter_bytes,
                self.gradient_bytes,
                self.optimizer_bytes,
                self.activation_bytes,
            )
            return [float(sum(layer)) for layer in parts]
        if kind == "params":
            return [float(size) for size in self.parameter_bytes]
        raise ValueError(f"kind must be one of {', '.join(map(repr, COST_KINDS))}, got {kind!r}")

    def __str__(self) -> str:
        header = ("layer", "forward", "backward", "output", "saved", "params", "optimizer")
        rows = [header]
        for i in range(self.layers):
            rows.append(
                (
                    f"{i} {self.names[i]}",
                    _format_seconds(self.forward[i]),
                    _format_seconds(self.backward[i]),
                    format_bytes(self.output_bytes[i]),
                    format_bytes(self.activation_bytes[i]),
                    format_bytes(self.parameter_bytes[i]),
                    format_bytes(self.optimizer_bytes[i]),
                )
            )
        rows.append(
            (
                "total",
                _format_seconds(sum(self.forward)),
                _format_seconds(sum(self.backward)),
                "",
                format_bytes(sum(self.activation_bytes)),
                format_bytes(sum(self.parameter_bytes)),
                format_bytes(sum(self.optimizer_bytes)),
            )
        )
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(width) if c == 0 else cell.rjust(width)
                for c, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in rows
        ]
        return "\n".join(lines)


def _format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
