"""Hand-built Stages for the routing tests (local and distributed): float64, seeded.

``unet``: four stages whose values do not flow in a chain:

    input x ──> 0 ──h──> 1 ──h──> 2 ──h──> 3 ──> output
    input mask ─────────> 1 ───────────────> 3          (an input several stages read)
                0 ──skip──────────> 2 ─────> 3          (a value two later stages read,
                                                         across 3 stages to stage 3)
                          1 ──side────────> 3
                0 ──n (int), tag (str), nothing (None)─> 2, 3

and stage 3's Linear is stage 0's Linear (a tied weight). ``unet(tied=False)`` unties them.
"""

from __future__ import annotations

import torch
from torch import nn

from gpipe.dataflow import INPUT, Dataflow, Stages

WIDTH = 4


class Down(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.skip = nn.Linear(WIDTH, WIDTH)

    def forward(self, values: dict) -> dict:
        x = values["x"]
        return {
            "h": torch.tanh(self.lin(x)),
            "skip": self.skip(x),
            "n": 3,
            "tag": "down",
            "nothing": None,
        }


class Masked(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, values: dict) -> dict:
        h = self.drop(torch.tanh(self.lin(values["h"]) * values["mask"]))
        return {"h": h, "side": h * 0.5}


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, values: dict) -> dict:
        assert isinstance(values["n"], int)
        h = self.lin(values["h"]) * values["n"]
        h.relu_()  # in place, on a value of its own
        return {"h": h + values["skip"]}


class Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, values: dict) -> torch.Tensor:
        assert values["tag"] == "down" and values["nothing"] is None
        return self.lin(values["h"] + values["skip"]) * values["mask"] + values["side"]


FLOW = Dataflow(
    ("x", "mask"),
    (
        (("x", INPUT),),
        (("h", 0), ("mask", INPUT)),
        (("h", 1), ("skip", 0), ("n", 0)),
        (
            ("h", 2),
            ("skip", 0),
            ("mask", INPUT),
            ("side", 1),
            ("tag", 0),
            ("nothing", 0),
        ),
    ),
)


def unet(*, tied: bool = True, dropout: float = 0.0, seed: int = 0) -> Stages:
    """The four-stage model pictured above, in float64."""
    torch.manual_seed(seed)
    down, up = Down(), Up()
    if tied:
        up.lin.weight = down.lin.weight
    stages = Stages([down, Masked(dropout), Middle(), up], FLOW, balance=[2, 1, 1, 1])
    return stages.double()


def batch(size: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (size, WIDTH), a mask (WIDTH,) the same for every sample, and a target."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)
    mask = torch.rand(WIDTH, generator=generator, dtype=torch.float64) + 0.5
    target = torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)
    return x, mask, target
