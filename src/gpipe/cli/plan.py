"""Plan a pipeline: search stages, micro-batches, checkpointing and schedules, and rank them.

The ``gpipe plan`` command, on a built-in example model or a user's.

    gpipe plan --devices cpu,cpu,cpu,cpu --batch-size 64 --memory-per-device 200MB
    gpipe plan --model mypkg.models:build --sample-shape 512 --stages 8
    gpipe plan --model mypkg.models:gpt_pair --split-points h.2,h.4,h.6 --stages 4
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from gpipe.cli.options import (
    CommandError,
    choices_list,
    positive_int,
    positive_ints,
    schedule_names,
    shape,
    words,
)
from gpipe.cli.plan_generation import generation_argument, generation_fit_lines
from gpipe.cli.plan_text import (
    calibration_argument,
    cut_fields,
    measured_fields,
    why_this_plan,
    why_this_schedule,
)
from gpipe.recompute import CHECKPOINT_MODES
from gpipe.units import parse_bytes

if TYPE_CHECKING:
    from torch import nn

    from gpipe.planning.verify import Calibration

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``gpipe plan`` options."""
    parser.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="a zero-argument function returning a model (an nn.Sequential, gpipe.Stages, "
        "or any module gpipe.split can trace), or a (model, sample) pair, the sample a "
        "tensor, a tuple of inputs or a dict of inputs by name (default: the tiny GPT of "
        "gpipe.models)",
    )
    parser.add_argument(
        "--sample-shape",
        type=shape,
        metavar="D1,D2,...",
        help="shape of one sample (no batch dimension) for a factory that "
        "returns only the model; the sample is torch.randn(1, D1, D2, ...)",
    )
    parser.add_argument(
        "--split-points",
        type=words,
        default=None,
        metavar="NAME,NAME,...",
        help="for a model that is not an nn.Sequential: the submodules a stage may begin "
        "with, to choose among (default: the start of every unit gpipe.split finds)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--devices",
        type=words,
        default=None,
        help="comma-separated devices (default: cpu,cpu,cpu,cpu)",
    )
    group.add_argument(
        "--stages", type=positive_int, default=None, help="K: plan for K cpu devices"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=16, help="samples per mini-batch (default 16)"
    )
    parser.add_argument(
        "--chunks",
        type=positive_ints,
        default=None,
        help="comma-separated chunk counts (default: every divisor of the batch size)",
    )
    parser.add_argument(
        "--memory-per-device",
        type=_size,
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
        type=choices_list(schedule_names()),
        default=None,
        help="comma-separated schedules to consider (default: every schedule)",
    )
    parser.add_argument(
        "--checkpoints",
        type=choices_list(CHECKPOINT_MODES),
        default=None,
        help="comma-separated checkpoint modes to consider (default: all three)",
    )
    parser.add_argument(
        "--dp",
        type=positive_int,
        default=1,
        help="data-parallel replicas of the pipeline: --batch-size is the global batch and "
        "memory is per device of each replica (default 1)",
    )
    parser.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="plan a DistributedGPipe job of N processes, one device each: every pipeline "
        "depth K (up to the devices given) with N/K replicas, weighed together",
    )
    parser.add_argument(
        "--zero",
        action="store_true",
        help="with --dp: shard the optimizer state over the replicas (ZeRO-1)",
    )
    parser.add_argument(
        "--data-parallel",
        choices=("replicate", "ddp", "fsdp"),
        default="replicate",
        help="with --dp or --world-size: the replicas' engine, as DistributedGPipe's "
        "data_parallel; fsdp counts 1/dp of each stage's parameters and optimizer state, plus "
        "its parameters gathered and gradients unsharded within a step (default replicate)",
    )
    parser.add_argument("--top", type=positive_int, default=5, help="plans to rank (default 5)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs per layer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="run the best plans for a few real steps each, in turns; fit the per-action "
        "cost and compute factor to them and rank the plans that ran by measured time",
    )
    parser.add_argument(
        "--verify-top", type=positive_int, default=3, help="plans --verify runs (default 3)"
    )
    parser.add_argument(
        "--verify-steps",
        type=positive_int,
        default=5,
        help="timed steps per plan --verify runs, after two untimed (default 5)",
    )
    parser.add_argument(
        "--generate",
        type=generation_argument,
        default=None,
        metavar="LENGTH[,ROWS]",
        help="with --memory-per-device: also say, for the best plan's layout, how many rows "
        "of LENGTH positions (prompt plus new tokens) each device's KV cache fits beside its "
        "weights, and how long ROWS rows (default 1) may grow (the model must be one "
        "pipe.generate takes)",
    )
    parser.add_argument(
        "--calibration",
        type=_calibration,
        default=None,
        metavar="MS,SCALE,HEADROOM",
        help="what an earlier --verify on this host fitted (it prints this argument): the "
        "per-action cost in ms, the factor on profiled compute, the memory headroom",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``gpipe plan``: print the report and a RESULT line.

    Raises:
        CommandError: a model that cannot be loaded or run on its sample, or a plan
            request :func:`gpipe.plan` refuses.
    """
    from gpipe.planning.planner import DEFAULT_CHECKPOINTS, DEFAULT_SCHEDULES, plan

    model, sample, loss_fn, target = _load_model(args.model, args.sample_shape)
    devices = ["cpu"] * args.stages if args.stages else args.devices or ["cpu"] * 4
    try:
        report = plan(
            model,
            sample,
            args.batch_size,
            devices,
            args.memory_per_device,
            optimizer=args.optimizer,
            loss_fn=loss_fn,
            target=target,
            schedules=args.schedules or list(DEFAULT_SCHEDULES),
            chunks=args.chunks,
            checkpoints=args.checkpoints or list(DEFAULT_CHECKPOINTS),
            top=args.top,
            progress=not args.no_progress,
            repeats=args.repeats,
            dp=args.dp,
            zero=args.zero,
            data_parallel=args.data_parallel,
            split_points=args.split_points,
            verify=args.verify,
            verify_top=args.verify_top,
            verify_steps=args.verify_steps,
            calibration=args.calibration,
            world_size=args.world_size,
        )
    except (ValueError, TypeError) as error:
        raise CommandError(str(error)) from None
    best = report.best
    print(report)
    for line in [*why_this_schedule(report), *why_this_plan(report)]:
        print(line)
    if report.calibration is not None:
        print(
            "feed it back on this host: gpipe plan ... --calibration "
            f"{calibration_argument(report.calibration)}"
        )
    generation = ""
    if args.generate is not None:
        generation = generation_fit_lines(model, report, args.memory_per_device, *args.generate)
    print(
        f"RESULT best_schedule={best.schedule} stages={best.stages} "
        f"virtual_stages={best.virtual_stages} chunks={best.chunks} "
        f"checkpoint={best.checkpoint} balance={','.join(map(str, best.balance))} "
        f"predicted_ms={best.predicted_step * 1e3:.3f} bubble={best.bubble:.4f} "
        f"peak_memory={max(best.peak_memory)} dp={best.dp} zero={int(best.zero)} "
        f"candidates={len(report) + len(report.rejected)}"
        f"{cut_fields(best)}{measured_fields(report)}"
        + (f" world_size={best.world_size}" if best.world_size is not None else "")
        + generation
    )
    return 0


def _calibration(text: str) -> Calibration:
    """``--calibration MS,SCALE,HEADROOM`` as the planner's :class:`Calibration`."""
    from gpipe.planning.verify import Calibration

    try:
        milliseconds, scale, headroom = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected MS,SCALE,HEADROOM as --verify prints it, e.g. 0.25,1.1,1.0; got {text!r}"
        ) from None
    if not (milliseconds >= 0 and scale > 0 and headroom >= 1):
        raise argparse.ArgumentTypeError(
            f"need a per-action cost >= 0 ms, a compute factor > 0 and a headroom >= 1, got "
            f"{text!r}"
        )
    return Calibration(milliseconds / 1e3, scale, headroom)


