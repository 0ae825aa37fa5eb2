"""``pipe.generate``: the tokens Hugging Face's ``generate`` (or a plain greedy loop) gives on
the unsplit model, with only hidden states crossing stages, and errors that name the fix."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import gpipe
from generation_models import (
    FAMILIES,
    HIDDEN,
    PAD,
    VOCAB,
    causal_lm,
    hf_generate,
    prompts,
    split_pipe,
)
from gpipe.models.gpt import GPTConfig, gpt

pytest.importorskip("transformers")

NEW = 8  # tokens each test generates


def greedy_loop(model: nn.Module, ids: torch.Tensor, new: int = NEW) -> torch.Tensor:
    """Plain greedy decoding: the whole sequence through the model for every token."""
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def tiny_gpt(layers: int = 4) -> nn.Sequential:
    """Our own nn.Sequential GPT, float64, in eval mode, the same weights every call.

    Its matrices are redrawn wider than GPT-2's init, at which a tiny random model decodes
    one token over and over, whatever the positions or the other rows.
    """
    torch.manual_seed(0)
    config = GPTConfig(vocab=VOCAB, context=32, layers=layers, heads=4, width=HIDDEN, dropout=0.0)
    model = gpt(config).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    return model


# -- the tokens -----------------------------------------------------------------------------


# Every family, stage count and lane count in float64; one float32 case per family.
@pytest.mark.parametrize(
    ("family", "dtype", "stages"),
    [(f, torch.float64, k) for f in FAMILIES for k in (2, 4)]
    + [(f, torch.float32, 2) for f in FAMILIES],
)
def test_greedy_ids_equal_hugging_face_generate_on_the_unsplit_model(
    family: str, dtype: torch.dtype, stages: int
) -> None:
    model = causal_lm(family, dtype)
    ids, mask = prompts()  # 8 rows left-padded to 7 tokens, from 7 real tokens down to 2
    expected = hf_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False)
    pipe = split_pipe(model, family, stages, ids, mask)
    for lanes in (1, stages, 2 * stages):
        got = pipe.generate(ids, mask, max_new_tokens=NEW, lanes=lanes, pad_token_id=PAD)
        assert torch.equal(got, expected), f"lanes={lanes}: {(got != expected).sum()} ids differ"
        assert pipe.generation_stats.lanes == lanes


@pytest.mark.parametrize(("family", "lanes"), [("gpt2", 3), ("llama", 1), ("llama", 4)])
def test_rows_stop_at_eos_and_are_padded_as_hugging_face_generate_does(
    family: str, lanes: int
) -> None:
    model = causal_lm(family)
    ids, mask = prompts()
    length = ids.shape[1]
    new = hf_generate(model, ids, mask, max_new_tokens=NEW, do_sample=False)[:, length:]
    # One eos the greedy rows reach (some rows stop early, the output keeps its length), and
    # each row's 3rd token as eos ids (every row stops by then, so the output is cut short).
    common = int(torch.mode(new[new != PAD]).values)
    everyone = sorted(set(new[:, 2].tolist()) - {PAD})
    pipe = split_pipe(model, family, 2, ids, mask)

    def both(eos: int | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        settings: dict[str, Any] = dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD)
        expected = hf_generate(model, ids, mask, do_sample=False, **settings)
        return pipe.generate(ids, mask, lanes=lanes, **settings), expected

    got, expected = both(common)
    assert torch.equal(got, expected)
    assert got.shape[1] == length + NEW  # some rows never met it
    assert (got[:, length:-1] == common).any()  # a row met it early, and was padded after
    got, expected = both(everyone)
    assert torch.equal(got, expected)
    assert got.shape[1] <= length + 3  # cut once every row stopped


# -- sampling -------------------------------------------------------------------------------

WARPED: dict[str, Any] = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_one_lane_samples_what_hugging_face_generate_samples_under_the_same_seed(
    family: str,
) -> None:
    model = causal_lm(family, torch.float32)
    ids, mask = prompts()
    torch.manual_seed(7)
    expected = hf_generate(model, ids, mask, max_new_tokens=NEW, **WARPED)
    pipe = split_pipe(model, family, 2, ids, mask)
    torch.manual_seed(7)
    got = pipe.generate(ids, mask, max_new_tokens=NEW, lanes=1, pad_token_id=PAD, **WARPED)
    assert torch.equal(got, expected)
    # The draws are not the greedy ids: the seed, not the argmax, decided them.
    assert not torch.equal(got, pipe.generate(ids, mask, max_new_tokens=NEW, lanes=1))


def test_several_lanes_sample_the_same_ids_from_the_same_seeded_generator() -> None:
    model = causal_lm("llama")
    ids, mask = prompts()
    pipe = split_pipe(model, "llama", 2, ids, mask)

    def sample(seed: int, global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        generator = torch.Generator().manual_seed(seed)
        return pipe.generate(ids, mask, max_new_tokens=NEW, lanes=4, generator=generator, **WARPED)

    first = sample(1, global_seed=5)
    assert torch.equal(sample(1, global_seed=6), first)  # torch's own stream plays no part
    assert not torch.equal(sample(2, global_seed=5), first)


# Upper 0.1 % points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {4: 18.467, 5: 20.515}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_first_sampled_token_follows_the_softmax_of_the_models_own_logits() -> None:
    model = causal_lm("llama")
    prompt = torch.tensor([[5, 17, 42, 8]])
    temperature, top_k, draws = 0.05, 6, 2000
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    top = logits.topk(top_k)
    probs = torch.softmax(top.values / temperature, dim=-1)
    assert float(probs.min()) * draws > 20, "every kept token must be expected often"

    pipe = split_pipe(model, "llama", 2, prompt, torch.ones_like(prompt))
    rows = prompt.expand(draws, -1).contiguous()
    generator = torch.Generator().manual_seed(0)
    tokens = pipe.generate(
        rows, max_new_tokens=1, do_sample=True, temperature=temperature, top_k=top_k, lanes=2,
        generator=generator,
    )  # fmt: skip
    counts = torch.bincount(tokens[:, -1], minlength=VOCAB).double()
    assert counts.sum() - counts[top.indices].sum() == 0, "a token outside the top-k was drawn"
    bound = CHI2_999[top_k - 1]
    assert chi_square(counts[top.indices], probs) < bound
    # The test has power: the distribution at twice the temperature fails it.
    wrong = torch.softmax(top.values / (2 * temperature), dim=-1)
    assert chi_square(counts[top.indices], wrong) > bound


# -- our own nn.Sequential GPT --------------------------------------------------------------


@pytest.mark.parametrize(("balance", "lanes"), [([4, 3], 1), ([4, 3], 2), ([3, 2, 2], 3)])
def test_our_sequential_gpt_decodes_the_ids_of_a_full_recompute_greedy_loop(
    balance: list[int], lanes: int
) -> None:
    model = tiny_gpt()
    ids = torch.randint(1, VOCAB, (4, 7), generator=torch.Generator().manual_seed(1))
    pipe = gpipe.GPipe(model, balance=balance, devices=["cpu"] * len(balance))
    got = pipe.generate(ids, max_new_tokens=NEW, lanes=lanes)
    assert torch.equal(got, greedy_loop(model, ids))


def test_a_left_padded_row_of_our_gpt_decodes_as_its_prompt_alone() -> None:
    model = tiny_gpt()
    ids, mask = prompts(rows=4)
    pipe = gpipe.GPipe(model, balance=[4, 3], devices=["cpu"] * 2)
    got = pipe.generate(ids, mask, max_new_tokens=NEW, lanes=2)
    for row in range(len(ids)):
        alone = ids[row : row + 1, mask[row] == 1]
        assert torch.equal(got[row, -NEW:], greedy_loop(model, alone)[0, -NEW:]), row


class CumulativeMean(nn.Module):
    """Mixes positions (each is the mean of those up to it) and keeps no cache."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)
        return x.cumsum(dim=1) / counts[:, None]


