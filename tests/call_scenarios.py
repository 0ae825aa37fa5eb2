"""What the ranks of the call and checkpoint fault tests run (issue 39): each function runs
on every rank; the victim rank raises, is killed or stops at one point of a save or a load,
or makes another call than the others."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import filesystem

import gpipe.distributed as gd
from gpipe.distributed import checkpoint, checkpoint_folder
from gpipe.distributed.failure import PipelineFailure

WIDTH = 6
TIMEOUT = 10.0


def _pipe(world: int) -> tuple[gd.DistributedGPipe, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(2 * world)])
    pipe = gd.DistributedGPipe(model, chunks=2, schedule="1f1b", timeout=TIMEOUT)
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    return pipe, x, y


def _call(pipe: gd.DistributedGPipe, call: str, x: torch.Tensor, y: torch.Tensor) -> Any:
    if call == "train_step":
        return pipe.train_step(x, y, nn.functional.mse_loss)
    if call == "eval_step":
        return pipe.eval_step(x)
    if call == "clip_grad_norm_":
        return pipe.clip_grad_norm_(1.0)
    if call == "save":
        return pipe.save(os.environ["GPIPE_TEST_DIR"] + "/ckpt")
    raise ValueError(call)


def mismatched_calls(odd: int, odd_call: str, call: str) -> Any:
    """A step every rank makes, then rank ``odd`` makes ``odd_call`` while the others make
    ``call``: every rank must end with a Python error (the test reads it)."""
    pipe, x, y = _pipe(dist.get_world_size())
    pipe.train_step(x, y, nn.functional.mse_loss)
    _call(pipe, odd_call if dist.get_rank() == odd else call, x, y)
    return "no error"


def _misbehave(how: str) -> None:
    if how == "raise":
        raise OSError("injected: the disk is full")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(1000)  # "hang": a rank that never comes back


def checkpoint_fault(victim: int, how: str, where: str) -> Any:
    """A save (and for ``where`` in load_*, a load after it) in which rank ``victim``
    misbehaves (``how``: raise, kill, stop, hang) at ``where``: before the save's first
    collective, while DCP writes its files, in the commit (rank 0), before the load's first
    collective, or while DCP reads."""
    pipe, x, y = _pipe(dist.get_world_size())
    pipe.train_step(x, y, nn.functional.mse_loss)
    folder = Path(os.environ["GPIPE_TEST_DIR"]) / "ckpt"
    mine = dist.get_rank() == victim
    if where.startswith("load"):
        pipe.save(folder)
    if mine and where == "save_before":
        real = pipe._agree_on
        pipe._agree_on = lambda call: (_misbehave(how), real(call))  # type: ignore[method-assign]
    if mine and where == "save_writing":
        writer = filesystem.FileSystemWriter.write_data
        filesystem.FileSystemWriter.write_data = (  # type: ignore[method-assign]
            lambda self, *a, **k: (_misbehave(how), writer(self, *a, **k))[1]
        )
    if mine and where == "commit":
        commit = checkpoint_folder.commit
        checkpoint_folder.commit = lambda *a, **k: (_misbehave(how), commit(*a, **k))[1]
    if mine and where == "load_before":
        real = pipe._agree_on
        pipe._agree_on = lambda call: (_misbehave(how), real(call))  # type: ignore[method-assign]
    if mine and where == "load_reading":
        reader = filesystem.FileSystemReader.read_data
        filesystem.FileSystemReader.read_data = (  # type: ignore[method-assign]
            lambda self, *a, **k: (_misbehave(how), reader(self, *a, **k))[1]
        )
    began = time.monotonic()
    try:
        if where.startswith("load"):
            pipe.load(folder)
        else:
            pipe.save(folder)
    except PipelineFailure as error:
        return {"error": str(error), "type": "PipelineFailure", "seconds": time.monotonic() - began}
    except OSError as error:
        return {
            "error": str(error),
            "type": type(error).__name__,
            "seconds": time.monotonic() - began,
        }
    return {"error": "", "type": "", "seconds": time.monotonic() - began}


def save_then_load_alike() -> Any:
    """Nothing to load: the same FileNotFoundError on every rank, and the pipe still trains;
    then a save and a load that work."""
    pipe, x, y = _pipe(dist.get_world_size())
    folder = Path(os.environ["GPIPE_TEST_DIR"]) / "nothing"
    try:
        pipe.load(folder)
    except FileNotFoundError as error:
        missing = str(error)
    else:
        missing = ""
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    saved = pipe.save(Path(os.environ["GPIPE_TEST_DIR"]) / "ckpt", extra={"step": 7})
    extra = pipe.load(saved)
    again = pipe.train_step(x, y, nn.functional.mse_loss)
    return {
        "missing": missing,
        "loss": float(loss),
        "step": extra["step"],
        "again": float(again),
        "consolidated": checkpoint.newest_checkpoint(saved.parent) is not None,
    }
