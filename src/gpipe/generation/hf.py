"""Decoding a Hugging Face causal LM that ``gpipe.split`` cut: each stage calls its own
decoder layers with a stage-local cache.

Why a stage-side cache and not a split that carries one: the traced stages run the model
with ``use_cache=False`` and inline each decoder layer into fx nodes, and a cache carried
through the graph would be a Python object that HF mutates in place, which a trace cannot
follow and which would have to cross stage boundaries. Here each stage instead calls the
user's own decoder layer modules (the ones its traced graph trains, so the same weights) with
a :class:`~gpipe.generation.cache.StageCache` that holds only its own layers, and works out
positions, rotary embeddings and the mask itself (:class:`~gpipe.generation.cache.DecodeStep`).
Only hidden states cross a stage boundary.

Two families are known: decoders with rotary embeddings laid out as Llama (``model.embed_tokens``,
``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``: Llama, Qwen2, Mistral
and the many models that copy them) and GPT-2 (``transformer.wte``, ``wpe``, ``h``, ``ln_f``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.generation.cache import DecodeStep, StageCache
from gpipe.generation.programs import StageProgram

__all__ = ["hf_programs", "is_hf_causal_lm"]


@dataclass(frozen=True)
class _Layout:
    """Where a family keeps its parts, as paths in the model."""

    layers: str
    embed: str
    norm: str
    rotary: str | None = None
    positions: str | None = None  # learned position embeddings (GPT-2's wpe)
    dropout: str | None = None


_LLAMA = _Layout(layers="model.layers", embed="model.embed_tokens", norm="model.norm",
                 rotary="model.rotary_emb")  # fmt: skip
_GPT2 = _Layout(layers="transformer.h", embed="transformer.wte", norm="transformer.ln_f",
                positions="transformer.wpe", dropout="transformer.drop")  # fmt: skip


# Settings with which a look-alike of Llama scales or caps outside its decoder layers, each
# with the value at which it changes nothing; a stage program applies them as its forward
# does (Granite, Cohere, Gemma 2 and 3), so ids and draws stay the model's own.
_OUTSIDE_LAYERS: dict[str, float | None] = {
    "embedding_multiplier": 1.0,  # Granite scales the embeddings
    "logits_scaling": 1.0,  # Granite divides the logits
    "logit_scale": 1.0,  # Cohere multiplies them
    "final_logit_softcapping": None,  # Gemma 2 and 3 cap them
}


def _outside(config: Any) -> dict[str, float]:
    """The settings of ``config`` that change what its forward does outside the layers."""
    found = {}
    for name, neutral in _OUTSIDE_LAYERS.items():
        value = getattr(config, name, neutral)
        if value != neutral and value is not None:
            found[name] = value
    return found


def _layout_of(model: nn.Module) -> _Layout | None:
    for layout in (_LLAMA, _GPT2):
        try:
            for path in (layout.layers, layout.embed, layout.norm, "lm_head"):
                model.get_submodule(path)
        except AttributeError:
            continue
        return layout
    return None


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal LM of a family this module decodes."""
    return hasattr(model, "config") and _layout_of(model) is not None


def _cache_keyword(layer: nn.Module) -> str:
    """The name a decoder layer takes its cache by (``cache`` in transformers >= 5.2)."""
    parameters = inspect.signature(layer.forward).parameters
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if name in parameters:
            return name
    raise TypeError(f"{type(layer).__name__}.forward takes no cache argument")


def _held(stage: nn.Module, source: nn.Module, path: str) -> nn.Module:
    """The module at ``path`` as the stage holds it (on its device), else the user's."""
    own = source.get_submodule(path)
    try:
        held = stage.get_submodule(path)
    except AttributeError:
        return own
    return held if type(held) is type(own) else own


def _rotary(model: nn.Module, path: str) -> nn.Module:
    """The model's rotary embedding, made again from its config where its buffers were
    freed (a rank of a distributed pipe keeps only its own stages' tensors; the rotary
    embedding belongs to the first stage's trace, but every stage needs it here)."""
    rotary = model.get_submodule(path)
    if not any(buffer.is_meta for buffer in rotary.buffers()):
        return rotary
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    return type(rotary)(config=model.config).to(device)


