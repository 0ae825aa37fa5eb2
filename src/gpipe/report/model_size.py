"""The largest model that fits: the planner's memory model on a transformer built on meta.

A model built on the meta device has shapes and no data, so a forward on it costs nothing
and shows every tensor autograd would save. :func:`meta_profile` counts those the way the
runtime does (each storage once, parameters not at all) and returns a
:class:`~gpipe.balance.Profile` without times. :func:`device_peaks` then predicts each
device's peak exactly as the planner does: its parameters, gradients and optimizer state,
plus the activations it holds at its worst moment, walked through the schedule's actions by
:func:`gpipe.analysis.activation_peaks`. :func:`largest_model` finds, for K devices under a
per-device budget, the most transformer blocks that fit: the GPipe paper's Table 1.
:func:`check_memory` holds the prediction against a small model trained on CPU.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from gpipe.analysis import activation_peaks
from gpipe.balance import Profile
from gpipe.balance.optimizer_state import optimizer_state_factor
from gpipe.bench.measure import PeakMemory
from gpipe.models import GPTConfig, gpt, gpt_loss
from gpipe.pipe import GPipe
from gpipe.schedule import make_schedule

__all__ = [
    "Fit",
    "MemoryCheck",
    "check_memory",
    "device_peaks",
    "largest_model",
    "meta_profile",
    "repeat_blocks",
    "transformer_profile",
]


def meta_profile(
    module: nn.Sequential,
    sample: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: str | type[torch.optim.Optimizer] | None = None,
) -> Profile:
    """The bytes of every layer of ``module`` on ``sample``, as the planner's profile counts
    them, with no time measured; ``module`` and ``sample`` may live on the meta device.

    The loss, given ``loss_fn`` and ``target``, counts with the last layer (as in
    :func:`gpipe.planning.plan`). Attention runs the kernel a CPU or GPU picks (flash
    attention, which keeps a log-sum-exp row, not the attention matrix), not the
    materialized one meta tensors would otherwise take.
    """
    own = {id(_root(t)) for t in (*module.parameters(), *module.buffers())}
    counted: dict[int, int] = {}
    alive: list[torch.Tensor] = []  # ids stay unique while their tensors live

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        root = _root(tensor)
        alive.append(root)
        if id(root) not in own and id(root) not in counted:
            counted[id(root)] = root.numel() * root.element_size()
        return tensor

    layers: list[nn.Module] = list(module)
    if loss_fn is not None:
        layers.append(_Loss(loss_fn, target))
    saved, inputs, saved_inputs = [], [], []
    value = sample
    with (
        torch.enable_grad(),
        _FlashOnMeta(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        for layer in layers:
            given = value.detach().requires_grad_(value.is_floating_point())
            before = sum(counted.values())
            value = layer(given)
            alive.append(value)
            saved.append(sum(counted.values()) - before)
            inputs.append(given.numel() * given.element_size())
            saved_inputs.append(counted.get(id(given), 0))
    if loss_fn is not None:  # the loss's saved bytes join the last layer's
        saved = [*saved[:-2], saved[-2] + saved[-1]]
        inputs, saved_inputs = inputs[:-1], saved_inputs[:-1]
    params = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in module]
    factor = optimizer_state_factor(optimizer)
    zeros = [0.0] * len(module)
    return Profile(
        names=[type(layer).__name__ for layer in module],
        forward=zeros,
        backward=zeros,
        output_bytes=[0] * len(module),
        activation_bytes=saved,
        parameter_bytes=params,
        gradient_bytes=params,
        optimizer_bytes=[factor * p for p in params],
        input_bytes=inputs,
        saved_input_bytes=saved_inputs,
    )


class _Loss(nn.Module):
    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any) -> None:
        super().__init__()
        self.loss_fn, self.target = loss_fn, target

    def forward(self, output: Any) -> torch.Tensor:
        return self.loss_fn(output, self.target)


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``tensor`` views (meta tensors have no address to compare)."""
    while tensor._base is not None:
        tensor = tensor._base
    return tensor


