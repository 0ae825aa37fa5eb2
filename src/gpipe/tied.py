"""Tied Parameters across a local pipe's devices: a copy per device, one Parameter to train.

A Parameter that stages on different devices use (an embedding tied to the LM head) cannot
live on both. The user's Parameter, the *owner*, goes with the first stage that holds it;
every other device gets one copy, which that device's stages read instead. Each step
starts by bringing the copies up to the owner's values (after the user's optimizer stepped
the owner) and ends by adding the copies' gradients into the owner's, so the owner's
``.grad`` is what plain training gives and the copies never drift.

The copies stay out of sight. A module holding the Parameter still registers the owner,
so ``parameters()``, ``state_dict()``, ``load_state_dict()`` and ``.to(dtype)`` see the
user's model as it was; the copy shadows the owner as the module's instance attribute,
which is what ``module.weight`` reads in its forward.

Stages on one device simply share the Parameter: each stage's backward accumulates into its
one ``.grad`` (NOTE: the autograd engine locks AccumulateGrad, so two stages' workers may
do so at once). A buffer, or a module holding tensors, that stages on different devices
share is refused: a buffer is written in the forward (running statistics), which a copy
would not carry back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["TiedParameters"]


def _apart(a: torch.device, b: torch.device) -> bool:
    """Whether stages on ``a`` and on ``b`` need a copy each of a Parameter they share.

    NOTE: one small function so that tests, which have no second accelerator, can make the
    pipe keep copies between stages on the one CPU (every "cpu" is one memory).
    """
    return a != b and not (a.type == b.type == "cpu")


@dataclass(frozen=True)
class _Holder:
    """One place a stage holds a tensor: ``module``'s attribute ``name``, ``path`` from the
    stage module."""

    stage: int
    module: nn.Module
    name: str
    path: str


@dataclass
class _Copy:
    """One device's copy of a tied Parameter, and where it shadows the owner."""

    owner: nn.Parameter
    replica: nn.Parameter
    holders: list[_Holder]
    seen: int  # the owner's version when last copied


# What a refusal says, given the two holders and their devices.
_Message = Callable[[_Holder, _Holder, torch.device, torch.device], str]


class TiedParameters:
    """The tied Parameters of a local pipe's stages, and the copies that keep them tied.

    Args:
        modules: one module per stage.
        placement: the device index of each stage.
        devices: the pipe's devices.

    Raises:
        ValueError: stages on different devices share a buffer, or a module object that
            holds Parameters or buffers; the message names both stages and the fix.
    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        placement: Sequence[int],
        devices: Sequence[torch.device],
    ) -> None:
        self._placement = tuple(placement)
        self._devices = list(devices)
        params, buffers, modules_held = _holders(modules)
        self._held = [holder for _, holders in params for holder in holders]
        for holders in modules_held:
            self._refuse(holders, _module_message)
        for holders in buffers:
            self._refuse(holders, _buffer_message)
        # Per tied Parameter: the owner, and the holders on each device that needs a copy.
        self._ties: list[tuple[nn.Parameter, dict[int, list[_Holder]]]] = []
        for owner, holders in params:
            home = self._placement[holders[0].stage]
            elsewhere: dict[int, list[_Holder]] = {}
            for holder in holders:
                device = self._placement[holder.stage]
                if self._apart(home, device):
                    elsewhere.setdefault(device, []).append(holder)
            if elsewhere:
                self._ties.append((owner, elsewhere))
        self._copies: list[_Copy] = []
        self._released = False  # see release()
        self._by_stage: dict[int, dict[int, nn.Parameter]] = {}  # see _index

    def __getstate__(self) -> dict[str, object]:
        """What a copy or pickle carries: all but the index by ``id``, which a copy rebuilds."""
        state = self.__dict__.copy()
        del state["_by_stage"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._index()

    def _index(self) -> None:
        """Per stage reading copies: ``id(owner) -> copy``. NOTE: keyed by ``id``, so a
        copied pipe (``copy.deepcopy``) must rebuild it for its own Parameters."""
        self._by_stage = {}
        for copy in self._copies:
            for holder in copy.holders:
                self._by_stage.setdefault(holder.stage, {})[id(copy.owner)] = copy.replica

    def __len__(self) -> int:
        """The number of tied Parameters that need copies."""
        return len(self._ties)

    def _apart(self, a: int, b: int) -> bool:
        return a != b and _apart(self._devices[a], self._devices[b])

    def _refuse(self, holders: list[_Holder], message: _Message) -> None:
        first = holders[0]
        for other in holders[1:]:
            a, b = self._placement[first.stage], self._placement[other.stage]
            if self._apart(a, b):
                raise ValueError(message(first, other, self._devices[a], self._devices[b]))

    def place(self, modules: Iterable[nn.Module]) -> None:
        """Move each stage module to its device, and give every other device its copies.

        A tied Parameter moves only with its owner's stage: it is unregistered from the
        other holders while they move (NOTE: set to None in place, not deleted, so the
        modules list their parameters in the same order after).
        """
        for holder in self._held:  # a copy an earlier pipe over these modules left
            holder.module.__dict__.pop(holder.name, None)
        shadowed = [
            (owner, holder)
            for owner, elsewhere in self._ties
            for holders in elsewhere.values()
            for holder in holders
        ]
        for _, holder in shadowed:
            holder.module._parameters[holder.name] = None
        try:
            for stage, module in enumerate(modules):
                module.to(self._devices[self._placement[stage]])
        finally:
            for owner, holder in shadowed:
                holder.module._parameters[holder.name] = owner
        for owner, elsewhere in self._ties:
            for device, holders in elsewhere.items():
                replica = nn.Parameter(
                    owner.detach().to(self._devices[device], copy=True),
                    requires_grad=owner.requires_grad,
                )
                for holder in holders:
                    # NOTE: an instance attribute comes before nn.Module.__getattr__, which
                    # would find the owner in _parameters: the forward reads the copy.
                    holder.module.__dict__[holder.name] = replica
                self._copies.append(_Copy(owner, replica, holders, owner._version))
        self._index()

    def release(self) -> None:
        """Give the user's modules back their tie: every holder reads the owner again.

        NOTE: after ``pipe.close()`` the user may call the model directly (to evaluate it);
        a holder still shadowed by its copy would read the values of the last step, not the
        owner's after the optimizer stepped it. The next :meth:`refresh` shadows them again.
        """
        for copy in self._copies:
            for holder in copy.holders:
                holder.module.__dict__.pop(holder.name, None)
        self._released = True

    def read_by(self, stage: int, tensor: torch.Tensor) -> torch.Tensor:
        """What ``stage`` reads for ``tensor``: its device's copy of a tied Parameter."""
        return self._by_stage.get(stage, {}).get(id(tensor), tensor)

    def refresh(self) -> None:
        """Bring every copy up to its owner's values, before a step reads them.

        A copy is written only when its owner changed: its version moved (an optimizer
        step), or its values differ (a write through ``.data``, which no version counts).
        NOTE: an unchanged copy is left alone, so a graph that saved it (``pipe(x)`` twice,
        then both backwards) is still valid, as it would be in plain PyTorch.
        """
        if self._released:
            for copy in self._copies:
                for holder in copy.holders:
                    holder.module.__dict__[holder.name] = copy.replica
            self._released = False
        with torch.no_grad():
            for copy in self._copies:
                owner, replica = copy.owner, copy.replica
                if replica.dtype != owner.dtype:  # pipe.to(dtype) converts the owner only
                    replica.data = owner.detach().to(replica.device, copy=True)
                elif owner._version != copy.seen:
                    replica.copy_(owner)
                else:
                    moved = owner.to(replica.device)
                    if not torch.equal(moved, replica):
                        replica.copy_(moved)
                copy.seen = owner._version
                if replica.requires_grad != owner.requires_grad:
                    replica.requires_grad_(owner.requires_grad)

    def collect_gradients(self) -> None:
        """Add every copy's gradient into its owner's, and clear the copy's.

        Through autograd (the owner's gradient accumulator), as a backward of the owner's
        own would: an owner without ``.grad`` takes it, one with accumulates, the owner's
        hooks run, and the accumulator's lock keeps out any backward adding to it at the
        same time (the caller's own, on another device's thread).
        """
        owners, grads = [], []
        for copy in self._copies:
            grad = copy.replica.grad
            if grad is None:
                continue
            copy.replica.grad = None
            if copy.owner.requires_grad:
                owners.append(copy.owner)
                grads.append(grad.to(copy.owner.device))
        if owners:
            torch.autograd.backward(owners, grads)


