"""gpipe.split cuts real-shaped models into Stages that compute what the model computes,
with the user's own Parameters, values crossing several cuts sent straight to their reader."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils._pytree import tree_leaves

import gpipe
from gpipe.dataflow import INPUT, Stages
from gpipe.models.sleep import SleepLayer
from gpipe.split import SplitStage
from split_models import (
    Gate,
    make_encoder_decoder,
    make_gated,
    make_gpt,
    make_hf_style,
    make_lstm,
    make_resnet,
    make_unet,
)

CASES: dict[str, tuple[Callable[[], Any], list[str], dict[str, Any]]] = {
    "gpt": (make_gpt, ["h.1", "h.3"], {}),
    "gpt-4-stages": (make_gpt, ["h.1", "h.2", "ln_f"], {}),
    "resnet": (make_resnet, ["layers.1", "layers.3"], {}),
    "unet": (make_unet, ["down2", "bottom", "up2"], {}),
    "encoder-decoder": (make_encoder_decoder, ["encoder.1", "decoder.0", "decoder.1"], {}),
    "lstm": (make_lstm, ["lstm", "head"], {}),
    "gated-leaf": (make_gated, ["gate", "last"], {"leaf_modules": ["gate"]}),
    "hf-style": (make_hf_style, ["h.1", "h.2"], {}),
}


def loss_of(output: Any) -> torch.Tensor:
    """A loss touching every floating output, each element weighted differently."""
    total = torch.zeros((), dtype=torch.float64)
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            weights = torch.linspace(-1.0, 1.0, leaf.numel(), dtype=leaf.dtype)
            total = total + (leaf.reshape(-1) * weights).sum() + leaf.pow(2).sum()
    return total


def plain_gradients(model: nn.Module, args: Any, kwargs: Any) -> tuple[Any, list[torch.Tensor]]:
    """The output and every parameter's gradient of plain training, on a copy of ``model``."""
    reference = copy.deepcopy(model)
    output = reference(*args, **kwargs)
    loss_of(output).backward()
    return output, [p.grad for p in reference.parameters()]


@pytest.mark.parametrize("case", list(CASES))
def test_split_stages_compute_the_model_and_its_gradients(case: str) -> None:
    make, points, options = CASES[case]
    model, (args, kwargs) = make()
    expected, grads = plain_gradients(model, args, kwargs)

    stages = gpipe.split(model, points, example_inputs=args, example_kwargs=kwargs, **options)
    assert isinstance(stages, Stages) and len(stages) == len(points) + 1
    output = stages(*args, **kwargs)
    assert_close(output, expected)
    loss_of(output).backward()
    for (name, param), grad in zip(model.named_parameters(), grads):
        if grad is None:  # a branch the input did not take
            assert param.grad is None, name
        else:
            assert_close(param.grad, grad, msg=name)
    assert sum(p.grad is not None for p in model.parameters()) > len(grads) // 2


@pytest.mark.parametrize("case", list(CASES))
def test_split_stages_hold_the_users_own_parameters(case: str) -> None:
    make, points, options = CASES[case]
    model, (args, kwargs) = make()
    stages = gpipe.split(model, points, example_inputs=args, example_kwargs=kwargs, **options)
    held = {id(p) for stage in stages for p in stage.parameters()}
    assert held == {id(p) for p in model.parameters()}
    named = dict(model.named_parameters(remove_duplicate=False))
    for stage in stages:
        for name, param in stage.named_parameters(remove_duplicate=False):
            assert param is named[name], name  # under the user's own name


def test_split_tied_embedding_is_one_parameter_in_first_and_last_stage() -> None:
    model, (args, kwargs) = make_gpt()
    stages = gpipe.split(model, ["h.1", "h.3"], example_inputs=args, example_kwargs=kwargs)
    first, last = stages[0], stages[-1]
    assert first.wte.weight is last.lm_head.weight is model.wte.weight
    loss_of(stages(*args, **kwargs)).backward()
    assert model.h[3].mlp.c_fc.weight.grad is not None


def test_split_unet_long_skip_comes_straight_from_its_maker() -> None:
    model, (args, _) = make_unet()
    stages = gpipe.split(model, ["down2", "bottom", "up2"], example_inputs=args)
    flow = stages.dataflow
    # d1 (down1's output) is made by stage 0 and read by stage 3 only: no stage relays it
    (d1,) = [name for name, source in flow.takes[3] if source == 0]
    assert d1 == "down1_1"
    assert all(d1 not in dict(flow.takes[s]) for s in (1, 2))
    assert flow.sends(0) == {1: ("max_pool2d",), 3: ("down1_1",)}
    assert (0, 3, ("down1_1",)) in flow.skips()