class Scale(nn.Module):
    """Works on each position alone and says so."""

    position_wise = True

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


@pytest.mark.parametrize(
    ("mixer", "name"),
    [(CumulativeMean(), "CumulativeMean"), (nn.MultiheadAttention(8, 2), "MultiheadAttention")],
)
def test_a_layer_that_mixes_positions_without_a_cache_is_refused_by_name(
    mixer: nn.Module, name: str
) -> None:
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 8), mixer, nn.Linear(8, VOCAB))
    pipe = gpipe.GPipe(model, balance=[2, 2], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match=rf"layer 2 \({name}\) has no forward_cached"):
        pipe.generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)


def test_layers_that_declare_themselves_position_wise_decode_as_the_full_model() -> None:
    blocks = list(tiny_gpt(layers=2))
    mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU())  # known layers, nested
    model = nn.Sequential(*blocks[:2], Scale(1.5), blocks[2], mlp.double(), *blocks[3:]).eval()
    ids = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    pipe = gpipe.GPipe(model, balance=[3, 4], devices=["cpu"] * 2)
    assert torch.equal(pipe.generate(ids, max_new_tokens=NEW), greedy_loop(model, ids))


# -- bad input ------------------------------------------------------------------------------

IDS = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
RIGHT_PADDED = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
ALL_PADDING = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])


