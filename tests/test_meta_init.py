"""A split model built on the meta device trains from initialized weights, held by the
user's own modules, or refuses to train (2 processes, gloo, against plain PyTorch)."""

from __future__ import annotations

import pytest

import gpipe
from meta_scenarios import Block, Net, Norm, batch
from ranks import check, launch

pytestmark = pytest.mark.timeout(240)


def test_a_stage_holds_the_users_own_modules_where_fx_traced_into_them() -> None:
    model = Net().double()
    stages = gpipe.split(model, split_points=["blocks.2"], example_inputs=(batch()[0],))
    first, second = stages
    # the blocks whose norm reads self.weight are the user's, not torch.fx's bare modules
    assert isinstance(first.get_submodule("blocks.0"), Block)
    assert first.get_submodule("blocks.1.norm") is model.blocks[1].norm
    assert isinstance(second.get_submodule("blocks.3.norm"), Norm)
    # the model's own parameter is read by stage 0 through a stand-in, as the same tensor
    assert first.get_parameter("pos") is model.pos
    assert {id(p) for p in [*first.parameters(), *second.parameters()]} == {
        id(p) for p in model.parameters()
    }


def test_moving_a_stage_moves_the_users_model_with_it() -> None:
    model = Net().double()
    first, _ = gpipe.split(model, split_points=["blocks.2"], example_inputs=(batch()[0],))
    first.to_empty(device="cpu")
    # to_empty replaced every tensor of the stage; the user's modules hold the new ones
    assert first.get_parameter("pos") is model.pos
    assert first.get_parameter("blocks.0.norm.weight") is model.blocks[0].norm.weight


@pytest.mark.parametrize("split_points", [["blocks.2"], ["blocks.1.fc"]])
def test_a_split_model_built_on_meta_trains_like_one_built_normally(split_points) -> None:
    results = check(launch("meta_scenarios:trains_like_plain", 2, split_points=split_points))
    names = {n for n, _ in Net().named_parameters()}
    trained = [set(r["trained"]) for r in results]
    assert trained[0] | trained[1] == names and not trained[0] & trained[1]
    for result in results:
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, result
        assert result["pipe_lists_the_users_tensors"], result
    assert "blocks.0.norm.weight" in trained[0] and "blocks.3.norm.weight" in trained[1]
    # what rank 1 does not train, the model's own `pos` included, is freed to meta
    assert set(results[1]["frozen"]) == trained[0]


def test_a_rank_refuses_to_train_parameters_nothing_initialized() -> None:
    results = check(launch("meta_scenarios:refuses_unwritten", 2, how="nothing"))
    for result in results:
        error = result["error"]
        assert "ValueError" in error and "nothing initialized them" in error, error
        assert "init_fn" in error and "pipe.load" in error, error
    owner = results[0]["error"]  # rank 0's own message: its norms, by name
    assert "blocks.0.norm.weight, blocks.1.norm.weight" in owner, owner
    assert "blocks.2" not in owner.split("[")[0], owner


@pytest.mark.parametrize("how", ["copy", "load"])
def test_weights_written_before_the_first_step_count_as_initialized(how: str) -> None:
    results = check(launch("meta_scenarios:refuses_unwritten", 2, how=how))
    for result in results:
        assert result["error"] == "" and result["loss"] < 1e-12, result


def test_saving_an_optimizer_over_the_whole_model_names_the_fix() -> None:
    results = check(launch("meta_scenarios:save_with_whole_model_optimizer", 2))
    for result in results:
        assert "does not train" in result["error"], result
        assert "pipe.parameters()" in result["error"], result
