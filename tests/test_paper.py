"""The report's reproduction of the GPipe paper: its memory model and its speedups are right."""

from __future__ import annotations

import pytest
import torch

from gpipe.balance import profile
from gpipe.models import GPTConfig, gpt, gpt_loss
from gpipe.report.model_size import (
    check_memory,
    largest_model,
    meta_profile,
    repeat_blocks,
    transformer_profile,
)
from gpipe.report.paper import PAPER_MODEL
from gpipe.report.speedup import formula, measure_speedups, simulated_speedup

SMALL = GPTConfig(vocab=64, context=32, layers=2, heads=4, width=64, dropout=0.0)
GIB = 2**30


def test_a_model_built_on_meta_counts_the_bytes_a_real_one_saves() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, SMALL.vocab, (4, SMALL.context))
    real = profile(gpt(SMALL), ids, repeats=1, warmup=0)
    with torch.device("meta"):
        shadow = gpt(SMALL)
    counted = meta_profile(shadow, ids.to("meta"))
    assert counted.activation_bytes == real.activation_bytes
    assert counted.input_bytes == real.input_bytes
    assert counted.saved_input_bytes == real.saved_input_bytes
    assert counted.parameter_bytes == real.parameter_bytes


def test_blocks_repeated_from_two_are_the_profile_of_the_deeper_model() -> None:
    four = transformer_profile(SMALL, 2, 4)
    assert repeat_blocks(transformer_profile(SMALL, 2, 2), 4) == four


def test_the_memory_model_predicts_the_runtime_count_and_the_real_peak() -> None:
    # Without recomputation the activations dominate: the process's resident memory grows
    # by the prediction, give or take the allocator (measured 1.10-1.15).
    plain = check_memory(2, "never", context=64, batch=16)
    assert plain.predicted == plain.counted
    assert plain.rss is not None
    assert 0.9 < plain.rss / plain.expected < 1.35, (plain.rss, plain.expected)
    # With it, the backward's working memory comes on top (measured 1.57-1.64), never less.
    again = check_memory(1, "always", context=64, batch=16)
    for predicted, counted in zip(again.predicted, again.counted):
        assert abs(predicted - counted) <= 16 * 64 // 4 * 8  # one micro-batch of token ids
    assert again.rss is not None
    assert 0.95 < again.rss / again.expected < 2.2, (again.rss, again.expected)


def test_the_largest_model_grows_with_the_devices() -> None:
    micro = transformer_profile(PAPER_MODEL, 1, 2)
    fits = [largest_model(micro, k, 16 * GIB, 32, "always") for k in (1, 2, 4, 8, 32)]
    blocks = [f.blocks for f in fits]
    assert blocks == sorted(set(blocks)), blocks  # strictly more with every K
    # once the embedding and head are a small share, K devices hold about K times as many
    assert fits[-1].blocks / fits[2].blocks == pytest.approx(8, rel=0.05)
    assert all(f.peak <= 16 * GIB for f in fits)
    naive = largest_model(transformer_profile(PAPER_MODEL, 32, 2), 1, 16 * GIB, 1, "never")
    assert naive.blocks < fits[0].blocks
    # the paper's Naive-1 has 3 such blocks and 282.2M parameters; ours fits 2 (flash
    # attention keeps less, but the whole batch's float32 activations still fill the device)
    assert 50.3e6 < (fits[1].parameters - fits[0].parameters) / (blocks[1] - blocks[0]) < 50.4e6


def test_the_simulator_with_free_actions_is_the_formula() -> None:
    for k, m in [(2, 1), (4, 4), (8, 32), (64, 32)]:
        assert simulated_speedup(k, m, 8.0, 16.0) == pytest.approx(formula(k, m))
    assert formula(2, 1) == 1.0  # the paper's normalization point


def test_sleeping_stages_speed_up_as_the_formula_and_the_simulator_say() -> None:
    measured, overhead = measure_speedups((4,), (8,), 32.0, 64.0, steps=2)
    # stages of 8 + 16 ms: the runtime's own cost per action (0.1-1.2 ms here) is small
    assert measured[(4, 8)] == pytest.approx(formula(4, 8), rel=0.15)
    simulated = simulated_speedup(4, 8, 32.0, 64.0, overhead_ms=overhead)
    assert measured[(4, 8)] == pytest.approx(simulated, rel=0.1)
    assert 0 <= overhead < 5


def test_the_loss_counts_with_the_last_layer() -> None:
    ids = torch.zeros(2, SMALL.context, dtype=torch.long, device="meta")
    with torch.device("meta"):
        model = gpt(SMALL)
    alone = meta_profile(model, ids)
    with_loss = meta_profile(model, ids, target=ids, loss_fn=gpt_loss)
    logits = 2 * SMALL.context * SMALL.vocab * 4
    assert with_loss.activation_bytes[:-1] == alone.activation_bytes[:-1]
    # cross-entropy keeps its log-softmax (the size of the logits), the targets and the
    # float32 total weight of its mean
    targets = 2 * SMALL.context * 8
    assert with_loss.activation_bytes[-1] - alone.activation_bytes[-1] == logits + targets + 4
