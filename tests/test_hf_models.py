"""Hugging Face models as they are: gpipe.split cuts them at any depth, the stages return
the model's own output type, and a pipe trains them as plain PyTorch does (float64)."""

from __future__ import annotations

import copy

import pytest
import torch

import gpipe
from hf_models import NAMES, build, case, loss

pytest.importorskip("transformers")


def _split(name: str, model: torch.nn.Module) -> gpipe.Stages:
    this = case(name)
    ids, kwargs = this.inputs()
    return gpipe.split(
        model,
        split_points=this.split_points,
        example_inputs=(ids,),
        example_kwargs=kwargs,
        leaf_modules=this.leaf_modules,
    )


@pytest.mark.parametrize("name", NAMES)
def test_split_stages_return_the_models_own_output(name: str) -> None:
    model = build(name).eval()
    stages = _split(name, model)
    ids, kwargs = case(name).inputs()
    expected, got = model(ids, **kwargs), stages(ids, **kwargs)
    assert type(got) is type(expected)
    assert torch.equal(got.logits, expected.logits)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", NAMES)
def test_a_pipe_trains_a_hugging_face_model_as_plain_pytorch_does(name: str, schedule: str) -> None:
    model = build(name)
    reference = copy.deepcopy(model)
    this = case(name)
    (ids, kwargs), target = this.inputs(), this.target()
    expected = loss(reference(ids, **kwargs), target)
    expected.backward()
    pipe = gpipe.GPipe(_split(name, model), chunks=2, schedule=schedule)
    got = pipe.train_step(ids, target, loss, kwargs=kwargs or None)
    assert float((got - expected.detach()).abs()) < 1e-12
    worst = 0.0
    for (param_name, param), theirs in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None, param_name
        worst = max(worst, float((param.grad - theirs.grad).abs().max()))
    assert worst < 1e-12, worst


def test_a_condition_on_the_batch_size_fails_loudly_for_another_batch_size() -> None:
    model = build("gpt2").eval()
    stages = _split("gpt2", model)  # traced with 4 samples: `batch_size != 1` held
    ids, _ = case("gpt2").inputs(batch=1)
    with pytest.raises(AssertionError, match="example inputs shaped like these"):
        stages(ids)
