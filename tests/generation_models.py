"""Tiny Hugging Face decoders and left-padded prompts, for the tests of ``pipe.generate``.

Real ``transformers`` classes with random init (seeded), dropout off and no eos id of their
own, so Hugging Face's ``generate`` on the unsplit model is the reference a pipe must equal.
GPT-2 is drawn wider than its default init: at std 0.02 a tiny one repeats each row's last
token, which a decoder that mixed up positions or rows would repeat too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import gpipe

VOCAB = 97
HIDDEN = 32
PAD = 0
FAMILIES = ["gpt2", "llama", "qwen2", "mistral"]
# Mistral attends within a window shorter than prompt and answer together; Qwen2's last
# layers slide too, its first ones see every token (a window per layer).
WINDOW = 5


def causal_lm(family: str, dtype: torch.dtype = torch.float64, layers: int = 4) -> nn.Module:
    """A tiny ``family`` causal LM in ``dtype``, in eval mode, the same weights every call."""
    import transformers as hf

    hf.logging.set_verbosity_error()
    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model: Any
    if family == "gpt2":
        gpt2 = hf.GPT2Config(
            n_layer=layers, n_embd=HIDDEN, n_head=4, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1,
        )  # fmt: skip
        model = hf.GPT2LMHeadModel(gpt2)
    elif family == "llama":
        model = hf.LlamaForCausalLM(hf.LlamaConfig(**common))
    elif family == "qwen2":
        qwen2 = hf.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=layers // 2
        )
        model = hf.Qwen2ForCausalLM(qwen2)
    elif family == "mistral":
        model = hf.MistralForCausalLM(hf.MistralConfig(**common, sliding_window=WINDOW))
    else:
        raise ValueError(f"no tiny model for {family!r}")
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model.to(dtype).eval()


def layers_path(family: str) -> str:
    """Where ``family`` keeps its decoder layers."""
    return "transformer.h" if family == "gpt2" else "model.layers"


def prompts(rows: int = 8, length: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` left-padded prompts of different lengths (from ``length`` down to 2) and
    their mask; padding holds ``PAD``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(rows):
        mask[row, : row % (length - 1)] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def split_pipe(
    model: nn.Module, family: str, stages: int, ids: torch.Tensor, mask: torch.Tensor
) -> gpipe.GPipe:
    """``model`` cut by ``gpipe.split`` into ``stages`` stages of whole decoder layers."""
    count = len(list(model.get_submodule(layers_path(family)).children()))
    points = [f"{layers_path(family)}.{count * s // stages}" for s in range(1, stages)]
    example = {"input_ids": ids, "attention_mask": mask}
    return gpipe.GPipe(gpipe.split(model, points, example_inputs=example), chunks=1)


def hf_generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, **settings: Any) -> Any:
    """Hugging Face's ``generate`` on the unsplit model (padding ``PAD`` unless given)."""
    settings.setdefault("pad_token_id", PAD)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **settings)
