"""gpipe.split refuses what it cannot cut with a message naming the value and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import gpipe
from gpipe.split import UntraceableError
from split_models import Gate, make_gated, make_gpt, make_hf_style


def test_data_dependent_if_names_the_operation_the_line_and_the_leaf_to_mark() -> None:
    model, (args, _) = make_gated()
    with pytest.raises(UntraceableError) as caught:
        gpipe.split(model, ["gate", "last"], example_inputs=args)
    message = str(caught.value)
    assert "used as a Python bool" in message
    assert "split_models.py:" in message and "`if x.sum() > 0:`" in message
    assert "submodule 'gate' (Gate)" in message
    assert "leaf_modules=['gate']" in message and "leaf_modules=[Gate]" in message
    assert caught.value.module == "gate"
    assert caught.value.line.endswith(f":{Gate.forward.__code__.co_firstlineno + 1}")


def test_leaf_modules_make_the_untraceable_model_split() -> None:
    model, (args, _) = make_gated()
    stages = gpipe.split(model, ["gate", "last"], example_inputs=args, leaf_modules=["gate"])
    assert_close(stages(*args), model(*args))
    assert stages[1].gate is model.gate


def test_untraceable_code_in_the_models_own_forward_says_to_move_it_into_a_leaf() -> None:
    class Looping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(int(x.shape[0])):  # a loop over a traced length
                x = self.a(x)
            return x

    with pytest.raises(UntraceableError, match="the model's own forward") as caught:
        gpipe.split(Looping(), ["a"], example_inputs=(torch.randn(2, 3),))
    assert "range(int(x.shape[0]))" in str(caught.value)
    assert "move that code into a submodule" in str(caught.value)


@pytest.mark.parametrize(
    ("points", "options", "match"),
    [
        (["h.9"], {}, r"'h.9' names no submodule of GPT.*did you mean 'h.3'"),
        (["h.3", "h.1"], {}, r"out of order: the model runs them as \['h.1', 'h.3'\]"),
        (["h.1", "h.1"], {}, "repeat"),
        (["wte"], {}, r"stage 0 would call no submodule.*drop split point 'wte'"),
        (["h.1.attn"], {"leaf_modules": ["h.1"]}, "inside the leaf module 'h.1'"),
        (["h.1.attn.c_attn.weight"], {}, "names no submodule"),
        (["h.1"], {"balance": [2, 2]}, "split_points or balance, not both"),
        (["h.1"], {"num_stages": 3}, "2 stages"),
        (None, {}, "needs split_points"),
        (None, {"balance": "time"}, "needs num_stages"),
        (None, {"balance": "speed", "num_stages": 2}, "'time' or 'memory'; got 'speed'"),
        (None, {"balance": [3, 3]}, r"add up to the model's 9 units.*'wte', 'wpe'"),
        (None, {"balance": "time", "num_stages": 10}, "ask for 1 to 9 stages"),
        (None, {"leaf_modules": ["h.7"]}, "leaf_modules names 'h.7'"),
        (["h.1"], {"devices": ["cpu"]}, "1 devices for 2 stages"),
    ],
)
def test_bad_split_arguments_are_refused_with_the_fix(
    points: list[str] | None, options: dict, match: str
) -> None:
    model, (args, kwargs) = make_gpt()
    with pytest.raises(ValueError, match=match):
        gpipe.split(model, points, example_inputs=args, example_kwargs=kwargs, **options)


def test_examples_that_do_not_fit_the_forward_are_a_type_error() -> None:
    model, (args, _) = make_hf_style()
    with pytest.raises(TypeError, match=r"do not fit HFStyle\.forward"):
        gpipe.split(model, ["h.1"], example_inputs=args, example_kwargs={"attn_mask": 1})
    with pytest.raises(TypeError, match=r"example_inputs=\(idx,\)"):
        gpipe.split(model, ["h.1"], example_inputs=args[0])
    with pytest.raises(TypeError, match=r"a list of names, e.g. \['h.1'\]"):
        gpipe.split(model, "h.1", example_inputs=args)  # type: ignore[arg-type]
