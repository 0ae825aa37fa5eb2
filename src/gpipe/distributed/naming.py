"""Checkpoint names: a rank's layers under their names in the user's model.

A checkpoint keyed by the names the user's own ``state_dict`` uses loads into any layout
(another split, another rank count) and into the plain model. The stage modules of
:func:`gpipe.split` and :func:`gpipe.skip.stages` hold the user's layers under those names;
only stage modules that use one name for different tensors fall back to ``"stage.name"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["state_names", "under_stage", "user_view"]


def user_view(
    modules: Sequence[nn.Module], stages: Sequence[int] | None, by_stage: bool
) -> nn.Module:
    """One module holding ``modules`` under the user's names.

    Args:
        modules: for ``Stages``, this rank's stage modules; for a Sequential, its partitions
            (whose children are the user's layers, named as in the model).
        stages: the stage of each of ``modules`` for ``Stages``; None for a Sequential.
        by_stage: name each stage's tensors ``"stage.name"`` (their names clash).
    """
    view = nn.Module()
    if stages is None:
        for partition in modules:
            for name, layer in partition.named_children():
                view.add_module(name, layer)
        return view
    state = None if by_stage else state_names(modules)
    if state is None:
        for stage, module in zip(stages, modules):
            view.add_module(str(stage), module)
        return view
    for name, tensor in state.items():
        _place(view, name, tensor)
    return view


def state_names(modules: Sequence[nn.Module]) -> dict[str, torch.Tensor] | None:
    """The parameters and persistent buffers of ``modules`` by their ``state_dict`` names;
    None if one name means different tensors in two of them (a weight tied across stages
    is one tensor under one name)."""
    state: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, tensor in module.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.Tensor) and state.setdefault(name, tensor) is not tensor:
                return None
    return state


def _place(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` (the object itself) in ``root`` under the dotted ``name``."""
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)


def under_stage(stage: int, module: nn.Module) -> nn.Module:
    """``module`` under the name of its stage, so its parameters read ``"stage.name"``."""
    holder = nn.Module()
    holder.add_module(str(stage), module)
    return holder
