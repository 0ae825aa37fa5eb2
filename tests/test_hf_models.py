"""Hugging Face models as they are: gpipe.split cuts them at any depth, the stages return
the model's own output type, and a pipe trains them as plain PyTorch does (float64)."""

from __future__ import annotations

import copy

import pytest
import torch

import gpipe
from hf_models import NAMES, build, case, loss
from ranks import check, launch

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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_model_built_on_meta_and_initialized_by_its_own_init_weights_trains_as_built_normally(
    name: str,
) -> None:
    results = check(
        launch(
            "hf_scenarios:trains_like_plain",
            2,
            timeout=200,
            name=name,
            schedules=["1f1b"],
            meta=True,
        )
    )
    trained = [set(r["1f1b"]["trained"]) for r in results]
    assert trained[0] and trained[1]
    for result in results:
        assert result["1f1b"]["loss"] < 1e-12 and result["1f1b"]["grad"] < 1e-12, result


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name",
    ["gpt2", "t5"]
    + [pytest.param(n, marks=pytest.mark.slow) for n in ["llama", "bert", "mixtral"]],
)
def test_two_processes_train_a_hugging_face_model_as_plain_pytorch_does(name: str) -> None:
    schedules = ["gpipe", "1f1b"]
    results = check(
        launch(
            "hf_scenarios:trains_like_plain",
            2,
            timeout=250,
            name=name,
            schedules=schedules,
            meta=False,
        )
    )
    for schedule in schedules:
        trained = [set(r[schedule]["trained"]) for r in results]
        # each rank trains its own half; only a tied embedding is held by both
        assert trained[0] and trained[1] and len(trained[0] & trained[1]) <= 1
        for result in results:
            assert result[schedule]["loss"] < 1e-12 and result[schedule]["grad"] < 1e-12, result


def _t5_dropout_gradients(points: list[str], schedule: str, checkpoint: str) -> list:
    import transformers as hf

    torch.manual_seed(0)
    config = hf.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=16, d_kv=8, d_ff=32, num_heads=2,
        vocab_size=64, dropout_rate=0.3,
    )  # fmt: skip
    model = hf.T5ForConditionalGeneration(config).double()
    ids, kwargs = case("t5").inputs()
    stages = gpipe.split(model, points, example_inputs=(ids,), example_kwargs=kwargs)
    pipe = gpipe.GPipe(stages, chunks=2, schedule=schedule, checkpoint=checkpoint)
    torch.manual_seed(5)
    pipe.train_step(ids, case("t5").target(), loss, kwargs=kwargs)
    return [p.grad for p in model.parameters()]


def test_t5_draws_the_same_dropout_masks_under_every_layout() -> None:
    # T5Stack.dropout runs after the embedding and after the last block: two masks, kept
    # by every layout, schedule and checkpoint mode, cut at any depth
    expected = _t5_dropout_gradients(["decoder"], "gpipe", "never")
    for points, schedule, checkpoint in [
        (["encoder.block.1", "decoder", "decoder.block.1"], "zb-h1", "always"),
        (["encoder.block.1.layer.1", "decoder.final_layer_norm"], "1f1b", "except_last"),
    ]:
        got = _t5_dropout_gradients(points, schedule, checkpoint)
        worst = max(float((a - b).abs().max()) for a, b in zip(got, expected))
        # NOTE: the tied embedding's gradient is summed by two stages' workers in thread
        # order: equal to rounding
        assert worst < 1e-15, (points, schedule, checkpoint, worst)


@pytest.mark.timeout(300)
def test_a_meta_built_pipe_loads_safetensors_weights_by_name_and_consolidates_strictly(
    tmp_path,
) -> None:
    pytest.importorskip("safetensors")
    build("gpt2", seed=4).save_pretrained(tmp_path)  # stands in for downloaded weights
    results = check(
        launch(
            "hf_scenarios:loads_safetensors_into_a_meta_pipe", 2, timeout=250, folder=str(tmp_path)
        )
    )
    for result in results:
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, result
    assert results[0]["strict"] == "", results[0]["strict"]


def test_a_balance_counts_berts_blocks_two_levels_down() -> None:
    model = build("bert")
    ids, _ = case("bert").inputs()
    stages = gpipe.split(model, example_inputs=(ids,), balance=[3, 3])
    # units: bert.embeddings, bert.encoder.layer.0 ... layer.3, cls
    assert stages.balance == [3, 3]
    assert torch.equal(stages(ids).logits, model(ids).logits)


def test_a_model_with_gradient_checkpointing_on_is_told_the_pipe_replaces_it() -> None:
    import transformers as hf

    config = hf.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    model = hf.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 64, (2, 8))
    with pytest.warns(UserWarning, match=r"gradient checkpointing enabled.*checkpoint="):
        gpipe.split(model, ["transformer.h.1"], example_inputs=(ids,))
