"""The Dataflow contract: which stage reads what, and the in-order reference run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe.dataflow import INPUT, Dataflow, Stages, run_in_order


class _Down(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, values: dict) -> dict:
        return {"h": torch.tanh(self.layer(values["x"])), "skip": values["x"]}


class _Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, values: dict) -> dict:
        return {"h": self.layer(values["h"])}


class _Up(nn.Module):
    def forward(self, values: dict) -> torch.Tensor:
        return values["h"] + values["skip"] * values["scale"]


FLOW = Dataflow(
    ("x", "scale"),
    ((("x", INPUT),), (("h", 0),), (("h", 1), ("skip", 0), ("scale", INPUT))),
)


def test_dataflow_lists_each_message_once_per_reader() -> None:
    assert FLOW.sends(0) == {1: ("h",), 2: ("skip",)}
    assert FLOW.receives(2) == {1: ("h",), 0: ("skip",), INPUT: ("scale",)}
    assert FLOW.gives(INPUT) == {"x": (0,), "scale": (2,)}
    assert FLOW.skips() == [(0, 2, ("skip",)), (INPUT, 2, ("scale",))]
    assert Dataflow.chain(3).skips() == []


def test_stages_run_in_order_equals_the_model_written_by_hand() -> None:
    torch.manual_seed(0)
    stages = Stages([_Down(), _Middle(), _Up()], FLOW, balance=[1, 1, 1])
    x = torch.randn(2, 4)
    down, middle = stages[0], stages[1]
    expected = middle.layer(torch.tanh(down.layer(x))) + 2.0 * x
    torch.testing.assert_close(stages(x, scale=2.0), expected)
    torch.testing.assert_close(run_in_order(list(stages), FLOW, {"x": x, "scale": 2.0}), expected)


@pytest.mark.parametrize(
    ("takes", "message"),
    [
        (((("x", 0),),), "reads only from earlier stages"),
        (((("x", INPUT), ("x", INPUT)),), "takes a name twice"),
        (((("y", INPUT),),), "not among the pipe's inputs"),
    ],
)
def test_a_dataflow_that_cannot_run_is_refused(takes: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Dataflow(("x",), takes)


def test_bind_names_the_missing_and_unknown_inputs() -> None:
    stages = Stages([_Down(), _Middle(), _Up()], FLOW)
    with pytest.raises(TypeError, match=r"missing.*'scale'"):
        stages.bind(torch.zeros(1, 4))
    with pytest.raises(TypeError, match="unknown input 'mask'"):
        stages.bind(torch.zeros(1, 4), scale=1.0, mask=None)


def test_a_stage_that_drops_a_name_a_later_stage_reads_is_named() -> None:
    class Forgets(nn.Module):
        def forward(self, values: dict) -> dict:
            return {"h": values["x"]}

    with pytest.raises(ValueError, match=r"stage 0 returned \['h'\].*\['h', 'skip'\]"):
        run_in_order([Forgets(), _Middle(), _Up()], FLOW, {"x": torch.zeros(1, 4), "scale": 1})
