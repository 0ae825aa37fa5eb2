"""Property: any schedule, cut, micro-batch count and batch trains exactly like plain PyTorch."""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import make_mlp, reference_step
from gpipe import GPipe


@st.composite
def pipelines(draw: st.DrawFn) -> dict:
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]))
    virtual = 2 if schedule == "interleaved" else 1
    devices = draw(st.integers(1, 4))
    stages = devices * virtual
    layers = 2 * draw(st.integers(max(stages, 2), 8))  # Linear + Tanh blocks, 4..16 layers
    cuts = sorted(
        draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1))
    )
    bounds = [0, *cuts, layers]
    return {
        "schedule": schedule,
        "virtual_stages": virtual,
        "devices": ["cpu"] * devices,
        "balance": [b - a for a, b in itertools.pairwise(bounds)],
        "chunks": draw(st.integers(1, 9)),
        "checkpoint": draw(st.sampled_from(["always", "except_last", "never"])),
        "batch": draw(st.integers(1, 13)),
        "via": draw(st.sampled_from(["train_step", "call"])),
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_any_pipeline_trains_like_plain_pytorch(config: dict) -> None:
    blocks = sum(config["balance"]) // 2
    torch.manual_seed(config["batch"])
    x = torch.randn(config["batch"], 6, dtype=torch.float64)
    target = torch.randn(config["batch"], 6, dtype=torch.float64)
    _, expected_loss, expected_grads, _ = reference_step(make_mlp(blocks), x, target, F.mse_loss)

    model = make_mlp(blocks)
    pipe = GPipe(
        model,
        config["balance"],
        devices=config["devices"],
        chunks=config["chunks"],
        checkpoint=config["checkpoint"],
        schedule=config["schedule"],
        virtual_stages=config["virtual_stages"],
    )
    if config["via"] == "train_step":
        loss = pipe.train_step(x, target, F.mse_loss)
    else:
        loss = F.mse_loss(pipe(x), target)
        loss.backward()
    assert_close(loss.detach(), expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)