@pytest.mark.parametrize(
    ("ids", "kwargs", "error", "match"),
    [
        (IDS.double(), {}, TypeError, "input_ids must be an integer tensor"),
        (IDS[0], {}, ValueError, r"add a batch dimension with input_ids\[None\]"),
        (IDS, {"attention_mask": torch.ones(3, 4)}, ValueError, "one mask entry per token"),
        (IDS, {"attention_mask": 2 * torch.ones_like(IDS)}, ValueError, "only 0"),
        (IDS, {"attention_mask": RIGHT_PADDED}, ValueError, "padding_side = 'left'"),
        (IDS, {"attention_mask": ALL_PADDING}, ValueError, "at least one token"),
        (IDS, {"lanes": 0}, ValueError, "give 1 to 3 lanes"),
        (IDS, {"lanes": 4}, ValueError, "give 1 to 3 lanes"),
        (IDS, {"lanes": True}, TypeError, "lanes must be an int or None"),
        (IDS, {"max_new_tokens": 0}, ValueError, "max_new_tokens must be an int >= 1"),
    ],
)
def test_bad_input_is_refused_naming_the_fix(
    ids: torch.Tensor, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    pipe = gpipe.GPipe(tiny_gpt(layers=2), balance=[2, 3], devices=["cpu"] * 2)
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=match):
        pipe.generate(ids, **kwargs)


def test_a_split_inside_a_decoder_layer_is_refused_naming_whole_layers() -> None:
    model = causal_lm("llama")
    ids, mask = prompts()
    example = {"input_ids": ids, "attention_mask": mask}
    pipe = gpipe.GPipe(gpipe.split(model, ["model.layers.1.mlp"], example_inputs=example))
    with pytest.raises(ValueError, match=r"model\.layers\.1 is cut.*whole decoder layers"):
        pipe.generate(ids, mask, max_new_tokens=2)


@pytest.mark.parametrize(
    ("family", "settings"),
    [
        ("Granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0}),
        ("Cohere", {"logit_scale": 0.0625}),
        ("Gemma2", {"final_logit_softcapping": 3.0}),
        ("Gemma3Text", {"final_logit_softcapping": 3.0}),
    ],
)
def test_a_look_alike_that_scales_outside_its_decoder_layers_samples_as_hugging_face(
    family: str, settings: dict[str, float]
) -> None:
    """Laid out as Llama, but their forward scales or caps the embeddings or logits outside
    the decoder layers: the stage programs do the same, so greedy ids and seeded draws are
    HF's own (Gemma 3 also keeps a rotary table per attention type)."""
    import transformers as hf

    config = getattr(hf, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, **settings,
    )  # fmt: skip
    causal = "Gemma3" if family == "Gemma3Text" else family
    torch.manual_seed(0)
    model = getattr(hf, f"{causal}ForCausalLM")(config).double().eval()
    ids, mask = prompts(rows=3)
    if family == "Gemma2":  # NOTE: HF's own eager Gemma 2 makes NaN logits on left padding
        mask = torch.ones_like(mask)
    example = {"input_ids": ids, "attention_mask": mask}
    pipe = gpipe.GPipe(gpipe.split(model, ["model.layers.1"], example_inputs=example))
    hf_settings = dict(max_new_tokens=5, pad_token_id=0, eos_token_id=None)
    for sampled in (False, True):
        torch.manual_seed(3)
        expected = model.generate(
            ids, attention_mask=mask, do_sample=sampled, top_k=None, **hf_settings
        )
        torch.manual_seed(3)
        ours = pipe.generate(
            ids, mask, do_sample=sampled, lanes=1, max_new_tokens=5, pad_token_id=0
        )
        assert ours.equal(expected), (family, sampled)


# -- what crosses stages and what stays ----------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "stages", "lanes"),
    [(torch.float64, 2, 1), (torch.float64, 4, 3), (torch.float32, 2, 2)],
)
def test_only_hidden_states_cross_stages_and_each_stage_caches_its_own_layers(
    dtype: torch.dtype, stages: int, lanes: int
) -> None:
    model = causal_lm("llama", dtype)  # 4 layers, 2 kv heads of 32 / 4 = 8 dims
    ids, mask = prompts()
    pipe = split_pipe(model, "llama", stages, ids, mask)
    pipe.generate(ids, mask, max_new_tokens=NEW, lanes=lanes)
    rows, length = ids.shape
    size = torch.finfo(dtype).bits // 8
    # The prompt's hidden states once, then one new token's per row for each later forward.
    sent = rows * length * HIDDEN * size + (NEW - 1) * rows * HIDDEN * size
    stats = pipe.generation_stats
    assert (stats.lanes, stats.tokens, stats.rows) == (lanes, NEW, rows)
    assert stats.wire_bytes == {s: sent for s in range(stages - 1)}
    layers, kv_heads, head_dim = 4 // stages, 2, HIDDEN // 4
    cached = 2 * layers * rows * kv_heads * head_dim * (length + NEW - 1) * size
    assert stats.cache_bytes == {s: cached for s in range(stages)}


