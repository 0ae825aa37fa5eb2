"""Skips leave nothing behind: no tracker keeps a skip once it is popped or its step is over."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from gpipe.skip import pop, skippable, stages, stash
from gpipe.skip.tracker import current_tracker

stashed: list[weakref.ref[torch.Tensor]] = []


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = x * 2  # a tensor of the forward's own, so only the pipe's bookkeeping holds it
        stashed.append(weakref.ref(skip))
        yield stash("skip", skip)
        return x


@skippable(pop=["skip"])
class Pop(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return x + skip


def _model() -> nn.Sequential:
    return nn.Sequential(Stash(), nn.Linear(3, 3), Pop()).double()


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("balance", [None, [3], [1, 2], [1, 1, 1]], ids=str)
def test_no_skip_outlives_its_step(train: bool, balance: list[int] | None) -> None:
    stashed.clear()
    model = _model()
    run = model if balance is None else stages(model, balance)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    if train:
        run(x).norm().backward()
    else:
        run.eval()
        with torch.no_grad():
            run(x)
    gc.collect()
    assert current_tracker().waiting == {}
    assert stashed and all(ref() is None for ref in stashed)


def test_a_stage_that_fails_drops_the_skips_it_held() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    stashed.clear()
    cut = stages(nn.Sequential(Stash(), Fails(), Pop()), [3])
    with pytest.raises(ValueError, match="boom"):
        cut(torch.zeros(1))
    gc.collect()
    assert current_tracker().waiting == {}
    assert stashed and all(ref() is None for ref in stashed)
