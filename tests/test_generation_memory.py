"""The KV cache's size: predicted per stage from a one-row probe, equal to what a run holds,
and what fits beside each device's weights in a budget (``pipe.generation_fit``, ``gpipe plan
--generate``)."""

from __future__ import annotations

import pytest
import torch

import gpipe
from gpipe.cli import main
from gpipe.models.gpt import GPTConfig, gpt

CONFIG = GPTConfig(vocab=40, context=32, layers=4, heads=4, width=32, dropout=0.0)
FLOAT = 4


def _pipe() -> gpipe.GPipe:
    torch.manual_seed(0)
    return gpipe.GPipe(gpt(CONFIG).eval(), balance=[2, 2, 3], devices=["cpu"] * 3)


def test_the_predicted_cache_is_what_the_run_holds_on_every_stage() -> None:
    pipe = _pipe()
    pipe.generate(torch.zeros(5, 6, dtype=torch.long), max_new_tokens=7, lanes=3)
    stats = pipe.generation_stats
    # balance [2, 2, 3]: embedding + block, two blocks, block + norm + head; keys and values of
    # every block for 5 rows over the prompt and every token but the last
    per_block = 2 * 5 * CONFIG.width * (6 + 7 - 1) * FLOAT
    assert stats.cache_bytes == {0: per_block, 1: 2 * per_block, 2: per_block}
    assert stats.predicted_cache_bytes == stats.cache_bytes


def test_the_fit_counts_weights_and_the_cache_per_device() -> None:
    pipe = _pipe()
    length, rows = 20, 3
    budget = 300_000
    fits = pipe.generation_fit(budget, length=length, rows=rows)
    assert [f.device for f in fits] == [0, 1, 2]
    for fit, stage in zip(fits, pipe.partitions):
        weights = sum(t.numel() * t.element_size() for t in (*stage.parameters(), *stage.buffers()))
        blocks = sum(1 for layer in stage if hasattr(layer, "qkv"))
        per_token = 2 * CONFIG.width * FLOAT * blocks
        assert (fit.weights, fit.per_token, fit.budget) == (weights, per_token, budget)
        assert fit.rows == (budget - weights) // (per_token * length)
        assert fit.positions == (budget - weights) // (per_token * rows)
    assert pipe.generation_fit("1KiB", length=length)[0].rows == 0  # weights alone overflow


def test_a_fit_with_a_bad_length_names_it() -> None:
    with pytest.raises(ValueError, match="length must be >= 1"):
        _pipe().generation_fit(10**6, length=0)


def test_plan_says_what_fits_while_generating_in_the_best_layout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--stages", "2", "--memory-per-device", "64MB", "--generate", "24,4"]
    argv += ["--schedules", "gpipe", "--checkpoints", "never", "--chunks", "2"]
    assert main([*argv, "--repeats", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "generation in this layout, 24 positions a row, 4 row(s):" in out
    fields = dict(f.split("=") for f in out.strip().splitlines()[-1].split()[1:])
    assert int(fields["generate_rows_fit"]) > 0 and int(fields["generate_positions_fit"]) > 0


def test_plan_refuses_generate_without_a_budget(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--stages", "1", "--generate", "24", "--schedules", "gpipe"]
    assert main([*argv, "--checkpoints", "never", "--repeats", "1", "--no-progress"]) != 0
    assert "--generate needs --memory-per-device" in capsys.readouterr().err