def test_split_mask_kwarg_goes_from_the_input_to_every_stage() -> None:
    model, (args, kwargs) = make_gpt()
    stages = gpipe.split(model, ["h.1", "h.3"], example_inputs=args, example_kwargs=kwargs)
    assert stages.dataflow.inputs == ("idx", "mask")
    assert all(("mask", INPUT) in taken for taken in stages.dataflow.takes)


def test_split_takes_every_example_input_by_name_in_a_dict() -> None:
    model, (args, kwargs) = make_gpt()
    named = dict(zip(["idx"], args)) | kwargs
    stages = gpipe.split(model, ["h.1", "h.3"], example_inputs=named)
    assert stages.dataflow.inputs == ("idx", "mask")
    assert_close(stages(*args, **kwargs), model(*args, **kwargs))
    with pytest.raises(TypeError, match="already holds the keyword inputs"):
        gpipe.split(model, ["h.1"], example_inputs=named, example_kwargs=kwargs)


def test_split_kwarg_left_out_is_baked_in_as_its_default() -> None:
    model, (args, _) = make_gpt()
    stages = gpipe.split(model, ["h.2"], example_inputs=args)
    assert stages.dataflow.inputs == ("idx",)
    assert_close(stages(*args), model(*args))
    with pytest.raises(TypeError, match="unknown input 'mask'"):
        stages(*args, mask=torch.ones(1, 1, 8, 8))


def test_split_passes_non_tensor_values_along() -> None:
    class Shaped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, width = x.shape
            return self.b(self.a(x)).reshape(batch * width)

    model = Shaped().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    stages = gpipe.split(model, ["b"], example_inputs=(x,))
    crossing = stages[0]({"x": x})
    assert {type(v) for v in crossing.values()} == {int, torch.Tensor}
    assert_close(stages(x), model(x))


def test_split_balance_counts_units_and_positions_follow_the_model() -> None:
    model, (args, kwargs) = make_gpt()
    stages = gpipe.split(model, example_inputs=args, example_kwargs=kwargs, balance=[4, 3, 2])
    # units: wte, wpe, drop, h.0 | h.1, h.2, h.3 | ln_f, lm_head
    assert stages.balance == [4, 3, 2]
    # random streams: each run of a submodule's code, by name ("" is the model's own
    # forward; "#1" its second run, after wte and wpe), whatever the cuts
    assert stages[0].positions[:5] == ["", "wte", "wpe", "#1", "drop"]
    assert "h.0#1" in stages[0].positions and "h.3.mlp.c_fc" in stages[1].positions
    assert stages[2].positions == ["ln_f", "lm_head"]
    assert_close(stages(*args, **kwargs), model(*args, **kwargs))


