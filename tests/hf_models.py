"""Tiny Hugging Face models as users build them, for the tests of gpipe.split on them.

Real ``transformers`` classes with random init, float64, dropout off (so a pipe must equal
plain training to round-off). Each case gives the model, the positional inputs of one
batch, where to split it (at any depth), and what to mark as a leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
NAMES = ["gpt2", "llama", "bert", "t5", "mixtral"]


@dataclass
class Case:
    build: Callable[[], nn.Module]
    split_points: list[str]
    decoder: bool = False  # encoder-decoder: decoder_input_ids by name
    leaf_modules: list[Any] = field(default_factory=list)

    def inputs(self, batch: int = 4, step: int = 0) -> tuple[torch.Tensor, dict[str, Any]]:
        """The input ids, the keyword inputs (decoder_input_ids), of one batch."""
        generator = torch.Generator().manual_seed(300 + step)
        ids = torch.randint(0, VOCAB, (batch, 8), generator=generator)
        if self.decoder:
            return ids, {
                "decoder_input_ids": torch.randint(0, VOCAB, (batch, 6), generator=generator)
            }
        return ids, {}

    def target(self, batch: int = 4, step: int = 0) -> torch.Tensor:
        ids, kwargs = self.inputs(batch, step)
        return torch.roll(kwargs.get("decoder_input_ids", ids), -1, dims=1)


def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a model output's logits against next tokens."""
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def case(name: str) -> Case:
    import transformers as hf

    hf.logging.set_verbosity_error()
    if name == "gpt2":
        gpt2 = hf.GPT2Config(
            n_layer=4, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return Case(lambda: hf.GPT2LMHeadModel(gpt2), ["transformer.h.2"])
    if name == "llama":
        llama = hf.LlamaConfig(
            num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32,
        )  # fmt: skip
        return Case(lambda: hf.LlamaForCausalLM(llama), ["model.layers.2"])
    if name == "bert":
        bert = hf.BertConfig(
            num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2,
            vocab_size=VOCAB, max_position_embeddings=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return Case(lambda: hf.BertForMaskedLM(bert), ["bert.encoder.layer.3.output"])
    if name == "t5":
        t5 = hf.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=16, d_kv=8, d_ff=32, num_heads=2,
            vocab_size=VOCAB, dropout_rate=0.0,
        )  # fmt: skip
        return Case(lambda: hf.T5ForConditionalGeneration(t5), ["decoder"], decoder=True)
    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        # NOTE: the default grouped_mm experts take no float64 on CPU; the eager loop
        # over experts is data-dependent Python, so it is a leaf
        mixtral = hf.MixtralConfig(
            num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=VOCAB, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=32, experts_implementation="eager",
        )  # fmt: skip
        return Case(
            lambda: hf.MixtralForCausalLM(mixtral),
            ["model.layers.1"],
            leaf_modules=[MixtralExperts],
        )
    raise ValueError(name)


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return case(name).build().double()
