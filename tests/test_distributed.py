"""The distributed runtime: real processes, gloo on 127.0.0.1, compared with plain PyTorch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from gpipe import GPipe
from gpipe.distributed.heartbeat import BEAT
from gpipe.planning.candidates import stages_per_device
from ranks import check, free_port, launch, run_script

pytestmark = pytest.mark.timeout(240)

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]
CHECKPOINTS = ["always", "except_last", "never"]


def assert_parity(results: list[dict]) -> None:
    keys = results[0].keys()
    for key in keys:
        for rank, result in enumerate(results):
            diffs = result[key]
            assert diffs["loss"] < 1e-12, (key, rank, diffs)
            assert diffs["grad"] < 1e-12, (key, rank, diffs)
            assert diffs["checked"] > 0, (key, rank, "this rank held no parameter")
        evals = [r[key]["eval"] for r in results]
        assert sorted(evals)[-1] < 1e-12 and evals.count(-1.0) == len(results) - 1, (key, evals)


def test_two_processes_equal_plain_training_for_every_schedule_and_checkpoint_mode() -> None:
    results = check(
        launch(
            "dist_scenarios:parity",
            2,
            schedules=SCHEDULES,
            checkpoints=CHECKPOINTS,
            chunks=[4, 1],
            batch=10,
        )
    )
    assert len(results[0]) == len(SCHEDULES) * len(CHECKPOINTS) * 2
    assert_parity(results)


@pytest.mark.parametrize("world", [2, 4])
def test_every_planned_layout_of_a_job_trains_like_plain_training(world: int) -> None:
    results = check(launch("dist_scenarios:planned_layouts", world))
    layouts = {key for key in results[0] if key != "refused"}
    # K stages x dp replicas = the job's processes, for every K that divides it
    expected = {f"K={k}/dp={world // k}" for k in range(1, world + 1) if world % k == 0}
    assert layouts == expected
    for result in results:
        for key in layouts:
            assert result[key]["loss"] < 1e-12 and result[key]["grad"] < 1e-12, (key, result)
            assert result[key]["checked"] > 0, key
        assert f"this job has {world}" in result["refused"]


def test_four_processes_equal_plain_training_with_fewer_or_uneven_microbatches() -> None:
    results = check(
        launch(
            "dist_scenarios:parity",
            4,
            schedules=SCHEDULES,
            checkpoints=["except_last"],
            chunks=[2, 6],
            batch=9,
        )
    )
    assert_parity(results)


@pytest.mark.parametrize("world", [2, 4])
def test_the_newest_schedules_equal_plain_training_across_processes(world: int) -> None:
    results = check(
        launch(
            "dist_scenarios:parity",
            world,
            schedules=[
                "zb-h2",
                "zb-v",
                "auto",
                "interleaved-zb",
                "looped-bfs",
                "v-half",
                "v-min",
                "dualpipev",
            ],
            checkpoints=CHECKPOINTS if world == 2 else ["except_last"],
            chunks=[4] if world == 2 else [8],
            batch=10,
        )
    )
    assert_parity(results)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_tuples_dicts_values_and_changing_shapes_cross_processes(schedule: str) -> None:
    results = check(launch("dist_scenarios:structures", 2, schedule=schedule))
    for key in results[0]:
        for rank, result in enumerate(results):
            assert result[key]["loss"] < 1e-12 and result[key]["grad"] < 1e-12, (key, rank)


def test_messages_of_several_tensors_go_as_one_batch_where_the_backend_batches() -> None:
    # NCCL's path (one batch_isend_irecv per message of several tensors), run on gloo
    results = check(launch("dist_scenarios:structures_batched", 2, schedule="1f1b"))
    for rank, result in enumerate(results):
        assert result["batches"] and max(result["batches"]) >= 2, (rank, result["batches"])
        for key, diffs in result["results"].items():
            assert diffs["loss"] < 1e-12 and diffs["grad"] < 1e-12, (key, rank, diffs)


def test_dropout_is_bitwise_the_local_pipes_under_two_balances() -> None:
    from dist_scenarios import WIDTH, mlp

    model = mlp(4, dropout=0.3)
    local = GPipe(model, [4, 8], devices=["cpu", "cpu"], chunks=4, schedule="1f1b")
    torch.manual_seed(7)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    y = torch.randn(8, WIDTH, dtype=torch.float64)
    local_loss = local.train_step(x, y, nn.functional.mse_loss)
    expected = {n: p.grad for n, p in model.named_parameters()}
    for balance in ([4, 8], [6, 6]):
        results = check(launch("dist_scenarios:dropout_bitwise", 2, balance=balance))
        for result in results:
            assert torch.equal(result["loss"], local_loss)
            for name, grad in result["grads"].items():
                assert torch.equal(grad, expected[name]), (balance, name)


NEW_SCHEDULES = ["interleaved-zb", "looped-bfs", "v-half", "v-min", "dualpipev"]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_newest_schedules_draw_dropout_as_the_local_pipe_does(world: int) -> None:
    # Every new schedule, in every checkpoint mode, with dropout: loss and every gradient
    # equal the local pipe's of the same schedule and layout, which the local tests hold to
    # plain training (4 ranks: in the slow tier; the fast one runs 4 ranks' parity above).
    from dist_scenarios import WIDTH, mlp

    checkpoints = CHECKPOINTS
    results = check(
        launch(
            "dist_scenarios:dropout_schedules",
            world,
            schedules=NEW_SCHEDULES,
            checkpoints=checkpoints,
        )
    )
    chunks = 2 * world
    for schedule in NEW_SCHEDULES:
        v = stages_per_device(schedule)
        for checkpoint in checkpoints:
            model = mlp(2 * world, dropout=0.3)
            local = GPipe(
                model,
                [6 // v] * (world * v),
                devices=["cpu"] * world,
                chunks=chunks,
                schedule=schedule,
                checkpoint=checkpoint,
                virtual_stages=v,
            )
            torch.manual_seed(7)
            x = torch.randn(2 * chunks, WIDTH, dtype=torch.float64)
            y = torch.randn(2 * chunks, WIDTH, dtype=torch.float64)
            local_loss = local.train_step(x, y, nn.functional.mse_loss)
            key = f"{schedule}/{checkpoint}"
            for rank, result in enumerate(results):
                got = result[key]
                assert (got["loss"] - local_loss).abs().max() < 1e-12, (key, rank)
                for name, grad in got["grads"].items():
                    expected = dict(model.named_parameters())[name].grad
                    assert (grad - expected).abs().max() < 1e-12, (key, rank, name)


def test_a_model_built_on_meta_trains_like_one_built_normally() -> None:
    results = check(launch("dist_scenarios:meta_init", 2))
    for result in results:
        assert result["diffs"]["loss"] < 1e-12 and result["diffs"]["grad"] < 1e-12
        assert sorted(set(result["devices"])) == ["cpu", "meta"]  # the other rank's layers


def test_a_rank_raising_ends_every_process_quickly_naming_it() -> None:
    outcomes = launch("dist_scenarios:fail_at", 3, timeout=60, rank=1, step=3)
    assert all(o.returncode == 1 for o in outcomes), [o.returncode for o in outcomes]
    assert "ValueError: boom on rank 1" in outcomes[1].error
    for o in (outcomes[0], outcomes[2]):
        assert "PipelineFailure" in o.error and "rank 1" in o.error, o.error
        # the failure says where in its own words, not twice
        assert "action 1" in o.error and "boom on rank 1 [seen by rank" in o.error, o.error
    spread = max(o.seconds for o in outcomes) - min(o.seconds for o in outcomes)
    assert spread < 10, [o.seconds for o in outcomes]


@pytest.mark.parametrize("case", ["none", pytest.param("short", marks=pytest.mark.slow)])
def test_a_bad_target_on_one_rank_ends_every_rank_at_once_naming_it(case: str) -> None:
    # the rank given the bad target raises before any message and lives on for 8 s: the
    # others must hear of it through the fault channel, not wait for its links to close
    outcomes = launch("dist_scenarios:bad_target_on_the_last_rank", 2, timeout=60, case=case)
    assert [o.returncode for o in outcomes] == [1, 1], [o.error for o in outcomes]
    cause = "target=None on rank 1" if case == "none" else "target has batch size 3"
    assert cause in outcomes[1].error, outcomes[1].error
    assert "PipelineFailure" in outcomes[0].error and cause in outcomes[0].error
    assert outcomes[0].seconds < outcomes[1].seconds - 4, [o.seconds for o in outcomes]


def test_a_new_pipe_after_a_failed_step_trains_like_plain_training() -> None:
    # the failed step left work posted on its process groups: a new pipe of the same layout
    # and timeout must not reuse them (it hung in its first step)
    results = check(launch("dist_scenarios:new_pipe_after_failure", 2, timeout=60))
    for result in results:
        assert "boom" in result["failed"]
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12 and result["checked"] > 0


def test_hand_launched_ranks_exit_with_status_1_after_a_failure() -> None:
    # plain processes, nothing killing the others and no os._exit: before, a thread left
    # waiting in gloo aborted each process as the interpreter finalized (exit 134)
    outcomes = run_script(str(Path(__file__).parent / "exit_job.py"), 2, timeout=90)
    codes, errors = [code for code, _ in outcomes], [error for _, error in outcomes]
    assert codes == [1, 1], errors
    assert "ValueError: boom on rank 1" in errors[1], errors[1][-2000:]
    assert "PipelineFailure" in errors[0] and "boom on rank 1" in errors[0], errors[0][-2000:]
    assert not any("terminate called" in e for e in errors), errors


@pytest.mark.parametrize("runs", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_hand_launched_ranks_of_a_healthy_zero_job_exit_with_status_0(runs: int) -> None:
    # before, the sending thread ended only as the interpreter finalized, dropping its last
    # gloo works there, which aborted the process (exit 134) in 4 runs of 6 with ZeRO
    script = str(Path(__file__).parent / "zero_exit_job.py")
    for _ in range(runs):
        outcomes = run_script(script, 4, timeout=90)
        codes, errors = [code for code, _ in outcomes], [error for _, error in outcomes]
        assert codes == [0, 0, 0, 0], [e[-6000:] for e in errors]


@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_a_rank_killed_or_interrupted_ends_the_others(how: str) -> None:
    outcomes = launch("dist_scenarios:stop_at", 3, timeout=60, rank=2, step=2, how=how)
    survivors = [outcomes[0], outcomes[1]]
    assert all(o.returncode == 1 for o in survivors), [o.returncode for o in outcomes]
    for o in survivors:
        assert "PipelineFailure" in o.error and "rank 2" in o.error, o.error
    if how == "interrupt":
        assert "KeyboardInterrupt" in outcomes[2].error
        assert all("interrupted (Ctrl-C or SIGINT)" in o.error for o in survivors)
    else:  # gloo's words, without its source line and advice
        for o in survivors:
            last = o.error.strip().splitlines()[-1]
            assert "lost its link to rank 2" in last and ".cc:" not in last, last
    assert max(o.seconds for o in survivors) - outcomes[2].seconds < 10


def test_a_lost_link_is_told_in_a_short_clause_naming_the_timeout() -> None:
    from gpipe.distributed.blame import _link_cause

    gloo = RuntimeError(
        "[/w/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2969: Connection reset by "
        "peer. This is typically caused by a remote worker hanging. GLHF!"
    )
    assert _link_cause(gloo, 5.0) == "Read error [127.0.0.1]:2969: Connection reset by peer"
    timed_out = RuntimeError("Application timeout caused pair closure")
    assert _link_cause(timed_out, 5.0).startswith("nothing came within the timeout of 5 s")


def test_the_link_is_measured_over_the_pipelines_group_and_agreed_by_every_rank() -> None:
    # NOTE: on GPUs that group is NCCL's and the pipe's device a GPU: the link the stages use
    results = check(launch("dist_scenarios:link", 2, timeout=60))
    assert results[0] == results[1]
    assert results[0]["pipeline_group"] and results[0]["device"] == "cpu"
    assert 0 < results[0]["latency"] < 1.0 and 1e5 < results[0]["bandwidth"] < float("inf")


def test_messages_a_gpu_stream_carries_are_timed_when_the_stream_had_them() -> None:
    """On NCCL the host only queues a message; its arrival is marked on the GPU's stream.
    A (fake) stream 50 ms behind the host moves each arrival 50 ms later on the timeline."""
    results = check(launch("dist_scenarios:gpu_timed_messages", 2, timeout=60))
    for result in results:
        assert result["marks"] > 0
    receiving = results[1]  # stage 1 is rank 1's: it receives every activation
    assert len(receiving["host"]) == len(receiving["gpu"]) == 4
    assert all(gap <= 0.001 for gap in receiving["host"]), receiving  # before its forward
    assert all(0.03 <= gap <= 0.051 for gap in receiving["gpu"]), receiving  # 50 ms less the hop


def test_the_timeline_read_on_one_rank_alone_fails_naming_the_fix() -> None:
    outcomes = launch("dist_scenarios:timeline_on_one_rank", 2, timeout=60)
    assert outcomes[1].returncode == 0, outcomes[1].error
    assert outcomes[0].returncode == 1
    assert "every rank of the pipeline must read pipe.timeline" in outcomes[0].error, outcomes[
        0
    ].error
    assert outcomes[0].seconds - outcomes[1].seconds < 4 + 10  # the pipe's 4 s timeout


@pytest.mark.slow
def test_a_hung_rank_ends_the_others_within_the_timeout() -> None:
    began = time.time()
    outcomes = launch(
        "dist_scenarios:stop_at",
        3,
        timeout=90,
        may_hang=(1,),
        rank=1,
        how="hang",
        step=2,
        timeout_s=10.0,
    )
    assert outcomes[1].returncode is None  # hung, then killed by the test
    hung_at = float(re.search(r"hanging at ([0-9.]+)", outcomes[1].stderr).group(1)) - began
    for o in (outcomes[0], outcomes[2]):
        assert o.returncode == 1 and "PipelineFailure" in o.error, o.error
        assert "rank 1" in o.error, o.error
        # the 10 s timeout, the wait for every rank to hear (a hung rank never says it
        # did: the whole grace, three beats + 2 s), and slack for a busy host
        grace = 3 * BEAT + 2.0
        assert o.seconds - hung_at < 10 + grace + 6, (o.seconds, hung_at)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("balance", "balance lists 3 stages but the job has 2 pipeline ranks"),
        ("too_many_stages", "launch at most 1 processes"),
        ("different_arguments", "chunks: rank 0 has 4, rank 1 has 8"),
        ("schedule", "use schedule='interleaved'"),
        ("unknown_schedule", "unknown schedule 'zigzag'"),
        ("wider_on_one_rank", "rank 0 has ['0.weight', [6, 6], 'float64']"),
        (
            "buffer_dtype",
            "rank 0 has ['0.scale', [3], 'float32'], rank 1 has ['0.scale', [3], 'float64']",
        ),
    ],
)
def test_bad_configurations_fail_on_every_rank_before_any_step(case: str, expected: str) -> None:
    results = check(launch("dist_scenarios:bad_config", 2, case=case))
    for result in results:
        assert expected in result["error"], result["error"]


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one per rank, NCCL)"
)
def test_nccl_ranks_on_their_own_gpus_equal_plain_training() -> None:
    # gd.init() takes NCCL and cuda:LOCAL_RANK when CUDA is present: the same scenario as
    # on CPU, with each rank's stage, messages and gradients on its own GPU
    results = check(
        launch(
            "dist_scenarios:parity",
            2,
            schedules=["gpipe", "1f1b", "zb-h1"],
            checkpoints=["except_last"],
            chunks=[4, 1],
            batch=8,
        )
    )
    assert_parity(results)


def test_schedule_and_checkpoint_set_between_steps_take_effect_on_every_rank() -> None:
    results = check(launch("dist_scenarios:settings_changed", 2, case="all"))
    for rank, result in enumerate(results):
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, (rank, result)
        assert result["ran"][0] == "gpipe", result
    # the last rank tells the schedules apart: GPipe runs F1 after F0 there, 1F1B runs B0
    assert results[1]["ran"][1] == ["F", "F"], results[1]["ran"]


def test_settings_that_differ_between_ranks_fail_every_rank_at_the_next_step() -> None:
    results = check(launch("dist_scenarios:settings_changed", 2, case="one"))
    for result in results:
        assert (
            "set pipe.schedule, pipe.checkpoint and pipe.chunks alike on every rank"
            in (result["error"])
        ), result


def test_bad_settings_are_refused_when_set() -> None:
    result = check(launch("dist_scenarios:settings_changed", 2, case="bad"))[0]
    assert "ValueError" in result["checkpoint='sometimes'"], result
    assert "TypeError" in result["schedule=3"], result
    assert "unknown schedule 'zigzag'" in result["schedule='zigzag'"], result
    assert result["kept"] == ["1f1b", "always"], result


def test_torchrun_launches_a_training_script_that_matches_plain_training(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(Path(__file__).parent / "torchrun_job.py"),
        str(tmp_path),
    ]
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["world"] == 2
        assert result["loss"] < 1e-12 and result["weight"] < 1e-12, result


@pytest.mark.parametrize("world", [2, 4])
def test_the_loss_and_norm_come_back_in_the_models_dtype_on_every_rank(world: int) -> None:
    # both were float64 on every rank for a float32 model, so assert_close against plain
    # training failed on dtype
    for result in check(launch("dist_scenarios:loss_dtype", world, dp=world // 2)):
        assert result["dtype"] == result["norm_dtype"] == "torch.float32", result
        assert result["diff"] < 1e-6 and result["norm_diff"] < 1e-5, result