class _HFStage:
    """One stage of a split HF causal LM: embedding (first), decoder layers, head (last)."""

    def __init__(
        self,
        model: nn.Module,
        layout: _Layout,
        stage: nn.Module,
        layers: Sequence[int],
        first: bool,
        last: bool,
    ) -> None:
        config = model.config
        self.first, self.last = first, last
        self.embed = _held(stage, model, layout.embed) if first else None
        self.positions = (
            _held(stage, model, layout.positions) if first and layout.positions else None
        )
        self.dropout = _held(stage, model, layout.dropout) if first and layout.dropout else None
        self.rotary = _rotary(model, layout.rotary) if layout.rotary else None
        self.norm = _held(stage, model, layout.norm) if last else None
        self.head = _held(stage, model, "lm_head") if last else None
        self.layers = [(i, _held(stage, model, f"{layout.layers}.{i}")) for i in layers]
        self.keyword = _cache_keyword(self.layers[0][1]) if self.layers else "cache"
        self.outside = _outside(config)
        types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if types is not None:
            self.windows = [window if types[i] == "sliding_attention" else None for i in layers]
        else:
            self.windows = [window] * len(self.layers)
        # Gemma 3 keeps one rotary table per attention type: each layer reads its own type's
        self.rope_types: list[str | None] = [None] * len(self.layers)
        if (
            self.rotary is not None
            and "layer_type" in inspect.signature(self.rotary.forward).parameters
        ):
            assert types is not None, "a rotary embedding per layer type needs config.layer_types"
            self.rope_types = [types[i] for i in layers]

    def __call__(self, x: Tensor, cache: StageCache, step: DecodeStep) -> Tensor:
        outside = self.outside
        if self.embed is not None:
            x = self.embed(x)
            if "embedding_multiplier" in outside:
                x = x * outside["embedding_multiplier"]
            if self.positions is not None:
                x = x + self.positions(step.positions).to(x.device)
            if self.dropout is not None:
                x = self.dropout(x)
        masks: dict[int | None, Tensor] = {}
        tables: dict[str | None, Any] = {}
        for (_, layer), window, kind in zip(self.layers, self.windows, self.rope_types):
            if window not in masks:
                masks[window] = step.mask(x.dtype, window)
            kwargs: dict[str, Any] = {self.keyword: cache}
            if self.rotary is not None:
                if kind not in tables:
                    typed = {} if kind is None else {"layer_type": kind}
                    tables[kind] = self.rotary(x, step.positions, **typed)
                kwargs["position_embeddings"] = tables[kind]
            x = layer(
                x,
                attention_mask=masks[window],
                position_ids=step.positions,
                use_cache=True,
                cache_position=step.cache_position,
                **kwargs,
            )
            if isinstance(x, tuple):  # transformers before 4.54 returned (hidden, ...)
                x = x[0]
        if self.last:
            assert self.norm is not None and self.head is not None
            x = self.head(self.norm(x[:, -1:]))
            # NOTE: in the order and the form the models' own forwards write them
            if "logits_scaling" in outside:
                x = x / outside["logits_scaling"]
            if "logit_scale" in outside:
                x = x * outside["logit_scale"]
            if "final_logit_softcapping" in outside:
                cap = outside["final_logit_softcapping"]
                x = torch.tanh(x / cap) * cap
        return x


def _layer_indices(stage: nn.Module, prefix: str) -> list[int]:
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    found = {int(m.group(1)) for name, _ in stage.named_parameters() if (m := pattern.match(name))}
    return sorted(found)


def hf_programs(model: nn.Module, stages: Sequence[nn.Module]) -> list[StageProgram]:
    """One decode program per stage of ``model`` as ``gpipe.split`` cut it into ``stages``.

    Raises:
        TypeError: ``model`` is no Hugging Face causal LM of a known family, or one whose
            config scales or caps embeddings or logits outside its decoder layers.
        ValueError: a cut inside a decoder layer, or an embedding or head away from the
            first or last stage.
    """
    layout = _layout_of(model)
    if layout is None or not hasattr(model, "config"):
        raise TypeError(
            f"{type(model).__name__} is not a Hugging Face causal LM laid out as Llama "
            "(model.layers, model.embed_tokens, model.norm, lm_head) or GPT-2 (transformer.h, "
            "wte, ln_f, lm_head): give each layer forward_cached and pipe an nn.Sequential "
            "(see gpipe.generation.programs)"
        )
    count = len(list(model.get_submodule(layout.layers).children()))
    held = [_layer_indices(stage, layout.layers) for stage in stages]
    seen: set[int] = set()
    for stage, layers in zip(stages, held):
        for layer in layers:
            path = f"{layout.layers}.{layer}"
            mine = {
                n[len(path) + 1 :] for n, _ in stage.named_parameters() if n.startswith(path + ".")
            }
            if layer in seen or mine != {
                n for n, _ in model.get_submodule(path).named_parameters()
            }:
                raise ValueError(
                    f"decoder layer {path} is cut between stages: generation calls whole "
                    "decoder layers, so split at them, e.g. "
                    f"split_points=['{layout.layers}.N', ...]"
                )
            seen.add(layer)
    if sorted(seen) != list(range(count)):
        missing = sorted(set(range(count)) - seen)
        raise ValueError(f"no stage holds decoder layers {missing} of {layout.layers}")
    last = len(stages) - 1
    programs: list[StageProgram] = [
        _HFStage(model, layout, stage, layers, index == 0, index == last)
        for index, (stage, layers) in enumerate(zip(stages, held))
    ]
    return programs
