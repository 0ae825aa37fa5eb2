"""Models other than a plain chain under torch's engines, DDP and FSDP2 per stage, on
pp=2 x dp=2 (gloo): a gpipe.split model with a skip across stages, one built on the meta
device, and weights tied across ranks, each equal to plain training on the whole batch."""

from __future__ import annotations

import pytest

from meta_scenarios import Net
from ranks import check, launch

EXACT = 1e-12  # float64: only round-off may differ
ENGINES = ["ddp", "fsdp"]
CASES = ["split", "meta", "tied", "declared"]
CHAIN = {f"{i}.{kind}" for i in (0, 2, 4, 6) for kind in ("weight", "bias")}


@pytest.mark.timeout(120)
def test_split_meta_and_tied_models_train_like_plain_pytorch_under_ddp_and_fsdp() -> None:
    # loss, every gradient (before and after clipping), the clipped norm and the parameters
    # after two AdamW steps of pipe.make_optimizer, read from the user's own model
    runs = [[engine, case] for engine in ENGINES for case in CASES]
    results = check(launch("engine_model_scenarios:models", 4, runs=runs, timeout=100))
    for engine, case in runs:
        run = f"{engine} {case}"
        for rank, result in enumerate(results):
            diffs = result[run]
            for key in ("loss", "grad", "norm", "params"):
                assert diffs[key] < EXACT, (run, rank, key, diffs)
            assert diffs["sharded"] == float(engine == "fsdp"), (run, rank, diffs)
        # replica 1 (ranks 2, 3) trains what replica 0 does; together the stages train all
        first, second = (set(results[rank][run]["trained"]) for rank in (0, 1))
        assert [results[2][run]["trained"], results[3][run]["trained"]] == [
            results[0][run]["trained"],
            results[1][run]["trained"],
        ], run
        model = {n for n, _ in Net().named_parameters()} if case in ("split", "meta") else CHAIN
        assert first | second == model, (run, first, second)
        if case == "split":  # the residual input of block 1 crosses to stage 1
            assert "blocks.1.norm.weight" in first and "blocks.1.fc.weight" in second, run
    # a Parameter shared by stages on two ranks: each trains its copy of it
    assert "0.weight" in results[1]["ddp tied"]["trained"]


@pytest.mark.timeout(120)
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_parameter_two_stages_of_one_rank_use_is_refused_on_every_rank(engine: str) -> None:
    # interleaved: stages 0 and 2 on rank 0 share a weight; each stage's engine would
    # reduce (or shard) it on its own
    for error in check(launch("engine_model_scenarios:shared_on_one_rank", 4, engine=engine)):
        assert "two stages of one rank" in error, error
        assert f"data_parallel={engine!r}" in error, error
        assert "data_parallel='replicate'" in error, error
