"""The example models, cut by gpipe.split and run by GPipe, train exactly like plain PyTorch.

Float64; the loss and every parameter's gradient (by name, in the user's own model) are
compared with the same model trained unpipelined on the same batch. The ResNet's
BatchNorm normalizes each micro-batch by its own statistics in any pipeline, so its
reference is plain gradient accumulation over the same micro-batches, and with
``deferred_batch_norm=True`` its running statistics are those of the whole batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import gpipe
from gpipe.models import (
    GPT2Config,
    ResNetConfig,
    Seq2SeqConfig,
    UNetConfig,
    gpt2,
    gpt_loss,
    resnet,
    seq2seq,
    seq2seq_loss,
    unet,
)

CHUNKS = 4


@dataclass
class Case:
    """One example model, a batch for it, and where to cut it into K stages."""

    model: nn.Module
    args: tuple[Any, ...]
    target: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    points: dict[int, list[str]]
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    accumulate: bool = False  # BatchNorm: the reference accumulates over the micro-batches


def _gpt2() -> Case:
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (8, 16), generator=generator)
    mask = torch.ones(8, 16, dtype=torch.long)
    mask[::2, -5:] = 0  # some sequences padded
    points = {
        2: ["transformer.h.2"],
        3: ["transformer.h.1", "transformer.h.3"],
        4: ["transformer.h.1", "transformer.h.2", "transformer.h.3"],
    }
    model = gpt2(GPT2Config(), seed=0).double()
    target = torch.roll(idx, -1, dims=1)
    return Case(model, (idx,), target, gpt_loss, points, kwargs={"attention_mask": mask})


def _resnet() -> Case:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(8, 3, 16, 16, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, 10, (8,), generator=generator)
    points = {2: ["layer2"], 3: ["layer1.1", "layer3"], 4: ["layer1.1", "layer2", "layer3"]}
    model = resnet(ResNetConfig(), seed=0).double()
    options = {"deferred_batch_norm": True}
    return Case(model, (images,), labels, F.cross_entropy, points, options=options, accumulate=True)


def _unet() -> Case:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(8, 3, 16, 16, dtype=torch.float64, generator=generator)
    target = torch.randn(8, 3, 16, 16, dtype=torch.float64, generator=generator)
    points = {2: ["middle"], 3: ["down.2", "up.1"], 4: ["down.2", "middle", "up.2"]}
    return Case(unet(UNetConfig(), seed=0).double(), (images,), target, F.mse_loss, points)


def _seq2seq() -> Case:
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(0, 64, (8, 12), generator=generator)
    tgt = torch.randint(0, 64, (8, 10), generator=generator)
    # NOTE: cut after encoder.0, pos_embed serves stage 0 (src) and stage 1 (tgt): shared.
    points = {
        2: ["decoder.0"],
        3: ["encoder.1", "decoder.1"],
        4: ["encoder.1", "decoder.0", "decoder.1"],
    }
    model = seq2seq(Seq2SeqConfig(), seed=0).double()
    target = (torch.roll(tgt, -1, dims=1), src)
    return Case(model, (src, tgt), target, seq2seq_loss, points)


MODELS: dict[str, Callable[[], Case]] = {
    "gpt2": _gpt2,
    "resnet": _resnet,
    "unet": _unet,
    "seq2seq": _seq2seq,
}
# (schedule, virtual stages per device): v=2 needs an even stage count.
SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("zb-h1", 1),
    ("zb-h2", 1),
    ("zb-v", 2),
]


def _chunk(value: Any, i: int) -> Any:
    """Micro-batch ``i`` of ``CHUNKS`` of every tensor in ``value`` (dim 0)."""
    return torch.utils._pytree.tree_map(lambda t: t.chunk(CHUNKS)[i], value)


def reference(case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain PyTorch on a copy of the model: the loss and each parameter's grad by name."""
    plain = copy.deepcopy(case.model)
    if case.accumulate:
        loss = torch.zeros((), dtype=torch.float64)
        for i in range(CHUNKS):
            args, kwargs = _chunk(case.args, i), _chunk(case.kwargs, i)
            part = case.loss_fn(plain(*args, **kwargs), _chunk(case.target, i)) / CHUNKS
            part.backward()
            loss += part.detach()
    else:
        loss = case.loss_fn(plain(*case.args, **case.kwargs), case.target)
        loss.backward()
        loss = loss.detach()
    return loss, {name: p.grad for name, p in plain.named_parameters()}