class _FlashOnMeta(TorchFunctionMode):
    """Meta tensors take the attention kernel a CPU or GPU would (see meta_profile)."""

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func is F.scaled_dot_product_attention
            and args[0].is_meta
            and kwargs.get("attn_mask") is None
            and not kwargs.get("dropout_p")
        ):
            q, k, v = args[:3]
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return flash(q, k, v, 0.0, kwargs.get("is_causal", False), scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def device_peaks(
    profile: Profile, balance: Sequence[int], chunks: int, checkpoint: str
) -> tuple[list[int], list[int]]:
    """Per device (one stage each, GPipe's schedule), what it holds for good (parameters,
    gradients, optimizer state) and its activations at their peak: the planner's prediction.

    ``profile`` describes one micro-batch (``batch / chunks`` samples).
    """
    bounds = [0]
    for count in balance:
        bounds.append(bounds[-1] + count)
    spans = list(itertools.pairwise(bounds))
    full = [profile.stage_activation_bytes(a, b) for a, b in spans]
    kept = [profile.input_bytes[a] for a, _ in spans]
    stored = [
        sum(profile.parameter_bytes[a:b] + profile.gradient_bytes[a:b])
        + sum(profile.optimizer_bytes[a:b])
        for a, b in spans
    ]
    # NOTE: as the planner: the mini-batch takes no gradient; every later stage sends one
    # back, the size of its input.
    gradient = [0, *kept[1:]]
    schedule = make_schedule("gpipe", len(balance), chunks)
    peaks = activation_peaks(schedule, full, kept, checkpoint, gradient=gradient)
    return stored, [int(p) for p in peaks]


def transformer_profile(config: GPTConfig, rows: int, blocks: int) -> Profile:
    """:func:`meta_profile` of ``gpt(config)`` with ``blocks`` blocks on ``rows`` sequences,
    with next-token cross-entropy and RMSProp's state (one number per parameter, so 12
    bytes per float32 parameter with its gradient, as in the paper's Table 1)."""
    with torch.device("meta"):
        model = gpt(_with_layers(config, blocks))
        ids = torch.zeros(rows, config.context, dtype=torch.long)
    return meta_profile(model, ids, target=ids, loss_fn=gpt_loss, optimizer=torch.optim.RMSprop)


def _with_layers(config: GPTConfig, layers: int) -> GPTConfig:
    return GPTConfig(
        vocab=config.vocab,
        context=config.context,
        layers=layers,
        heads=config.heads,
        width=config.width,
        dropout=config.dropout,
    )


def repeat_blocks(profile: Profile, blocks: int) -> Profile:
    """A profile of embedding, ``blocks`` blocks, norm and head, from one of two blocks
    (``profile`` of layers embedding, block, block, norm, head): the second block stands
    for every block after the first, which all see the same input."""
    if profile.layers != 5:
        raise ValueError(f"need the profile of a two-block GPT (5 layers), got {profile.layers}")
    order = [0, 1, *([2] * (blocks - 1)), 3, 4]

    def pick(values: list[Any]) -> list[Any]:
        return [values[i] for i in order]

    return Profile(
        names=pick(profile.names),
        forward=pick(profile.forward),
        backward=pick(profile.backward),
        output_bytes=pick(profile.output_bytes),
        activation_bytes=pick(profile.activation_bytes),
        parameter_bytes=pick(profile.parameter_bytes),
        gradient_bytes=pick(profile.gradient_bytes),
        optimizer_bytes=pick(profile.optimizer_bytes),
        input_bytes=pick(profile.input_bytes),
        saved_input_bytes=pick(profile.saved_input_bytes),
    )


@dataclass(frozen=True)
class Fit:
    """The largest model that fits K devices.

    Attributes:
        devices: K.
        blocks: transformer blocks in it.
        balance: layers per device (embedding first, norm and head last).
        parameters: its parameter count.
        stored: the largest device's parameters, gradients and optimizer state, bytes.
        activations: the most activation bytes any device holds at its peak.
        peak: the fullest device's total, bytes.
    """

    devices: int
    blocks: int
    balance: list[int]
    parameters: int
    stored: int
    activations: int
    peak: int


def largest_model(
    two_blocks: Profile, devices: int, budget: int, chunks: int, checkpoint: str
) -> Fit:
    """The most blocks K devices hold under ``budget`` bytes each, GPipe's schedule.

    Each device holds a contiguous run of layers (the embedding on the first, the norm and
    head on the last). Under GPipe every device's peak depends only on its own layers (and
    its neighbour's input size, the same for all), so the most blocks each can take are
    found one device at a time and add up; the total is then checked in one walk of the
    whole schedule.

    Raises:
        ValueError: not even the embedding and head fit.
    """

    def held(shares: list[int]) -> tuple[list[int], list[int]]:
        profile = repeat_blocks(two_blocks, sum(shares))
        return device_peaks(profile, _balance(shares), chunks, checkpoint)

    def most(index: int) -> int:
        """The most blocks device ``index`` takes within the budget (0 if not one)."""
        low, high = 0, budget // (3 * two_blocks.parameter_bytes[2]) + 1
        while low < high:
            n = (low + high + 1) // 2
            shares = [1] * devices
            shares[index] = n
            stored, peaks = held(shares)
            if stored[index] + peaks[index] <= budget:
                low = n
            else:
                high = n - 1
        return low

    if devices == 1:
        shares = [most(0)]
    else:
        middle = [most(1)] * (devices - 2) if devices > 2 else []
        shares = [most(0), *middle, most(devices - 1)]
    if min(shares) < 1:
        raise ValueError(
            f"{devices} device(s) of {budget} bytes cannot hold the embedding, the head and a "
            "block each: raise the budget"
        )
    blocks = sum(shares)
    balance = _balance(shares)
    stored, peaks = held(shares)
    assert all(s + p <= budget for s, p in zip(stored, peaks)), "each fits alone, so all fit"
    profile = repeat_blocks(two_blocks, blocks)
    parameters = sum(profile.parameter_bytes) // 4
    fullest = max(range(devices), key=lambda d: stored[d] + peaks[d])
    return Fit(
        devices,
        blocks,
        balance,
        parameters,
        stored[fullest],
        max(peaks),
        stored[fullest] + peaks[fullest],
    )


def _balance(shares: list[int]) -> list[int]:
    """Layers per device from blocks per device: the embedding joins the first device, the
    norm and head the last."""
    balance = list(shares)
    balance[0] += 1
    balance[-1] += 2
    return balance


@dataclass(frozen=True)
class MemoryCheck:
    """One small model: the memory model's prediction against what really happened.

    Attributes:
        devices, checkpoint: the pipe.
        predicted: per device, activation bytes at the peak, from the meta-built model.
        counted: per device, the runtime's count of the same (saved-tensor hooks).
        rss: resident memory the step added at its peak, median of three steps.
        expected: what the model says the step adds: every device's peak activations
            (held at once in one process) and the gradients.
    """

    devices: int
    checkpoint: str
    predicted: list[int]
    counted: list[int]
    rss: int | None
    expected: int


def check_memory(
    devices: int, checkpoint: str, *, context: int = 128, batch: int = 32
) -> MemoryCheck:
    """Predict a small GPT's memory on meta, then train it on CPU and measure."""
    config = GPTConfig(vocab=256, context=context, layers=4, heads=4, width=256, dropout=0.0)
    chunks = 4
    torch.manual_seed(0)
    model = gpt(config)
    ids = torch.randint(0, config.vocab, (batch, config.context))
    with torch.device("meta"):
        shadow = gpt(config)
    rows = ids[: batch // chunks].to("meta")
    profile = meta_profile(shadow, rows, target=rows, loss_fn=gpt_loss)
    balance = [len(model)] if devices == 1 else [4, len(model) - 4]
    _, predicted = device_peaks(profile, balance, chunks, checkpoint)
    pipe = GPipe(model, balance, devices=["cpu"] * devices, chunks=chunks, checkpoint=checkpoint)
    pipe.train_step(ids, ids, gpt_loss)  # warm-up: threads, probes, the allocator
    counted = [int(c) for c in pipe.timeline.peak_memory]
    grown = []
    for _ in range(3):
        for p in model.parameters():
            p.grad = None
        memory = PeakMemory()
        memory.start()
        pipe.train_step(ids, ids, gpt_loss)
        grown.append(memory.peak())
    pipe.close()
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    rss = None if None in grown else int(statistics.median(g for g in grown if g is not None))
    return MemoryCheck(devices, checkpoint, predicted, counted, rss, sum(predicted) + gradients)