def test_the_timeline_holds_one_forward_per_stage_lane_and_token() -> None:
    model, lanes, stages = tiny_gpt(), 2, 3
    pipe = gpipe.GPipe(model, balance=[3, 2, 2], devices=["cpu"] * stages)
    pipe.generate(IDS, max_new_tokens=NEW, lanes=lanes)
    events = pipe.generation_timeline.events
    assert len(events) == stages and all(events)
    ran = sorted((e.kind, e.stage, e.microbatch) for device in events for e in device)
    # Micro-batch i is token i // lanes of lane i % lanes.
    assert ran == sorted(itertools.product("F", range(stages), range(lanes * NEW)))
    assert all(e.stage == device for device, evs in enumerate(events) for e in evs)


def test_a_lanes_next_forward_starts_after_the_last_stage_chose_its_token() -> None:
    model, lanes, stages = tiny_gpt(), 2, 3
    pipe = gpipe.GPipe(model, balance=[3, 2, 2], devices=["cpu"] * stages)
    pipe.generate(IDS, max_new_tokens=NEW, lanes=lanes)
    pipe.close()
    ran = {(e.stage, e.microbatch): e for device in pipe.generation_timeline.events for e in device}
    early = [
        i for i in range(lanes * (NEW - 1)) if ran[(0, i + lanes)].start < ran[(stages - 1, i)].end
    ]
    assert not early, f"forwards of stage 0 that started before their token was chosen: {early}"


# -- failures -------------------------------------------------------------------------------


class FailsOnce(nn.Module):
    """Position-wise; raises on its ``fail_on``-th call only while ``armed``."""

    position_wise = True

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.fail_on, self.calls, self.armed = fail_on, 0, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.armed and self.calls == self.fail_on:
            raise RuntimeError("boom")
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_stage_that_raises_while_decoding_ends_generate_and_the_pipe_works_after(
    stage: int,
) -> None:
    blocks, failing = list(tiny_gpt(layers=3)), FailsOnce(fail_on=3)
    at = [1, 3, 5][stage]  # after the embedding, between two blocks, before the head
    model = nn.Sequential(*blocks[:at], failing, *blocks[at:])
    pipe = gpipe.GPipe(model, balance=[2, 2, 3], devices=["cpu"] * 3)
    # Its 3rd call is the lanes' 3rd forward on the stage: token 1 of lane 0, micro-batch 2.
    named = rf"boom .*in stage {stage}'s forward of micro-batch 2 while decoding"
    with pytest.raises(RuntimeError, match=named):
        pipe.generate(IDS, max_new_tokens=NEW, lanes=2)
    failing.armed = False
    assert torch.equal(pipe.generate(IDS, max_new_tokens=NEW, lanes=2), greedy_loop(model, IDS))