def run_pipe(case: Case, stages: int, schedule: str, v: int) -> torch.Tensor:
    """Split ``case.model`` into ``stages``, one train_step of GPipe over ``v`` per device."""
    example = _chunk(case.args, 0)
    cut = gpipe.split(
        case.model,
        case.points[stages],
        example_inputs=example,
        example_kwargs=_chunk(case.kwargs, 0),
    )
    assert len(cut) == stages
    pipe = gpipe.GPipe(
        cut,
        devices=["cpu"] * (stages // v),
        chunks=CHUNKS,
        schedule=schedule,
        virtual_stages=v,
        **case.options,
    )
    try:
        inputs = case.args if len(case.args) > 1 else case.args[0]
        return pipe.train_step(inputs, case.target, case.loss_fn, kwargs=case.kwargs)
    finally:
        pipe.close()


def check_parity(name: str, stages: int, schedule: str, v: int) -> None:
    case = MODELS[name]()
    expected, grads = reference(case)
    loss = run_pipe(case, stages, schedule, v)
    assert_close(loss, expected)
    for param_name, param in case.model.named_parameters():
        assert param.grad is not None, f"{param_name} got no gradient"
        assert_close(param.grad, grads[param_name], msg=lambda m, n=param_name: f"{n}: {m}")
    if name == "resnet":  # the first BatchNorm sees the same inputs as plain training
        whole = MODELS[name]().model
        whole(*case.args)
        assert_close(case.model.stem[1].running_mean, whole.stem[1].running_mean)
        assert_close(case.model.stem[1].running_var, whole.stem[1].running_var)


FAST = [
    ("gpt2", 4, "1f1b", 1),
    ("gpt2", 2, "interleaved", 2),
    ("resnet", 3, "gpipe", 1),
    ("unet", 4, "1f1b", 1),
    ("unet", 4, "zb-v", 2),
    ("seq2seq", 4, "zb-h1", 1),
]


@pytest.mark.parametrize(("name", "stages", "schedule", "v"), FAST)
def test_a_split_example_model_trains_like_plain_pytorch(
    name: str, stages: int, schedule: str, v: int
) -> None:
    check_parity(name, stages, schedule, v)


ALL = [
    (name, stages, schedule, v)
    for name in MODELS
    for stages in (2, 3, 4)
    for schedule, v in SCHEDULES
    if stages % v == 0 and (name, stages, schedule, v) not in FAST
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stages", "schedule", "v"), ALL)
def test_every_example_model_every_stage_count_and_schedule_trains_like_plain_pytorch(
    name: str, stages: int, schedule: str, v: int
) -> None:
    check_parity(name, stages, schedule, v)


def test_the_unets_outer_skips_go_straight_from_stage_0_to_stage_3() -> None:
    case = _unet()
    cut = gpipe.split(case.model, case.points[4], example_inputs=_chunk(case.args, 0))
    assert [(s, r) for s, r, _ in cut.dataflow.skips()] == [(0, 3)]
    pipe = gpipe.GPipe(cut, chunks=CHUNKS, schedule="gpipe")
    try:
        pipe.train_step(case.args[0], case.target, case.loss_fn)
        transfers = pipe.timeline.transfers
    finally:
        pipe.close()
    hops = {(t.sender, t.stage, t.kind) for t in transfers if t.sender is not None}
    # Per micro-batch: the skip once forward (0 -> 3) and its gradient once back (3 -> 0).
    assert sum(1 for t in transfers if (t.sender, t.stage) == (0, 3)) == CHUNKS
    assert sum(1 for t in transfers if (t.sender, t.stage) == (3, 0)) == CHUNKS
    assert (0, 3, "F") in hops and (3, 0, "B") in hops


def distributed_parity(name: str, schedule: str) -> dict[str, float]:
    """On every rank of a ``world``-process job: this rank's loss and gradients vs plain."""
    import torch.distributed as dist

    import gpipe.distributed as gd

    world = dist.get_world_size()
    case = MODELS[name]()
    expected, grads = reference(case)
    cut = gpipe.split(
        case.model,
        case.points[world],
        example_inputs=_chunk(case.args, 0),
        example_kwargs=_chunk(case.kwargs, 0),
    )
    pipe = gd.DistributedGPipe(cut, chunks=CHUNKS, schedule=schedule, timeout=60, **case.options)
    try:
        inputs = case.args if len(case.args) > 1 else case.args[0]
        loss = pipe.train_step(inputs, case.target, case.loss_fn, kwargs=case.kwargs)
    finally:
        pipe.close()
    held = [(n, p) for n, p in case.model.named_parameters() if p.grad is not None]
    return {
        "loss": float((loss - expected).abs()),
        "grad": max(float((p.grad - grads[n]).abs().max()) for n, p in held),
        "checked": float(len(held)),
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_split_example_model_trains_like_plain_pytorch_on_two_processes(name: str) -> None:
    from ranks import check, launch

    results = check(
        launch("test_example_models_pipe:distributed_parity", 2, name=name, schedule="1f1b")
    )
    for rank, result in enumerate(results):
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, (rank, result)
        assert result["checked"] > 0, (rank, "this rank held no parameter")