def _size(text: str) -> int:
    """A memory budget: ``200MB``, ``1.5GiB`` or bytes, more than 0."""
    try:
        size = parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a size above 0, like 200MB; got {text!r}")
    return size


def _load_model(
    spec: str | None, sample_shape: tuple[int, ...] | None
) -> tuple[nn.Module, Any, Any, Any]:
    """The model, a sample, and a loss and targets (the built-in GPT only).

    Raises:
        CommandError: a bad ``--model``, a factory that fails, or a model that cannot run
            on its sample.
    """
    import torch

    if spec is None:
        if sample_shape is not None:
            raise CommandError(
                "--sample-shape is for a --model factory that returns only a model; the "
                "built-in GPT brings its own token sample: drop --sample-shape, or pass "
                "--model mypkg.models:build"
            )
        from gpipe.models import GPTConfig, gpt, gpt_loss, synthetic_tokens

        config = GPTConfig(layers=4)
        torch.manual_seed(0)
        ids, targets = synthetic_tokens(8, config)
        return gpt(config), ids, gpt_loss, targets
    path, _, name = spec.partition(":")
    if not path or not name:
        raise CommandError(
            f"--model must be module:function, e.g. mypkg.models:build; got {spec!r}"
        )
    # NOTE: a console script's sys.path lacks the current folder, where the user's package
    # usually is; `python -m` and a script run there both find it
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError) as error:
        raise CommandError(
            f"--model {spec}: {error} (looked in the current folder and on PYTHONPATH)"
        ) from None
    try:
        made = factory()
    except Exception as error:
        raise CommandError(f"--model {spec}: {path}.{name}() raised {_describe(error)}") from None
    if isinstance(made, tuple) and len(made) == 2:
        if sample_shape is not None:
            raise CommandError(
                f"{spec} returns a (model, sample) pair, so --sample-shape would be ignored: "
                "drop --sample-shape, or return only the model"
            )
        model, sample = made
        where = f"the sample {spec} returns"
    else:
        if sample_shape is None:
            raise CommandError(f"{spec} returns only a model: pass --sample-shape, e.g. 512")
        model, sample = made, torch.randn(1, *sample_shape)
        where = (
            f"a sample of shape {sample_shape} (--sample-shape: one sample, without its "
            "batch dimension)"
        )
    if not isinstance(model, torch.nn.Module):
        raise CommandError(
            f"--model {spec} must return a model (an nn.Sequential, gpipe.Stages or any "
            f"module gpipe.split can trace), got {type(model).__name__}"
        )
    try:
        with torch.no_grad():
            _call(model, sample)
    except Exception as error:
        raise CommandError(f"the model cannot run on {where}: {_describe(error)}") from None
    return model, sample, None, None


def _call(model: nn.Module, sample: Any) -> Any:
    """``model`` on ``sample``: an nn.Sequential's one input, else a tensor, a tuple of
    positional inputs or a dict of inputs by name (as gpipe.plan reads it)."""
    import torch

    if isinstance(model, torch.nn.Sequential):
        return model(sample)
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(sample)


def _describe(error: BaseException) -> str:
    """``error`` on one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
