"""Distributed generation runs, for test_generate_distributed.py (run by tests/ranks.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe
import gpipe.distributed as gd
from gpipe.models.gpt import GPTConfig, gpt, gpt_loss


def _hf(family: str, dtype: torch.dtype) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if family == "gpt2":
        config = tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=4, n_head=4, n_positions=64)
        return tf.GPT2LMHeadModel(config).to(dtype).eval()
    kinds = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }
    config_class, model_class = kinds[family]
    config = config_class(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return model_class(config).to(dtype).eval()


def _prompt(rows: int = 8, length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of different lengths
    mask[3, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _split(model: nn.Module, family: str, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    world = dist.get_world_size()
    layers = "transformer.h" if family == "gpt2" else "model.layers"
    points = [f"{layers}.{i}" for i in range(4 // world, 4, 4 // world)]
    return gpipe.split(model, points, example_inputs={"input_ids": ids, "attention_mask": mask})


def greedy_like_hf(
    families: list[str], dtype: str = "float64", tokens: int = 6, sampled: bool = False
) -> Any:
    """For each family and lanes in {1, K, 2K}: whether the greedy ids through a
    DistributedGPipe over every rank (the prompt given on rank 0 alone) equal HF's generate
    on the unsplit model; the byte counts of the last run; and with ``sampled``, what
    :func:`sampled_like_local` returns for lanes 1 and K."""
    world = dist.get_world_size()
    results: dict[str, Any] = {}
    for family in families:
        model = _hf(family, getattr(torch, dtype))
        ids, mask = _prompt()
        reference = model.generate(
            ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0
        )
        pipe = gd.DistributedGPipe(_split(model, family, ids, mask), chunks=1, timeout=30)
        given = ids if dist.get_rank() == 0 else None
        for lanes in (1, world, 2 * world):
            out = pipe.generate(given, mask, max_new_tokens=tokens, lanes=lanes, pad_token_id=0)
            results[f"{family}/{lanes}"] = torch.equal(out, reference)
        stats = pipe.generation_stats
        results[f"{family}/wire"] = {str(k): v for k, v in stats.wire_bytes.items()}
        results[f"{family}/cache"] = {str(k): v for k, v in stats.cache_bytes.items()}
        pipe.close()
    if sampled:
        results["sampled"] = sampled_like_local([1, world])
    return results


def sampled_like_local(lanes: list[int], tokens: int = 6) -> Any:
    """For each lane count: sampled ids through a DistributedGPipe with a seeded generator,
    twice, and through a local GPipe over the same stages with the same seed."""
    model = _hf("llama", torch.float64)
    ids, mask = _prompt()
    settings = dict(max_new_tokens=tokens, do_sample=True, top_k=20, top_p=0.9, temperature=0.8)

    def seeded() -> dict[str, Any]:
        return dict(generator=torch.Generator().manual_seed(5), **settings)

    # NOTE: the local pipe first: the distributed one frees the other ranks' layers to meta
    local = gpipe.GPipe(_split(model, "llama", ids, mask), chunks=1)
    expected = {count: local.generate(ids, mask, lanes=count, **seeded()) for count in lanes}
    local.close()
    pipe = gd.DistributedGPipe(_split(model, "llama", ids, mask), chunks=1, timeout=30)
    results = {}
    for count in lanes:
        runs = [pipe.generate(ids, mask, lanes=count, **seeded()) for _ in range(2)]
        results[str(count)] = {"expected": expected[count], "first": runs[0], "second": runs[1]}
    pipe.close()
    return results


def sequential_greedy(tokens: int = 8) -> Any:
    """Our nn.Sequential GPT across the ranks: greedy ids and a plain full-recompute loop."""
    torch.manual_seed(0)
    model = gpt(GPTConfig(vocab=50, context=32, layers=4, dropout=0.0)).double().eval()
    reference_state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(2))
    expected = ids
    with torch.no_grad():
        for _ in range(tokens):
            expected = torch.cat([expected, model(expected)[:, -1].argmax(-1, keepdim=True)], 1)
    pipe = gd.DistributedGPipe(model, chunks=2, timeout=30)
    out = pipe.generate(ids, max_new_tokens=tokens, lanes=2)
    # and training goes on in the same pipe: a step after generating is plain training's
    plain = gpt(GPTConfig(vocab=50, context=32, layers=4, dropout=0.0)).double()
    plain.load_state_dict(reference_state)
    x, y = expected[:, :-1], expected[:, 1:]
    gpt_loss(plain(x), y).backward()
    loss = pipe.train_step(x, y, gpt_loss)
    grads = {n: p.grad for n, p in model.named_parameters() if p.device.type != "meta"}
    worst = max(
        float((g - dict(plain.named_parameters())[n].grad).abs().max()) for n, g in grads.items()
    )
    pipe.close()
    return {
        "equal": torch.equal(out, expected),
        "loss": float(loss),
        "grad": worst,
        "checked": len(grads),
    }


class Raising(nn.Module):
    """Position-wise; raises on its ``fail_at``-th call on rank ``rank``."""

    position_wise = True

    def __init__(self, rank: int, fail_at: int) -> None:
        super().__init__()
        self.rank, self.fail_at, self.calls = rank, fail_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == self.fail_at:
            raise RuntimeError(f"boom while decoding on rank {self.rank}")
        return x


def fails_while_decoding(rank: int) -> Any:
    """A stage on ``rank`` raises in its third forward; every rank must end with the error."""
    torch.manual_seed(0)
    model = gpt(GPTConfig(vocab=50, context=32, layers=4, dropout=0.0)).eval()
    layers = list(model)
    layers.insert(4, Raising(rank, 3))
    pipe = gd.DistributedGPipe(nn.Sequential(*layers), chunks=1, timeout=20)
    pipe.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=6, lanes=2)
    return "not raised"


def different_settings() -> Any:
    """Rank 1 asks for another max_new_tokens: every rank must fail naming the fix."""
    torch.manual_seed(0)
    model = gpt(GPTConfig(vocab=50, context=32, layers=4, dropout=0.0)).eval()
    pipe = gd.DistributedGPipe(model, chunks=1, timeout=20)
    tokens = 4 if dist.get_rank() == 0 else 5
    pipe.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=tokens)
    return "not raised"
