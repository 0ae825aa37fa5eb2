"""Choosing each row's next token from its logits, and knowing when rows and lanes stop.

The last stage calls :func:`next_tokens` on one lane's newest logits, then
:meth:`Stopping.update`. Both follow Hugging Face's ``generate`` (``_sample``), so the same
settings choose the same tokens. Rows are independent, so left-padded prompts need nothing here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Sampling", "Stopping", "next_tokens", "warp"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is no token id


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_Test = Callable[[Any], bool]


def _check(name: str, value: Any, kind: _Test, ok: _Test | None, want: str, fix: str = "") -> None:
    """Raise TypeError for a value of the wrong type, ValueError for one out of range."""
    if not kind(value):
        raise TypeError(f"{name} must be {want}, got {value!r}{fix}")
    if ok is not None and not ok(value):
        raise ValueError(f"{name} must be {want}, got {value!r}{fix}")


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How to choose tokens and when to stop; validated once, up front.

    Args:
        max_new_tokens: tokens to generate per row at most (>= 1).
        do_sample: draw from the warped distribution; ``False`` takes the argmax and ignores
            ``temperature``, ``top_k`` and ``top_p``, as Hugging Face does.
        temperature: divides the logits before sampling (> 0 when sampling).
        top_k: keep the ``top_k`` highest logits (ties with the k-th too); ``None`` keeps every
            token. NOTE: HF's ``generate`` falls back to 50 when none is given; pass 50 to match.
        top_p: keep the smallest set of highest logits whose probability reaches ``top_p``
            (0 < top_p <= 1; 1 keeps every token).
        eos_token_id: a token id, or several, that finish a row; the id itself is emitted.
        pad_token_id: emitted by rows that have finished; defaults to the first eos id.
    """

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        _check("max_new_tokens", self.max_new_tokens, _is_int, lambda n: n >= 1, "an int >= 1")
        _check("do_sample", self.do_sample, lambda v: isinstance(v, bool), None, "True or False")
        positive = "a finite number > 0 when sampling"
        greedy = "; for greedy decoding pass do_sample=False rather than temperature=0"
        valid = (lambda t: 0 < t < math.inf) if self.do_sample else None
        _check("temperature", self.temperature, _is_number, valid, positive, greedy)
        if self.top_k is not None:
            keep_all = "; pass top_k=None to keep every token"
            _check("top_k", self.top_k, _is_int, lambda k: k >= 1, "an int >= 1", keep_all)
        if self.top_p is not None:
            want, keep_all = "a number with 0 < top_p <= 1", "; pass top_p=None to keep every token"
            _check("top_p", self.top_p, _is_number, lambda p: 0 < p <= 1, want, keep_all)
        eos = self.eos_token_id
        if eos is not None and not _is_int(eos):
            if isinstance(eos, (str, bytes)) or not isinstance(eos, Sequence):
                raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")
            if not eos:
                raise ValueError("eos_token_id must not be empty: pass None for no eos token")
            # A tuple keeps the frozen settings hashable when a list was given.
            object.__setattr__(self, "eos_token_id", tuple(eos))
        for token in self.eos_token_ids:
            _check("eos_token_id", token, _is_int, lambda t: t >= 0, "ids that are ints >= 0")
        if self.pad_token_id is not None:
            _check("pad_token_id", self.pad_token_id, _is_int, lambda t: t >= 0, "an int >= 0")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that finish a row, as a tuple (empty when none were given)."""
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    @property
    def pad_id(self) -> int | None:
        """The id finished rows emit: ``pad_token_id``, else the first eos id, as in HF."""
        given = [t for t in (self.pad_token_id, *self.eos_token_ids) if t is not None]
        return given[0] if given else None


def warp(logits: Tensor, sampling: Sampling) -> Tensor:
    """``[rows, vocab]`` logits through HF's warpers in its order: temperature, top-k, top-p.

    Filtered tokens become ``-inf``; at least one token per row stays (``min_tokens_to_keep=1``).
    A warper that would change nothing (temperature 1, no top-k, top-p 1) is skipped, as in
    ``generate``. ``sampling.do_sample`` is not consulted. Returns new scores of the same dtype.
    """
    scores = logits
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if sampling.top_k is not None:
        kth = torch.topk(scores, min(sampling.top_k, scores.size(-1))).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass stays within 1 - top_p; the top token always stays.
        drop_sorted = cumulative <= 1 - sampling.top_p
        drop_sorted[..., -1:] = False
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -math.inf)
    return scores


def next_tokens(
    logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> Tensor:
    """Each row's next token: the argmax (warpers ignored), or a draw from the warped softmax.

    Half-precision logits are raised to float32 first, as HF does (it also lowers float64; we
    keep it). With ``generator`` seeded ``s`` the draw equals HF's after ``torch.manual_seed(s)``
    on the same rows: both make one ``torch.multinomial`` call. NOTE: lanes that share a
    generator must draw in a fixed order for the draws to repeat.

    Args:
        logits: ``[rows, vocab]`` scores of each row's newest position.
        sampling: how to choose.
        generator: the random stream, on ``logits``' device; ``None`` uses torch's global one.

    Returns:
        ``[rows]`` int64 token ids on ``logits``' device.

    Raises:
        ValueError: ``logits`` is not a 2-D floating-point tensor.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating-point [rows, vocab] tensor, got {logits.dtype} with "
            f"shape {tuple(logits.shape)}: pass the last position's logits, logits[:, -1, :]"
        )
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    probs = warp(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


class Stopping:
    """Which rows of one lane have finished, and whether the whole lane has.

    A row finishes on the step it emits an eos id, or when ``max_new_tokens`` are out; from
    then on it emits the pad id (HF's ``next_tokens * unfinished + pad * (1 - unfinished)``).
    Without eos ids nothing is read back from the device: the lane ends by count alone.
    """

    def __init__(self, rows: int, sampling: Sampling, device: torch.device | str | None = None):
        """Track ``rows`` rows, all unfinished, on ``device`` (where the tokens will be)."""
        self.sampling = sampling
        self.steps = 0
        self.unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        self._eos = torch.tensor(sampling.eos_token_ids, dtype=torch.long, device=device)

    def update(self, tokens: Tensor) -> Tensor:
        """Record one step's ``[rows]`` tokens; return them with already finished rows padded.

        Raises:
            RuntimeError: ``max_new_tokens`` steps were recorded already.
        """
        if self.steps >= self.sampling.max_new_tokens:
            done = f"max_new_tokens={self.sampling.max_new_tokens}"
            raise RuntimeError(f"the lane is done after {done}: check Stopping.done first")
        pad = self.sampling.pad_id
        if pad is not None and self._eos.numel():
            tokens = torch.where(self.unfinished, tokens, pad)
            self.unfinished &= ~torch.isin(tokens, self._eos)
        self.steps += 1
        if self.steps >= self.sampling.max_new_tokens:
            self.unfinished.fill_(False)
        return tokens

    @property
    def done(self) -> bool:
        """Every row has finished. Reads ``unfinished`` back to the host only with eos ids."""
        if self.steps >= self.sampling.max_new_tokens:
            return True  # decided on the host, without a device sync
        return bool(self._eos.numel()) and not bool(self.unfinished.any())
