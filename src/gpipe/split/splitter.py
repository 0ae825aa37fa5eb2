"""``gpipe.split``: cut any traceable model into pipeline stages at named submodules."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gpipe.dataflow import Stages
from gpipe.split.cuts import cut_at_points, cut_by_balance
from gpipe.split.measured_cuts import measured_balance
from gpipe.split.stage import build_stages
from gpipe.split.trace import LeafSpec, trace

__all__ = ["split"]


def split(
    model: nn.Module,
    split_points: Sequence[str] | None = None,
    example_inputs: Sequence[Any] | Mapping[str, Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    balance: Sequence[int] | str | None = None,
    num_stages: int | None = None,
    leaf_modules: LeafSpec | None = None,
    devices: Sequence[torch.device | str] | None = None,
) -> Stages:
    """Cut ``model`` into stages that pass named values, for :class:`gpipe.GPipe`.

    The model's forward is traced with torch.fx (see :mod:`gpipe.split.trace` for why not
    torch.export) into one graph over the user's own submodules, which is cut before each
    split point. Each stage module is called with the dict of exactly the values that cross
    into it and returns the dict of values later stages read (the last returns the model's
    output); a value crossing several cuts (a residual stream, a U-Net's long skip, a mask
    every block reads) goes straight from the stage that makes it to each stage that reads
    it. The stages hold the user's own submodules and Parameters, not copies.

        stages = gpipe.split(model, ["h.4", "h.8"], example_inputs=(idx,),
                             example_kwargs={"mask": mask})
        pipe = gpipe.GPipe(stages, chunks=8, schedule="1f1b")

    Args:
        model: the model.
        split_points: qualified submodule names (as in ``model.named_modules()``), in the
            order the model runs them; a stage begins at each (torch pipelining's
            ``SplitPoint.BEGINNING``). None: cut by ``balance``.
        example_inputs: positional inputs of one example call (one micro-batch is enough),
            or a dict of every input by name (``{"idx": idx, "attention_mask": mask}``).
        example_kwargs: keyword inputs of that call (``attention_mask``, ``position_ids``);
            forward arguments given in neither keep their defaults, baked into the trace,
            and so are flag-like values given (``return_dict=True``, an int, ``None``):
            a call of the pipe may repeat them, but not change them. A ``use_cache``
            argument (Hugging Face's) not given is False.
        balance: with no split points, how to cut: a list of units per stage (a unit is a
            top-level child, one block of an ``nn.ModuleList``/``Sequential``, or a child of
            a module holding one, such as GPT-2's ``transformer``),
            or ``"time"``/``"memory"`` to measure the units on the example and balance them
            into ``num_stages`` stages.
        num_stages: how many stages ``balance="time"``/``"memory"`` makes.
        leaf_modules: submodule names or classes to call as a whole, not traced into
            (torch.nn's own layers always are): control flow inside a leaf is fine, but a
            leaf cannot be cut inside.
        devices: the device of each stage, as GPipe's ``devices``.

    Returns:
        The :class:`gpipe.dataflow.Stages`: one module per stage, its ``dataflow``,
        ``balance`` (units per stage) and ``devices``.

    Raises:
        UntraceableError: torch.fx cannot follow the forward (the message names the
            operation, the source line and the ``leaf_modules`` entry that avoids it).
        ValueError: a split point that names no submodule, lies inside a leaf, never runs
            or is out of order; a bad balance or stage count.
        TypeError: a model that is no nn.Module, or example inputs that do not fit its
            forward.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"gpipe.split cuts an nn.Module, got {type(model).__name__}")
    _refuse_compiled(model)
    if _checkpointing(model):
        warnings.warn(
            "the model has gradient checkpointing enabled (Hugging Face's "
            "gradient_checkpointing_enable()); its stages run without it: the pipe's own "
            "checkpoint= re-materializes each stage instead (GPipe(..., checkpoint="
            "'always' | 'except_last' | 'never'))",
            UserWarning,
            stacklevel=2,
        )
    if isinstance(example_inputs, Mapping):  # every input by name: {"idx": idx, "mask": m}
        if example_kwargs:
            raise TypeError(
                "example_inputs given by name (a dict) already holds the keyword inputs; "
                f"put {sorted(example_kwargs)} into it instead of example_kwargs"
            )
        example_inputs, example_kwargs = (), dict(example_inputs)
    if isinstance(example_inputs, (torch.Tensor, str)) or not isinstance(example_inputs, Sequence):
        raise TypeError(
            "example_inputs is the tuple of positional inputs, e.g. example_inputs=(idx,); got "
            f"{type(example_inputs).__name__}"
        )
    kwargs = dict(example_kwargs or {})
    traced = trace(model, example_inputs, kwargs, leaf_modules)
    if split_points is not None:
        if isinstance(split_points, str):
            raise TypeError(f"split_points is a list of names, e.g. [{split_points!r}]")
        if balance is not None:
            raise ValueError(
                f"pass split_points or balance, not both (got {list(split_points)} and {balance!r})"
            )
        if num_stages is not None and num_stages != len(split_points) + 1:
            raise ValueError(
                f"num_stages={num_stages}, but {len(split_points)} split points make "
                f"{len(split_points) + 1} stages"
            )
        cuts = cut_at_points(model, traced.graph, list(split_points), traced.leaves)
    elif isinstance(balance, str):
        if num_stages is None:
            raise ValueError(f"balance={balance!r} needs num_stages=K: how many stages to make")
        inputs = dict(zip(traced.call_order, example_inputs)) | kwargs
        inputs = {name: value for name, value in inputs.items() if name in traced.inputs}
        units = measured_balance(model, traced, inputs, balance, num_stages)
        cuts = cut_by_balance(model, traced.graph, units)
    elif balance is not None:
        cuts = cut_by_balance(model, traced.graph, list(balance))
    else:
        raise ValueError(
            "gpipe.split needs split_points=[...] (submodule names to cut before), or "
            "balance=[units per stage], or balance='time' with num_stages=K"
        )
    modules, dataflow = build_stages(model, traced, cuts)
    if devices is not None and len(devices) != len(modules):
        raise ValueError(f"{len(devices)} devices for {len(modules)} stages")
    return Stages(
        modules,
        dataflow,
        balance=cuts.balance,
        devices=None if devices is None else [torch.device(d) for d in devices],
        constants=traced.constants,
        call_order=traced.call_order,
        source=model,
    )


def _refuse_compiled(model: nn.Module) -> None:
    """A compiled model is a wrapper torch.fx cannot trace: name the fix, not the symptom."""
    dynamo = sys.modules.get("torch._dynamo")  # loaded only if something was compiled
    compiled = dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule)
    if compiled or getattr(model, "_compiled_call_impl", None) is not None:
        raise TypeError(
            "gpipe.split got a compiled model (torch.compile(model) or model.compile()): "
            "split the model itself, and compile its blocks instead: compile each block "
            "(block.compile()) and name them (or their class) in leaf_modules=[...], so each is "
            "called whole, compiled, inside its stage"
        )


def _checkpointing(model: nn.Module) -> bool:
    """Whether a Hugging Face model has its own gradient checkpointing on (newer releases
    name it activation checkpointing and warn on the old name)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False
