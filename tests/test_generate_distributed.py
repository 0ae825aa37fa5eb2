"""Generation across processes (gloo on 127.0.0.1, under NCCL's ordering rules): greedy ids
equal Hugging Face's generate, sampling is the local pipe's, only hidden states cross ranks,
and a failure while decoding ends every rank naming it."""

from __future__ import annotations

import pytest

from ranks import check, launch

pytestmark = [pytest.mark.timeout(240)]

ROWS, LENGTH, TOKENS, HIDDEN, DOUBLE = 8, 7, 6, 32, 8


def _hidden_bytes(rows: int = ROWS) -> int:
    """What one stage sends the next over a run: the prompt's hidden states, then one
    token's for every row in each later forward (float64)."""
    return rows * LENGTH * HIDDEN * DOUBLE + (TOKENS - 1) * rows * HIDDEN * DOUBLE


def test_two_ranks_generate_every_family_as_hugging_face_and_the_local_pipe_do() -> None:
    pytest.importorskip("transformers")
    families = ["gpt2", "llama", "qwen2", "mistral"]
    launched = launch("generation_scenarios:greedy_like_hf", 2, families=families, sampled=True)
    results = check(launched)
    for result in results:  # every rank returns the ids
        for family in families:
            assert [result[f"{family}/{lanes}"] for lanes in (1, 2, 4)] == [True] * 3, family
            # no KV bytes on the wire: stage 0 sent stage 1 hidden states alone
            assert result[f"{family}/wire"] == {"0": _hidden_bytes()}, family
        # sampling draws on the last stage what the local pipe draws, run after run
        for lanes, runs in result["sampled"].items():
            assert runs["first"].equal(runs["expected"]), lanes
            assert runs["second"].equal(runs["expected"]), lanes
    # Llama's cache: 2 layers a stage, keys and values of 2 heads of 8, every position
    llama = results[0]["llama/cache"]
    assert llama == {s: 2 * 2 * ROWS * 2 * 8 * (LENGTH + TOKENS - 1) * DOUBLE for s in "01"}


def test_four_ranks_generate_greedily_as_hugging_face_does_in_float32() -> None:
    pytest.importorskip("transformers")
    results = check(
        launch("generation_scenarios:greedy_like_hf", 4, families=["llama"], dtype="float32")
    )
    for result in results:
        assert [result[f"llama/{lanes}"] for lanes in (1, 4, 8)] == [True] * 3
        assert result["llama/wire"] == {str(s): _hidden_bytes() // 2 for s in range(3)}


def test_a_sequential_model_generates_across_ranks_as_a_plain_loop_then_trains_on() -> None:
    results = check(launch("generation_scenarios:sequential_greedy", 2))
    assert [r["equal"] for r in results] == [True, True]
    for result in results:  # a training step after generating: plain training's gradients
        assert result["grad"] < 1e-12 and result["checked"] > 0, result
    assert results[0]["loss"] == results[1]["loss"]


def test_a_stage_that_raises_while_decoding_ends_every_rank_naming_it() -> None:
    outcomes = launch("generation_scenarios:fails_while_decoding", 2, timeout=90, rank=1)
    assert [o.returncode for o in outcomes] == [1, 1], [o.error[-2000:] for o in outcomes]
    assert "RuntimeError: boom while decoding on rank 1" in outcomes[1].error
    assert "PipelineFailure" in outcomes[0].error, outcomes[0].error[-2000:]
    assert "rank 1" in outcomes[0].error and "boom while decoding" in outcomes[0].error


def test_ranks_that_ask_for_different_settings_all_fail_naming_the_fix() -> None:
    outcomes = launch("generation_scenarios:different_settings", 2, timeout=90)
    assert [o.returncode for o in outcomes] == [1, 1], [o.error[-2000:] for o in outcomes]
    for outcome in outcomes:
        assert "give every rank the same settings" in outcome.error, outcome.error[-2000:]