def _holders(
    modules: Iterable[nn.Module],
) -> tuple[list[tuple[nn.Parameter, list[_Holder]]], list[list[_Holder]], list[list[_Holder]]]:
    """Where the stages hold each Parameter, each buffer, and each module holding either
    (``name`` empty), in stage order: the first holder comes first."""
    params: dict[int, tuple[nn.Parameter, list[_Holder]]] = {}
    buffers: dict[int, list[_Holder]] = {}
    held_by: dict[int, list[_Holder]] = {}
    for stage, module in enumerate(modules):
        for path, sub in module.named_modules(remove_duplicate=False):
            for name, param in sub._parameters.items():
                if param is not None:
                    holder = _Holder(stage, sub, name, _join(path, name))
                    params.setdefault(id(param), (param, []))[1].append(holder)
            for name, buffer in sub._buffers.items():
                if buffer is not None:
                    holder = _Holder(stage, sub, name, _join(path, name))
                    buffers.setdefault(id(buffer), []).append(holder)
            if any(t is not None for t in [*sub._parameters.values(), *sub._buffers.values()]):
                held_by.setdefault(id(sub), []).append(_Holder(stage, sub, "", path))
    return list(params.values()), list(buffers.values()), list(held_by.values())


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _module_message(a: _Holder, b: _Holder, on_a: torch.device, on_b: torch.device) -> str:
    kind = type(a.module).__name__
    return (
        f"stage {a.stage}'s {a.path or '(stage module)'!r} is stage {b.stage}'s "
        f"{b.path or '(stage module)'!r} (one {kind} object holding parameters or buffers), "
        f"but stage {a.stage} runs on {on_a} and stage {b.stage} on {on_b}: a tied Parameter "
        f"gets a copy on each device, a module does not. Give the second use its own {kind} "
        "and tie its Parameters to the first's (`second.weight = first.weight`), put both "
        "uses on one stage (change balance), or give those stages the same device"
    )


def _buffer_message(a: _Holder, b: _Holder, on_a: torch.device, on_b: torch.device) -> str:
    return (
        f"stage {a.stage}'s buffer {a.path!r} is stage {b.stage}'s {b.path!r} (one tensor), "
        f"but stage {a.stage} runs on {on_a} and stage {b.stage} on {on_b}: a tied Parameter "
        "gets a copy on each device, a buffer does not (what one stage writes into it, such "
        "as running statistics, would not reach the other). Give those stages the same "
        "device, or give each module a buffer of its own"
    )
