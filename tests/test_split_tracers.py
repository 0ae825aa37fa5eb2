"""torch.fx against torch.export (non-strict) on the models of split_models.py.

``python tests/test_split_tracers.py`` prints the table behind gpipe.split's choice of
torch.fx; the tests keep the claims the choice rests on true for this torch.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.testing import assert_close

import gpipe
from split_models import MODELS, make_gated, make_resnet
from test_split import loss_of

# Where each model is cut when gpipe.split runs it (any valid points would do).
POINTS = {
    "gpt (tied, mask kwarg)": ["h.1", "h.3"],
    "resnet (BatchNorm)": ["layers.1", "layers.3"],
    "unet (long skips)": ["down2", "bottom", "up2"],
    "encoder-decoder (2 in, 2 out)": ["encoder.1", "decoder.0"],
    "lstm": ["lstm", "head"],
    "data-dependent if": ["gate", "last"],
    "hf-style kwargs": ["h.1", "h.2"],
}


def _same_training(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], run: Callable[[], Any]
) -> bool:
    """Whether ``run()`` gives the model's output and puts its gradients (and running
    statistics) on the model's own tensors, as plain training does on a copy."""
    reference = copy.deepcopy(model)
    expected = reference(*args, **kwargs)
    loss_of(expected).backward()
    output = run()
    loss_of(output).backward()
    try:
        assert_close(output, expected)
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            if theirs.grad is None:
                assert mine.grad is None
            else:
                assert_close(mine.grad, theirs.grad)
        for mine, theirs in zip(model.buffers(), reference.buffers()):
            assert_close(mine, theirs)
    except AssertionError:
        return False
    return True


def _outcome(attempt: Callable[[], bool]) -> str:
    try:
        return "yes" if attempt() else "WRONG"
    except Exception as error:  # the measurement records any failure
        return f"no: {type(error).__name__}"


def _calls(graphs: list[fx.Graph]) -> str:
    """How many of the user's submodules the graphs call (export's guard function aside)."""
    return str(
        sum(
            1
            for graph in graphs
            for n in graph.nodes
            if n.op == "call_module" and n.target != "_guards_fn"
        )
    )


def measure_fx(name: str) -> dict[str, str]:
    """torch.fx's part of the row of ``name``: does it follow the model and train the
    user's own parameters (plain ``symbolic_trace``, and gpipe.split's tracer)?"""
    row = {"symbolic_trace": "-", "fx": "-", "fx + leaf": "-", "fx module calls": "-"}

    def by_symbolic_trace() -> bool:
        model, (args, kwargs) = MODELS[name]()
        traced = fx.symbolic_trace(model)
        return _same_training(model, args, kwargs, lambda: traced(*args, **kwargs))

    row["symbolic_trace"] = _outcome(by_symbolic_trace)

    def by_fx(leaves: list[str] | None) -> bool:
        model, (args, kwargs) = MODELS[name]()
        stages = gpipe.split(
            model, POINTS[name], example_inputs=args, example_kwargs=kwargs, leaf_modules=leaves
        )
        row["fx module calls"] = _calls([stage.graph for stage in stages])
        return _same_training(model, args, kwargs, lambda: stages(*args, **kwargs))

    row["fx"] = _outcome(lambda: by_fx(None))
    if name == "data-dependent if":
        row["fx + leaf"] = _outcome(lambda: by_fx([POINTS[name][0]]))
    return row


def measure_export(name: str) -> dict[str, str]:
    """torch.export's part of the row of ``name``."""
    row = {"export module calls": "-"}

    def by_export() -> bool:
        model, (args, kwargs) = MODELS[name]()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.export.export(model, args, kwargs, strict=False).module()
        row["export module calls"] = _calls([traced.graph])
        return _same_training(model, args, kwargs, lambda: traced(*args, **kwargs))

    row["export (non-strict)"] = _outcome(by_export)
    return row


def table() -> str:
    rows = {name: measure_fx(name) | measure_export(name) for name in MODELS}
    columns = list(next(iter(rows.values())))
    header = ["model", *columns]
    lines = [header, *([name, *(row[c] for c in columns)] for name, row in rows.items())]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join(
        " | ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_fx_splits_every_model_and_trains_the_users_own(name: str) -> None:
    row = measure_fx(name)
    wanted = "fx + leaf" if name == "data-dependent if" else "fx"
    assert row[wanted] == "yes"


def test_export_has_no_leaves_so_a_data_dependent_if_stops_it() -> None:
    model, ((x,), _) = make_gated()
    with pytest.raises(Exception, match=r"(?i)data.dependent|guard"):
        torch.export.export(model, (x,), strict=False)


def test_export_inlines_every_module_fx_keeps_batchnorm_a_call() -> None:
    model, ((x,), _) = make_resnet()
    program = torch.export.export(model, (x,), strict=False).module()
    assert _calls([program.graph]) == "0"
    stages = gpipe.split(model, ["layers.2"], example_inputs=(x,))
    assert stages[0].get_submodule("stem.1") is model.stem[1]  # the user's BatchNorm2d


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
