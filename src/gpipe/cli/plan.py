"""Plan a pipeline: search stages, micro-batches, checkpointing and schedules, and rank them.

The ``gpipe plan`` command, on a built-in example model or a user's.

    gpipe plan --devices cpu,cpu,cpu,cpu --batch-size 64 --memory-per-device 200MB
    gpipe plan --model mypkg.models:build --sample-shape 512 --stages 8
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``gpipe plan`` options."""
    parser.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="a zero-argument function returning an nn.Sequential, or a "
        "(model, sample) pair (default: the tiny GPT of gpipe.models)",
    )
    parser.add_argument(
        "--sample-shape",
        metavar="D1,D2,...",
        help="shape of one sample (no batch dimension) for a factory that "
        "returns only the model; the sample is torch.randn(1, D1, D2, ...)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--devices", default=None, help="comma-separated devices (default: cpu,cpu,cpu,cpu)"
    )
    group.add_argument("--stages", type=int, default=None, help="K: plan for K cpu devices")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="samples per mini-batch (default 16)"
    )
    parser.add_argument(
        "--chunks",
        default=None,
        help="comma-separated chunk counts (default: every divisor of the batch size)",
    )
    parser.add_argument(
        "--memory-per-device",
        default=None,
        metavar="SIZE",
        help="memory budget per device, e.g. 200MB or 1.5GiB",
    )
    parser.add_argument(
        "--optimizer",
        default=None,
        help="count this optimizer's state (sgd, sgd-momentum, adam, adamw)",
    )
    parser.add_argument(
        "--schedules",
        default=None,
        help="comma-separated schedules to consider (default: gpipe,1f1b,interleaved,zb-h1)",
    )
    parser.add_argument(
        "--checkpoints",
        default=None,
        help="comma-separated checkpoint modes to consider (default: all three)",
    )
    parser.add_argument("--top", type=int, default=5, help="plans to rank (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per layer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``gpipe plan``: print the report and a RESULT line; 2 on bad input."""
    from gpipe.planning.planner import DEFAULT_CHECKPOINTS, DEFAULT_SCHEDULES, plan

    schedules = args.schedules.split(",") if args.schedules else list(DEFAULT_SCHEDULES)
    checkpoints = args.checkpoints.split(",") if args.checkpoints else list(DEFAULT_CHECKPOINTS)
    try:
        model, sample, loss_fn, target = _load_model(args.model, args.sample_shape)
        if args.stages is not None:
            devices = ["cpu"] * args.stages
        else:
            devices = (args.devices or "cpu,cpu,cpu,cpu").split(",")
        report = plan(
            model,
            sample,
            args.batch_size,
            devices,
            args.memory_per_device,
            optimizer=args.optimizer,
            loss_fn=loss_fn,
            target=target,
            schedules=schedules,
            chunks=None if args.chunks is None else [int(c) for c in args.chunks.split(",")],
            checkpoints=checkpoints,
            top=args.top,
            progress=not args.no_progress,
            repeats=args.repeats,
        )
    except (ValueError, TypeError, ImportError, AttributeError) as error:
        print(f"gpipe plan: error: {error}", file=sys.stderr)
        return 2
    best = report.best
    print(report)
    print(
        f"RESULT best_schedule={best.schedule} stages={best.stages} "
        f"virtual_stages={best.virtual_stages} chunks={best.chunks} "
        f"checkpoint={best.checkpoint} balance={','.join(map(str, best.balance))} "
        f"predicted_ms={best.predicted_step * 1e3:.3f} bubble={best.bubble:.4f} "
        f"peak_memory={max(best.peak_memory)} "
        f"candidates={len(report) + len(report.rejected)}"
    )
    return 0


def _load_model(spec: str | None, shape: str | None) -> tuple[nn.Sequential, Any, Any, Any]:
    """The model, a sample, and a loss and targets (the built-in GPT only)."""
    import torch

    if spec is None:
        from gpipe.models import GPTConfig, gpt, gpt_loss, synthetic_tokens

        config = GPTConfig(layers=4)
        torch.manual_seed(0)
        ids, targets = synthetic_tokens(8, config)
        return gpt(config), ids, gpt_loss, targets
    path, _, name = spec.partition(":")
    if not path or not name:
        raise ValueError(f"--model must be module:function, e.g. mypkg.models:build; got {spec!r}")
    made = getattr(importlib.import_module(path), name)()
    if isinstance(made, tuple):
        model, sample = made
    else:
        if shape is None:
            raise ValueError(f"{spec} returns only a model: pass --sample-shape, e.g. 512")
        model, sample = made, torch.randn(1, *(int(d) for d in shape.split(",")))
    return model, sample, None, None
