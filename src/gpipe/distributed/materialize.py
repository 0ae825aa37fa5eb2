"""Which layers a rank keeps: its own stages, materialized on its device; the rest, freed.

A model built on the meta device is never materialized as a whole: each rank allocates only
its own stages and initializes them, with the user's ``init_fn`` or each submodule's own
``reset_parameters()``. Layers this rank does not run have their tensors replaced by meta
ones, so the memory they held is freed even though the user's model object still refers to
them.

Nothing trains from memory that nobody wrote: every tensor allocated here is filled with
NaN (integers: their largest value) before it is initialized, and one still holding that
fill when the pipe first runs a stage is refused by name (see :class:`Unwritten`), unless
something (``init_fn``, ``reset_parameters``, ``pipe.load``, a copy from a checkpoint)
wrote it by then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe.split.stage import SplitStage

__all__ = ["Unwritten", "keep_only"]


def keep_only(
    partitions: Sequence[nn.Module],
    held: Sequence[nn.Module | None],
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
) -> Unwritten | None:
    """Materialize the stages this rank holds on ``device``; free every other stage.

    Args:
        partitions: every stage of the model.
        held: the same list with None for the stages this rank does not hold.
        device: this rank's device.
        init_fn: applied to each held layer after materialization from meta, like
            ``layer.apply(init_fn)``; None: each submodule's ``reset_parameters()``.

    Returns:
        The tensors materialized from meta that no initialization wrote, or None if there
        are none. While any stays unwritten, each held stage raises before it runs.

    A tensor a held stage shares with a freed one (a tied weight) is kept, and one tensor
    two held stages share stays one tensor.
    """
    mine = [p for p in held if p is not None]
    kept = {id(t) for p in mine for t in [*p.parameters(), *p.buffers()]}
    for partition, holder in zip(partitions, held):
        if holder is None:
            for module in partition.modules():
                _free(module, kept)
            if isinstance(partition, SplitStage):
                partition.write_through()
    fresh = _allocate(mine, device)
    for partition in mine:
        partition.to(device)
    if not fresh:
        return None
    with torch.no_grad():
        for partition in mine:
            _initialize(partition, init_fn)
    unwritten = Unwritten(
        init_fn is not None,
        [
            (name, module, key)
            for partition in mine
            for name, module, key in _places(partition)
            if id(_tensor(module, key)) in fresh
        ],
    )
    if not unwritten.names():
        return None
    unwritten.refuse_before(mine)
    return unwritten


def _free(module: nn.Module, kept: set[int]) -> None:
    """Replace ``module``'s own tensors by meta ones, except those in ``kept``."""
    for name, param in list(module._parameters.items()):
        if param is not None and id(param) not in kept and not param.is_meta:
            module._parameters[name] = nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and id(buffer) not in kept and not buffer.is_meta:
            module._buffers[name] = torch.empty_like(buffer, device="meta")


def _allocate(partitions: Sequence[nn.Module], device: torch.device) -> set[int]:
    """Give every meta tensor of ``partitions`` memory on ``device``, filled so a read of
    it before anything wrote it shows (NaN, or an integer's largest value); one tensor
    held in several places stays one. The ids of the new tensors."""
    new: dict[int, torch.Tensor] = {}

    def allocate(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in new:
            empty = torch.empty_like(tensor, device=device)
            _fill_unwritten(empty)
            if isinstance(tensor, nn.Parameter):
                empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
            new[id(tensor)] = empty
        return new[id(tensor)]

    for partition in partitions:
        for module in partition.modules():
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is not None and tensor.is_meta:
                        table[key] = allocate(tensor)  # type: ignore[assignment]
        if isinstance(partition, SplitStage):
            partition.write_through()
    return {id(t) for t in new.values()}


def _fill_unwritten(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        elif tensor.dtype != torch.bool:
            tensor.fill_(torch.iinfo(tensor.dtype).max)


def _is_unwritten(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds (some of) the fill of :func:`_fill_unwritten`."""
    if tensor.numel() == 0 or tensor.dtype == torch.bool:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    return bool((tensor == torch.iinfo(tensor.dtype).max).all())


def _initialize(partition: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> None:
    """Run ``init_fn`` (or ``reset_parameters()``) on every module of ``partition``, and on
    each user's module a stand-in of a split stage holds tensors of (see
    :class:`~gpipe.split.SplitStage`), after its children."""

    def init(module: nn.Module) -> None:
        if init_fn is not None:
            init_fn(module)
            return
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()

    for layer in partition.children():
        layer.apply(init)
    if isinstance(partition, SplitStage):
        for user in {id(u): u for _, u in partition.stand_ins()}.values():
            init(user)


def _places(partition: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Every (name, module, key) under which ``partition`` holds a tensor."""
    return [
        (f"{prefix}.{key}" if prefix else key, module, key)
        for prefix, module in partition.named_modules()
        for table in (module._parameters, module._buffers)
        for key, tensor in table.items()
        if tensor is not None
    ]


def _tensor(module: nn.Module, key: str) -> Any:
    return module._parameters.get(key, module._buffers.get(key))


class Unwritten:
    """The tensors this rank allocated that nothing wrote yet, refused until something does.

    Args:
        by_init_fn: whether an ``init_fn`` (rather than ``reset_parameters()``) initialized.
        places: each tensor as (its name in the user's model, the module holding it, its
            key there); looked up again at each :meth:`check`, so a tensor replaced
            (``load_state_dict(assign=True)``) counts as written.
    """

    def __init__(self, by_init_fn: bool, places: list[tuple[str, nn.Module, str]]) -> None:
        self._by_init_fn = by_init_fn
        self._places = places

    def names(self) -> list[str]:
        """The names of the tensors still unwritten (those found written are dropped)."""
        self._places = [p for p in self._places if _is_unwritten(_tensor(p[1], p[2]))]
        return sorted({name for name, _, _ in self._places})

    def refuse_before(self, partitions: Sequence[nn.Module]) -> None:
        """Make each of ``partitions`` :meth:`check` before it runs, until all is written."""
        handles: list[Any] = []

        def hook(module: nn.Module, args: Any) -> None:
            self.check()
            for handle in handles:
                handle.remove()

        handles += [p.register_forward_pre_hook(hook) for p in partitions]

    def check(self) -> None:
        """Raise if a tensor is still unwritten.

        Raises:
            ValueError: naming the tensors and the fixes.
        """
        names = self.names()
        if not names:
            return
        shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
        why = (
            "the init_fn given (which replaces reset_parameters()) did not write them"
            if self._by_init_fn
            else "their modules have no reset_parameters() and no init_fn was given"
        )
        raise ValueError(
            f"{len(names)} tensors of this rank's stages were built on meta and nothing "
            f"initialized them: {shown}; {why}, so they hold uninitialized memory. Pass "
            "DistributedGPipe(..., init_fn=...) that initializes those modules (for a "
            "Hugging Face model, init_fn=model._init_weights), or load weights before the "
            "first step: pipe.load(path) of a checkpoint (one saved from the model built "
            "with from_pretrained), or copy them into this rank's parameters by name"
        )