def test_split_balance_by_time_and_memory_cut_around_the_heavy_unit() -> None:
    class Unit(nn.Module):
        def __init__(self, hidden: int, ms: float) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, hidden), nn.Linear(hidden, 8)
            self.sleep = SleepLayer(ms, ms)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.sleep(self.down(torch.tanh(self.up(x))))

    torch.manual_seed(0)
    sizes = [(8, 0.0), (8, 0.0), (4096, 40.0), (8, 0.0), (8, 0.0)]
    model = nn.Sequential(*(Unit(hidden, ms) for hidden, ms in sizes)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    for kind in ("time", "memory"):  # the third unit is the slowest and holds the most
        stages = gpipe.split(
            model, example_inputs=(x,), balance=kind, num_stages=3, leaf_modules=[SleepLayer]
        )
        assert stages.balance == [2, 1, 2], kind
        assert_close(stages(x), model(x))


def test_split_runs_each_run_of_a_modules_nodes_inside_its_layer_scope() -> None:
    model, (args, kwargs) = make_gpt()
    stages = gpipe.split(model, ["h.1", "h.3"], example_inputs=args, example_kwargs=kwargs)
    entered: list[str] = []

    class Scope:
        def __init__(self, position: str) -> None:
            entered.append(position)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    outputs = []
    for stage in stages:
        assert isinstance(stage, SplitStage)
        stage.layer_scope = Scope
    outputs.append(stages(*args, **kwargs))
    # each run once, in the model's order: the stages' streams, one after the other
    assert entered == [key for stage in stages for key in stage.positions]
    assert len(entered) == len(set(entered)) and entered[-2:] == ["ln_f", "lm_head"]
    assert_close(outputs[0], model(*args, **kwargs))


def test_split_leaf_type_keeps_data_dependent_control_flow_inside() -> None:
    model, (args, _) = make_gated()
    stages = gpipe.split(model, ["gate", "last"], example_inputs=args, leaf_modules=[Gate])
    for x in (args[0], -args[0].abs() * 10):  # both branches
        assert_close(stages(x), model(x))


def test_split_traces_a_mask_built_from_a_traced_length_with_varargs_sizes() -> None:
    """``torch.ones(t, t)`` with ``t = x.shape[1]``: plain torch.fx raises TypeError on it."""

    class Causal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            mask = torch.ones(t, t, dtype=x.dtype).tril() + torch.zeros(t, t, dtype=x.dtype)
            h = self.a(x)
            return self.b(mask @ h)

    torch.manual_seed(0)
    model = Causal().double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    stages = gpipe.split(model, ["b"], example_inputs=(x,))
    assert_close(stages(x), model(x))
    assert torch.ones(2, 3).shape == (2, 3)  # torch's own factory is put back


class _Flagged(nn.Module):
    """A forward steered by flags, as Hugging Face models are (``return_dict``, ``mask=None``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        return_dict: bool = False,
        repeat: int = 1,
        scale: float = 1.0,
    ) -> Any:
        h = self.a(x)
        if mask is not None:
            h = h * mask
        for _ in range(repeat):
            h = self.b(h)
        h = h * scale
        return {"h": h} if return_dict else h


def test_split_bakes_in_flags_the_example_call_gives_and_refuses_to_change_them() -> None:
    torch.manual_seed(0)
    model = _Flagged().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    flags = {"mask": None, "return_dict": True, "repeat": 2}
    stages = gpipe.split(model, ["b"], example_inputs=(x,), example_kwargs=flags | {"scale": 3.0})
    assert stages.dataflow.inputs == ("x", "scale")  # a float stays an input
    assert stages.constants == flags
    expected = model(x, **flags, scale=0.5)["h"]
    assert_close(stages(x, scale=0.5)["h"], expected)
    assert_close(stages(x, None, True, 2, 0.5)["h"], expected)  # positionally, as forward
    with pytest.raises(ValueError, match=r"traced with return_dict=True.*gpipe\.split again"):
        stages(x, return_dict=False, scale=0.5)


class _HFMask(nn.Module):
    """Builds its mask as Hugging Face models do: filled with torch.finfo(x.dtype).min."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 4), nn.BatchNorm1d(5), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        fill = torch.finfo(x.dtype).min
        mask = torch.full((t, t), fill, dtype=x.dtype, device=x.device).triu(1)
        h = self.norm(self.a(x))
        return self.b((h.transpose(1, 2) @ (mask.softmax(-1))).transpose(1, 2))


def test_split_traces_torch_finfo_of_a_traced_dtype_and_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = _HFMask().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    state = torch.random.get_rng_state()
    stages = gpipe.split(model, ["b"], example_inputs=(x,))
    for name, buffer in model.named_buffers():  # the example ran, but the stats did not move
        assert torch.equal(buffer, before[name]), name
    assert torch.equal(torch.random.get_rng_state(), state)
    model.eval()
    assert_close(stages(x), model(x))


def test_split_balance_counts_the_blocks_of_a_nested_module_list_as_units() -> None:
    """Hugging Face nests its blocks (GPT-2's ``transformer.h``): each block is a unit."""
    from gpipe.models import GPT2Config, gpt2

    model = gpt2(GPT2Config(n_layer=4), seed=0).double()
    idx = torch.randint(0, 64, (2, 8))
    stages = gpipe.split(model, balance=[4, 2, 3], example_inputs=(idx,))
    assert stages.balance == [4, 2, 3]  # wte, wpe, drop, h.0 | h.1, h.2 | h.3, ln_f, lm_head
    assert_close(stages(idx), model(idx))
    timed = gpipe.split(model, balance="time", num_stages=3, example_inputs=(idx,))
    assert len(timed) == 3 and sum(timed.balance) == 9


def test_a_compiled_model_is_refused_naming_compile_and_leaf_modules() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model.compile()  # compiles lazily: nothing runs until a call
    with pytest.raises(TypeError, match=r"compiled model.*block\.compile\(\).*leaf_modules"):
        gpipe.split(model, ["2"], example_inputs=(torch.randn(2, 4),))
