"""Scale-out: replicas of the pipeline, tied weights across ranks, clipping, checkpoints."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ranks import check, free_port, launch, run_all

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_two_replicas_of_a_two_stage_pipeline_train_as_plain_training_on_the_whole_batch(
    schedule: str,
) -> None:
    results = check(launch("scale_scenarios:replicas", 4, dp=2, schedule=schedule, zero=False))
    for result in results:
        worst = result["worst"]
        assert worst["loss"] < 1e-10 and worst["weight"] < 1e-10 and worst["norm"] < 1e-10, worst
        assert result["mesh"] == [[0, 1], [2, 3]]  # ("dp", "pp"): pipelines are rows


def test_zero_shards_optimizer_state_and_keeps_the_trajectory() -> None:
    results = check(launch("scale_scenarios:replicas", 4, dp=2, schedule="1f1b", zero=True))
    for result in results:
        assert result["zero"] == "ZeroRedundancyOptimizer"
        worst = result["worst"]
        assert worst["loss"] < 1e-10 and worst["weight"] < 1e-10, worst


def test_microbatch_weights_are_normalized_over_every_replica() -> None:
    for result in check(launch("scale_scenarios:padded_tokens", 4, dp=2)):
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, result


@pytest.mark.parametrize(
    ("world", "dp"), [(2, 1), pytest.param(4, 1, marks=pytest.mark.slow), (4, 2)]
)
def test_a_tied_embedding_and_head_train_as_plain_training_and_stay_identical(
    world: int, dp: int
) -> None:
    results = check(launch("scale_scenarios:tied", world, dp=dp))
    copies = {}
    for result in results:
        assert result["ties"] == 1
        assert result["loss"] < 1e-10 and result["weight"] < 1e-10, result
        copies.update({(n, i): t for i, (n, t) in enumerate(result["copies"].items())})
    held = list(copies.values())
    assert len(held) >= 2
    assert all(torch.equal(held[0], other) for other in held[1:])  # bitwise


def _resume(
    tmp_path: Path,
    first: tuple[int, list[int], int],
    then: tuple[int, list[int], int],
    zero: bool = False,
) -> None:
    path = str(tmp_path / "ckpt")
    whole = check(
        launch(
            "scale_scenarios:checkpointed",
            first[0],
            path=str(tmp_path / "x"),
            balance=first[1],
            dp=first[2],
            start=0,
            stop=6,
            save_at=None,
        )
    )
    check(
        launch(
            "scale_scenarios:checkpointed",
            first[0],
            path=path,
            balance=first[1],
            dp=first[2],
            start=0,
            stop=3,
            save_at=3,
            zero=zero,
        )
    )
    resumed = check(
        launch(
            "scale_scenarios:checkpointed",
            then[0],
            path=path,
            balance=then[1],
            dp=then[2],
            start=3,
            stop=6,
            save_at=None,
        )
    )
    expected = whole[0]["losses"][3:]
    for result in resumed:
        assert result["losses"] == pytest.approx(expected, rel=1e-10, abs=1e-12)


# NOTE: slow; in make test, a split model's checkpoint resumes on another layout (below)
@pytest.mark.slow
def test_resuming_on_half_the_ranks_continues_the_run_that_never_stopped(tmp_path: Path) -> None:
    _resume(tmp_path, (4, [2, 2, 2, 2], 1), (2, [4, 4], 1))


@pytest.mark.slow
def test_resuming_replicas_as_one_longer_pipeline_continues_the_run(tmp_path: Path) -> None:
    _resume(tmp_path, (4, [4, 4], 2), (4, [2, 2, 2, 2], 1))


@pytest.mark.slow
def test_a_checkpoint_of_sharded_optimizer_state_resumes_unsharded(tmp_path: Path) -> None:
    _resume(tmp_path, (4, [4, 4], 2), (4, [2, 2, 2, 2], 1), zero=True)


# NOTE: slow; in make test, test_checkpoint_crash cuts saves short and resumes bitwise
@pytest.mark.slow
def test_a_save_killed_halfway_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    outcomes = launch("scale_scenarios:killed_while_saving", 2, timeout=120, path=path)
    assert outcomes[1].returncode is not None and outcomes[1].returncode < 0  # killed
    for result in check(launch("scale_scenarios:reads", 2, path=path)):
        assert result["extra"]["step"] == 1


def test_loading_another_models_checkpoint_names_the_keys(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    check(
        launch(
            "scale_scenarios:checkpointed",
            2,
            path=path,
            balance=[4, 4],
            dp=1,
            start=0,
            stop=1,
            save_at=1,
        )
    )
    for result in check(launch("scale_scenarios:mismatched", 2, path=path)):
        assert "missing from the checkpoint: 8.bias, 8.weight" in result["error"], result
        assert "shapes differ" not in result["error"]


def test_consolidate_writes_one_state_dict_the_plain_model_loads(tmp_path: Path) -> None:
    import gpipe.distributed as gd
    from dist_scenarios import mlp

    path = tmp_path / "ckpt"
    check(
        launch(
            "scale_scenarios:checkpointed",
            2,
            path=str(path),
            balance=[4, 4],
            dp=1,
            start=0,
            stop=2,
            save_at=2,
        )
    )
    gd.consolidate(path, tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    model = mlp(4)
    model.load_state_dict(state)  # every key, every shape
    assert sorted(state) == sorted(model.state_dict())
    assert not torch.equal(state["0.weight"], mlp(4)[0].weight.detach())  # trained, not initial


@pytest.mark.slow
def test_two_torchrun_nodes_of_two_processes_train_as_plain_training(tmp_path: Path) -> None:
    port = free_port()
    script = Path(__file__).parent / "torchrun_job.py"
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", GPIPE_TEST_DP="2")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node-rank",
        "{node}",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "gpipe-test",
        str(script),
        str(tmp_path),
    ]
    nodes = run_all(
        [([arg.format(node=node) for arg in command], env) for node in range(2)], timeout=240
    )
    errors = [error for _, error in nodes]
    assert [code for code, _ in nodes] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    for rank in range(4):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["world"] == 4
        assert result["loss"] < 1e-10 and result["weight"] < 1e-10, result


def _plain_gpt_losses(steps: int) -> tuple[list[float], Any]:
    """Plain AdamW training of the split scenarios' GPT, in this process: losses and model."""
    from gpipe.models import GPT2Config, gpt2, gpt_loss
    from scale_scenarios import gpt_batch

    model = gpt2(GPT2Config(n_layer=4), seed=0).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        idx, target = gpt_batch(step)
        loss = gpt_loss(model(idx), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_a_split_models_checkpoint_is_keyed_by_its_own_names_and_resumes_on_another_split(
    tmp_path: Path,
) -> None:
    import gpipe.distributed as gd
    from gpipe.models import GPT2Config, gpt2

    path = str(tmp_path / "ckpt")
    saved = check(
        launch(
            "scale_scenarios:split_gpt",
            2,
            path=path,
            split_points=["transformer.h.2"],
            start=0,
            stop=2,
            save_at=2,
        )
    )
    resumed = check(
        launch(
            "scale_scenarios:split_gpt",
            3,
            path=path,
            split_points=["transformer.h.1", "transformer.h.3"],
            start=2,
            stop=4,
            save_at=None,
        )
    )
    expected, _ = _plain_gpt_losses(4)
    for result in saved + resumed:
        assert result["only_own"] and result["meta"] == 0, result  # this rank's parameters
    for result in saved:
        assert result["losses"] == pytest.approx(expected[:2], rel=1e-10, abs=1e-12)
    for result in resumed:
        assert result["losses"] == pytest.approx(expected[2:], rel=1e-10, abs=1e-12)

    gd.consolidate(path, tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    model = gpt2(GPT2Config(n_layer=4), seed=5).double()
    assert sorted(state) == sorted(model.state_dict())  # the model's own names, tie included
    model.load_state_dict(state)
    _, trained = _plain_gpt_losses(2)
    for name, tensor in trained.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-10, atol=1e-12)


def test_a_split_model_shards_its_optimizer_with_zero_and_trains_as_plain_training() -> None:
    results = check(
        launch(
            "scale_scenarios:split_gpt",
            4,
            path="",
            split_points=["transformer.h.2"],
            start=0,
            stop=2,
            save_at=None,
            dp=2,
            zero=True,
        )
    )
    expected, _ = _plain_gpt_losses(2)
    for result in results:
        assert result["only_own"] and result["meta"] == 0, result
        assert result["losses"] == pytest.approx(expected, rel=1e-10, abs=1e-12)
