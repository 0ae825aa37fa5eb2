"""Rank programs for tests/test_checkpoint_crash.py: training that resumes from the newest
checkpoint and dies (SIGKILL) at a chosen point of a save.

A point is a place in the save's sequence of file-system and collective calls on one rank
(an fsync, a rename, DCP opening a file, a barrier, a gather...): just before or just after
the n-th of them. Every step's loss and every saved state are written to the log folder, so
the test can compare what a later run loads and computes with what was saved and with a run
that was never interrupted.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint import filesystem

import gpipe.distributed as gd
from dist_scenarios import mlp
from scale_scenarios import batch

# (owner, name) of every call a save makes that a crash may come just before or after
_HOOKED: list[tuple[Any, str]] = [
    (os, "fsync"),
    (os, "replace"),
    (shutil, "rmtree"),
    (pathlib.Path, "rename"),
    (pathlib.Path, "mkdir"),
    (filesystem.FileSystem, "create_stream"),
    *(
        (dist, name)
        for name in (
            "barrier",
            "broadcast",
            "all_gather",
            "all_gather_object",
            "gather_object",
            "broadcast_object_list",
            "scatter_object_list",
        )
    ),
]


class _Crash:
    """Counts the calls of the save under way; SIGKILLs this process at point ``die_at``."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.saving = False
        self.armed = False  # the save that dies: notes whether it got as far as its commit
        self.points = 0
        self.die_at: int | None = None
        for owner, name in _HOOKED:
            setattr(owner, name, self._hooked(name, getattr(owner, name)))

    def _hooked(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._point(f"before {name}")
            result = real(*args, **kwargs)
            if self.armed and name == "rename" and Path(args[1]).name.startswith("save-"):
                (self.log / "committed").write_text(Path(args[1]).name)
            self._point(f"after {name}")
            return result

        return call

    def _point(self, what: str) -> None:
        if not self.saving:
            return
        self.points += 1
        if self.points == self.die_at:
            self.die(what)

    def die(self, what: str) -> None:
        (self.log / "died").write_text(json.dumps({"rank": dist.get_rank(), "at": what}))
        os.kill(os.getpid(), signal.SIGKILL)

    def save(self, pipe: Any, path: str, **kwargs: Any) -> int:
        """``pipe.save``, counting its points; how many there were."""
        self.saving, self.points = True, 0
        try:
            pipe.save(path, **kwargs)
        finally:
            self.saving = False
        return self.points


def _pipe() -> tuple[Any, torch.optim.Optimizer]:
    model = mlp(4, dropout=0.1)  # NOTE: dropout, so resuming must restore the random state
    pipe = gd.DistributedGPipe(model, chunks=2, schedule="1f1b", timeout=60)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.05)


def _snapshot(pipe: Any, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Any:
    return {
        "model": {k: v.detach().clone() for k, v in pipe.user_view().state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "extra": extra,
    }


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: tensors bit for bit, everything else by type and value."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if type(a) is not type(b):
        return [f"{where} ({type(a).__name__} against {type(b).__name__})"]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(map(str, a))} against {sorted(map(str, b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return [f"{where} length"]
        return [
            d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where} ({a!r} against {b!r})"]


def _train(pipe: Any, optimizer: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = float(pipe.train_step(x, y, F.mse_loss))
    optimizer.step()
    optimizer.zero_grad()
    return loss


def resume_and_crash(path: str, log: str, stop: int, point: dict[str, Any] | None) -> Any:
    """Resume from the newest checkpoint in ``path`` (or start), train and save after every
    step; with a ``point``, the second save of this run dies there (``point["rank"]``, the
    fraction ``point["at"]`` of the points the first save had). Without one, train up to
    ``stop``, then train a fresh pipe from step 0 to ``stop`` uninterrupted for comparison.
    """
    rank, folder = dist.get_rank(), Path(log)
    crash = _Crash(folder)
    pipe, optimizer = _pipe()
    start, loaded = 0, []
    if gd.newest_checkpoint(path) is not None:
        extra = pipe.load(path, optimizer=optimizer)
        start = extra["step"]
        torch.set_rng_state(extra["rng"])
        saved = torch.load(folder / f"state-{start}-rank{rank}.pt", weights_only=True)
        loaded = _differences(_snapshot(pipe, optimizer, extra), saved)
    with open(folder / f"loaded-rank{rank}.jsonl", "a") as file:
        file.write(json.dumps([start, loaded]) + "\n")
    losses = {}
    counted = 0
    for step in range(start, stop):
        losses[step] = _train(pipe, optimizer, step).hex()
        extra = {"step": step + 1, "rng": torch.get_rng_state(), "note": f"after step {step}"}
        torch.save(_snapshot(pipe, optimizer, extra), folder / f"state-{step + 1}-rank{rank}.pt")
        with open(folder / f"losses-rank{rank}.jsonl", "a") as file:
            file.write(json.dumps([step, losses[step]]) + "\n")
        crash.armed = point is not None and step == start + 1
        if crash.armed and point is not None and point["rank"] == rank:
            crash.die_at = 1 + int(point["at"] * counted)
        points = crash.save(pipe, path, optimizer=optimizer, extra=extra)
        if crash.armed:
            if crash.die_at is not None:
                crash.die("the end of the save")  # NOTE: it had fewer points than the first
            break
        counted = points
    pipe.close()
    result: dict[str, Any] = {"start": start, "loaded": loaded}
    if point is None:
        final = _snapshot(pipe, optimizer, {})
        plain, plain_optimizer = _pipe()
        result["reference"] = [_train(plain, plain_optimizer, s).hex() for s in range(stop)]
        result["differences"] = _differences(_snapshot(plain, plain_optimizer, {}), final)
        plain.close()
    return result
