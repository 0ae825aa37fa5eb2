"""Choosing the next token: greedy, warped sampling and stopping match Hugging Face's generate."""

from __future__ import annotations

import importlib.util
import math
import re
from typing import Any

import pytest
import torch

from gpipe.generation import Sampling, Stopping, next_tokens, warp

# The references are Hugging Face's own warpers and generate; the rest runs without them.
needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


def hf_warpers(temperature: float, top_k: int | None, top_p: float | None) -> Any:
    """The processors ``generate`` builds for these settings, in its order (no beams)."""
    from transformers.generation import logits_process as lp

    processors = lp.LogitsProcessorList()
    if temperature != 1.0:
        processors.append(lp.TemperatureLogitsWarper(float(temperature)))
    if top_k is not None:
        processors.append(lp.TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        processors.append(lp.TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return processors


def random_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random logits with some -inf entries (tokens a model has masked out), never a whole row."""
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=generator)).to(dtype)
    masked = torch.rand(rows, vocab, generator=generator) < 0.2
    masked[:, 0] = False
    return logits.masked_fill(masked, -math.inf)


def test_greedy_takes_the_argmax_and_ignores_the_warpers() -> None:
    logits = random_logits(16, 50, torch.float32)
    sampling = Sampling(max_new_tokens=1, temperature=0.0, top_k=1, top_p=0.01)
    assert torch.equal(next_tokens(logits, sampling), logits.argmax(dim=-1))


def test_greedy_ties_resolve_like_torch_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-math.inf, 0.0, 0.0, 0.0]])
    chosen = next_tokens(logits, Sampling(max_new_tokens=1))
    assert chosen.tolist() == logits.argmax(dim=-1).tolist() == [1, 0, 1]


SETTINGS = [
    (1.0, None, None),
    (0.7, None, None),
    (1.3, 5, None),
    (1.0, 1, None),
    (1.0, 10_000, None),  # top_k >= vocab keeps everything
    (1.0, None, 0.9),
    (1.0, None, 1.0),  # top_p = 1 keeps everything
    (1.0, None, 1e-6),  # keeps only the top token
    (1.0, None, 1e-9),  # below round-off: min_tokens_to_keep alone keeps the top token
    (0.5, 20, 0.8),
    (2.0, 3, 0.5),
]


@needs_hf
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("vocab", [1, 2, 7, 50, 1000])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_warp_equals_hugging_face_warpers(
    dtype: torch.dtype, vocab: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    logits = random_logits(8, vocab, dtype, seed=vocab)
    sampling = Sampling(
        max_new_tokens=1, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p
    )
    ours = warp(logits, sampling)
    theirs = hf_warpers(temperature, top_k, top_p)(None, logits.clone())
    assert ours.dtype == dtype
    assert torch.equal(ours, theirs)
    assert (ours > -math.inf).sum(dim=-1).min() >= 1


def test_top_k_and_top_p_keep_the_expected_tokens() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)
    probs = logits.exp()[0]
    # top-p 0.9 keeps the fewest top tokens holding >= 0.9 of the mass.
    need = int((probs.cumsum(0) < 0.9).sum()) + 1
    kept = warp(logits, Sampling(max_new_tokens=1, do_sample=True, top_p=0.9)) > -math.inf
    assert kept[0].tolist() == [i < need for i in range(5)]
    kept = warp(logits, Sampling(max_new_tokens=1, do_sample=True, top_k=2)) > -math.inf
    assert kept[0].tolist() == [True, True, False, False, False]
    # Four equal tokens: exactly 0.5 of the mass is reached with two, 0.75 with three.
    uniform = torch.zeros(1, 4)
    for top_p, count in [(0.5, 2), (0.75, 3), (0.76, 4)]:
        sampling = Sampling(max_new_tokens=1, do_sample=True, top_p=top_p)
        assert int((warp(uniform, sampling) > -math.inf).sum()) == count


def test_top_p_below_round_off_still_keeps_the_top_token() -> None:
    logits = random_logits(32, 100, torch.float32)
    scores = warp(logits, Sampling(max_new_tokens=1, do_sample=True, top_p=1e-9))
    kept = scores > -math.inf
    assert kept.sum(dim=-1).tolist() == [1] * 32
    assert torch.equal(kept.int().argmax(dim=-1), logits.argmax(dim=-1))


def test_seeded_draws_repeat_and_differ_across_seeds() -> None:
    logits = random_logits(64, 1000, torch.float32)
    sampling = Sampling(max_new_tokens=1, do_sample=True, temperature=1.5, top_p=0.95)

    def draw(seed: int) -> torch.Tensor:
        return next_tokens(logits, sampling, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))


@needs_hf
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_draws_equal_hugging_face_sample_step_under_the_same_seed(dtype: torch.dtype) -> None:
    settings = (0.8, 40, 0.9)
    sampling = Sampling(max_new_tokens=1, do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
    generator = torch.Generator().manual_seed(123)
    torch.manual_seed(123)
    for step in range(5):
        logits = random_logits(6, 300, dtype, seed=step)
        # GenerationMixin._sample: warp, softmax, one multinomial on the global stream.
        probs = torch.softmax(hf_warpers(*settings)(None, logits.clone()), dim=-1)
        theirs = torch.multinomial(probs, num_samples=1).squeeze(1)
        assert torch.equal(next_tokens(logits, sampling, generator), theirs)


# Upper 0.1 % points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@needs_hf
def test_draws_follow_the_warped_distribution() -> None:
    logits = torch.tensor([2.0, 1.6, 1.2, 0.8, 0.4, 0.0, -0.5, -1.0], dtype=torch.float64)
    settings = (0.7, 6, 0.95)
    sampling = Sampling(max_new_tokens=1, do_sample=True, temperature=0.7, top_k=6, top_p=0.95)
    draws = 40_000
    rows = logits.expand(draws, -1).contiguous()
    tokens = next_tokens(rows, sampling, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=8).double()

    probs = torch.softmax(hf_warpers(*settings)(None, logits[None].clone()), dim=-1)[0]
    kept = probs > 0
    assert 3 <= int(kept.sum()) < 8, "the settings must both keep and filter tokens"
    assert counts[~kept].sum() == 0, "a filtered token was drawn"
    bound = CHI2_999[int(kept.sum()) - 1]
    assert chi_square(counts[kept], probs[kept]) < bound
    # The test has power: the distribution without temperature (top-k/top-p alone) fails it.
    plain = Sampling(max_new_tokens=1, do_sample=True, top_k=6, top_p=0.95)
    wrong = torch.softmax(warp(logits[None], plain), dim=-1)[0]
    assert chi_square(counts[kept], wrong[kept] / wrong[kept].sum()) > 10 * bound


def test_a_row_stops_after_emitting_eos_and_then_emits_the_pad() -> None:
    stopping = Stopping(3, Sampling(max_new_tokens=10, eos_token_id=5))
    assert stopping.update(torch.tensor([5, 1, 2])).tolist() == [5, 1, 2]
    assert stopping.unfinished.tolist() == [False, True, True]
    assert not stopping.done
    # With no pad given, HF pads with the (first) eos id.
    assert stopping.update(torch.tensor([7, 5, 3])).tolist() == [5, 5, 3]
    assert stopping.unfinished.tolist() == [False, False, True]
    assert not stopping.done
    assert stopping.update(torch.tensor([1, 1, 5])).tolist() == [5, 5, 5]
    assert stopping.done
    assert stopping.steps == 3


def test_any_of_several_eos_ids_stops_a_row_and_the_pad_id_fills_it() -> None:
    sampling = Sampling(max_new_tokens=10, eos_token_id=[6, 5], pad_token_id=0)
    assert sampling.eos_token_ids == (6, 5) and sampling.pad_id == 0
    stopping = Stopping(4, sampling)
    assert stopping.update(torch.tensor([6, 5, 1, 2])).tolist() == [6, 5, 1, 2]
    assert stopping.update(torch.tensor([3, 3, 3, 3])).tolist() == [0, 0, 3, 3]
    assert stopping.unfinished.tolist() == [False, False, True, True]
    assert not stopping.done


def test_a_lane_is_done_after_max_new_tokens_without_eos() -> None:
    stopping = Stopping(2, Sampling(max_new_tokens=3, pad_token_id=0))
    for step in range(3):
        assert not stopping.done
        # Without an eos id no row finishes early, so nothing is padded.
        assert stopping.update(torch.tensor([step, 0])).tolist() == [step, 0]
    assert stopping.done
    assert stopping.unfinished.tolist() == [False, False]
    with pytest.raises(RuntimeError, match=re.escape("max_new_tokens=3")):
        stopping.update(torch.tensor([1, 1]))


def test_max_new_tokens_ends_rows_that_never_met_eos() -> None:
    stopping = Stopping(2, Sampling(max_new_tokens=2, eos_token_id=9))
    stopping.update(torch.tensor([9, 1]))
    assert not stopping.done
    assert stopping.update(torch.tensor([1, 1])).tolist() == [9, 1]
    assert stopping.done


def test_settings_are_hashable_and_equal_by_value() -> None:
    a = Sampling(max_new_tokens=4, do_sample=True, eos_token_id=[1, 2])
    b = Sampling(max_new_tokens=4, do_sample=True, eos_token_id=(1, 2))
    assert a == b and hash(a) == hash(b)
    assert (
        Sampling(max_new_tokens=1).eos_token_ids == () and Sampling(max_new_tokens=1).pad_id is None
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "shown"),
    [
        ({"max_new_tokens": 0}, ValueError, "got 0"),
        ({"max_new_tokens": 2.0}, TypeError, "got 2.0"),
        ({"do_sample": "yes"}, TypeError, "got 'yes'"),
        ({"do_sample": True, "temperature": 0.0}, ValueError, "do_sample=False"),
        ({"do_sample": True, "temperature": -1.0}, ValueError, "got -1.0"),
        ({"do_sample": True, "temperature": math.inf}, ValueError, "got inf"),
        ({"do_sample": True, "temperature": math.nan}, ValueError, "got nan"),
        ({"temperature": "hot"}, TypeError, "got 'hot'"),
        ({"top_k": 0}, ValueError, "top_k=None"),
        ({"top_k": 2.5}, TypeError, "got 2.5"),
        ({"top_k": True}, TypeError, "got True"),
        ({"top_p": 0.0}, ValueError, "got 0.0"),
        ({"top_p": 1.5}, ValueError, "got 1.5"),
        ({"top_p": math.nan}, ValueError, "got nan"),
        ({"top_p": "0.9"}, TypeError, "got '0.9'"),
        ({"eos_token_id": -1}, ValueError, "got -1"),
        ({"eos_token_id": [1, -2]}, ValueError, "got -2"),
        ({"eos_token_id": [1, 2.0]}, TypeError, "got 2.0"),
        ({"eos_token_id": "2"}, TypeError, "got '2'"),
        ({"eos_token_id": []}, ValueError, "pass None"),
        ({"pad_token_id": -3}, ValueError, "got -3"),
    ],
)
def test_bad_settings_name_the_value_and_the_fix(
    kwargs: dict[str, Any], error: type[Exception], shown: str
) -> None:
    with pytest.raises(error, match=re.escape(shown)):
        Sampling(**{"max_new_tokens": 1, **kwargs})


@pytest.mark.parametrize(
    "logits", [torch.zeros(4), torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long)]
)
def test_logits_must_be_a_float_matrix(logits: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=re.escape(str(tuple(logits.shape)))):
        next_tokens(logits, Sampling(max_new_tokens=1))


def tiny_gpt2() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


# The eos ids are ones these rows reach at different steps, so rows stop early one by one.
@needs_hf
@pytest.mark.parametrize(("do_sample", "eos"), [(False, [27, 12, 9]), (True, [3, 7, 11, 19])])
def test_decoding_loop_equals_hugging_face_generate(do_sample: bool, eos: list[int]) -> None:
    model, pad = tiny_gpt2(), 0
    prompt = torch.randint(0, 32, (4, 5), generator=torch.Generator().manual_seed(1))
    settings: dict[str, Any] = {
        "max_new_tokens": 24, "do_sample": do_sample, "temperature": 0.9, "top_k": 20,
        "top_p": 0.95, "eos_token_id": eos, "pad_token_id": pad,
    }  # fmt: skip
    torch.manual_seed(5)
    with torch.no_grad():
        mask = torch.ones_like(prompt)
        theirs = model.generate(prompt, attention_mask=mask, use_cache=False, **settings)

    sampling = Sampling(**settings)
    ids, stopping = prompt, Stopping(4, sampling)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        while not stopping.done:
            logits = model(ids).logits[:, -1].float()
            chosen = stopping.update(next_tokens(logits, sampling, generator))
            ids = torch.cat([ids, chosen[:, None]], dim=1)
    assert torch.equal(ids, theirs)
    # Every row met an eos, so the lane ended early; rows that met it sooner were padded.
    new = ids[:, 5:].tolist()
    assert len(new[0]) < 24
    stops = [next(i for i, token in enumerate(row) if token in eos) for row in new]
    assert all(row[stop + 1 :] == [pad] * (len(row) - stop - 1) for row, stop in zip(new, stops))
    assert len(set(stops)) > 1
