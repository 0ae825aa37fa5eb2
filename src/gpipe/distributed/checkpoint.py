"""Checkpoints of a distributed pipe: torch.distributed.checkpoint, keyed by the user's names.

Every parameter and buffer is saved under its fully qualified name in the user's model
(``3.weight``, ``blocks.2.fc1.bias``), and optimizer state under the same names (through
``torch.distributed.checkpoint.state_dict``), so the keys do not depend on the layout: a
checkpoint saved by 4 ranks with balance [2, 2, 2, 2] loads into 2 ranks with [4, 4], or
into a pipe with data-parallel replicas, or (after :func:`consolidate`) into the plain model
in one process. A save is written to a temporary folder and renamed into place once every
rank has finished, so a crash mid-save leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from gpipe.distributed.pipe import DistributedGPipe

__all__ = ["consolidate", "load", "save"]

_MODEL, _OPTIMIZER, _EXTRA = "model", "optimizer", "extra"


def save(
    pipe: DistributedGPipe,
    path: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save this rank's part of the model (and optimizer state) into one checkpoint folder.

    Every rank calls it. ``extra`` holds anything else to keep (the step, the data loader's
    position...): tensors, and values JSON can hold (numbers, strings, lists, dicts).

    Raises:
        TypeError: an ``extra`` value that is neither a tensor nor JSON.
        ValueError: ``optimizer`` holds parameters this rank does not train (one built
            over the whole model, not ``pipe.parameters()``).
    """
    target = Path(path)
    view = pipe.user_view()
    state: dict[str, Any] = {_MODEL: _tensors(view)}
    if optimizer is not None:
        state[_OPTIMIZER] = _optimizer_state(view, optimizer)
    if extra is not None:
        state[_EXTRA] = _pack(extra)
    nonce = _agreed(uuid.uuid4().hex[:12])
    staging = target.with_name(f"{target.name}.saving-{nonce}")
    dcp.save(state, checkpoint_id=staging)
    dist.barrier()
    if dist.get_rank() == 0:
        old = target.with_name(f"{target.name}.old-{nonce}")
        if target.exists():
            target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load(
    pipe: DistributedGPipe,
    path: str | os.PathLike[str],
    *,
    optimizer: Any = None,
) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save` under any layout; return its ``extra``.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: the checkpoint and the model differ (keys missing on either side, or
            shapes that do not match); the message names them.
    """
    source = Path(path)
    if not (source / ".metadata").exists():
        raise FileNotFoundError(f"no checkpoint at {source} (no .metadata file there)")
    metadata = dcp.FileSystemReader(source).read_metadata()
    view = pipe.user_view()
    model = _tensors(view)
    _check_matches(metadata, model)
    state: dict[str, Any] = {_MODEL: model}
    if optimizer is not None:
        if not any(key.startswith(f"{_OPTIMIZER}.") for key in metadata.state_dict_metadata):
            raise ValueError(f"the checkpoint at {source} holds no optimizer state")
        state[_OPTIMIZER] = _optimizer_state(view, optimizer)
    extras = {
        key[len(_EXTRA) + 1 :]: item
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(f"{_EXTRA}.") and isinstance(item, TensorStorageMetadata)
    }
    if extras:
        state[_EXTRA] = {
            key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
            for key, item in extras.items()
        }
    dcp.load(state, checkpoint_id=source)
    if optimizer is not None:
        set_optimizer_state_dict(view, _holding(optimizer), state[_OPTIMIZER], options=_FLAT)
    return _unpack(state[_EXTRA]) if extras else {}


def consolidate(path: str | os.PathLike[str], out_file: str | os.PathLike[str]) -> None:
    """Write the model of a checkpoint as one ordinary ``torch.save`` state_dict file.

    Runs in a single process (no process group needed); the result loads into the plain
    model: ``model.load_state_dict(torch.load(out_file, weights_only=True))``.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source = Path(path)
    if not (source / ".metadata").exists():
        raise FileNotFoundError(f"no checkpoint at {source} (no .metadata file there)")
    target = Path(out_file)
    # NOTE: a name of its own, so processes that all call this (the same script on every
    # rank) do not read each other's half-written files
    whole = target.with_name(f"{target.name}.whole-{uuid.uuid4().hex[:12]}")
    try:
        dcp_to_torch_save(source, whole)
        state = torch.load(whole, weights_only=True)
    finally:
        whole.unlink(missing_ok=True)
    written = target.with_name(f"{target.name}.writing-{uuid.uuid4().hex[:12]}")
    torch.save(state[_MODEL], written)
    written.replace(target)  # whole or not at all, even with several writers


def _tensors(view: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers, by their names in the user's model."""
    return {name: tensor.detach() for name, tensor in view.state_dict(keep_vars=True).items()}


# NOTE: flattened, the state and the group settings (lr, betas...) are keyed by each
# parameter's name, so they follow the parameter to whichever rank holds it next time; keyed
# by group index (the default) the ranks' groups would overwrite each other.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _optimizer_state(view: nn.Module, optimizer: Any) -> dict[str, Any]:
    _refuse_others(view, _holding(optimizer))
    return get_optimizer_state_dict(view, _holding(optimizer), options=_FLAT)


def _refuse_others(view: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise if ``optimizer`` holds parameters this rank does not train.

    NOTE: an optimizer over the whole model (``AdamW(model.parameters())``) holds the
    other ranks' parameters too, freed to meta; torch.distributed.checkpoint, asked for
    their names, failed with ``KeyError: 8``.
    """
    mine = {id(p) for p in view.parameters()}
    others = sum(id(p) not in mine for group in optimizer.param_groups for p in group["params"])
    if others:
        raise ValueError(
            f"the optimizer holds {others} parameters that this rank does not train (other "
            "ranks' stages, freed to meta), so its state cannot be saved or loaded by name: "
            "build it over this rank's own parameters, torch.optim.AdamW(pipe.parameters(), "
            "...), or with pipe.make_optimizer(torch.optim.AdamW, ...)"
        )


def _holding(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: a ZeRO optimizer's own shard.

    Each replica saves the state of the parameters its shard owns, under their names, so
    the checkpoint holds every parameter's state once, and loads into any layout, sharded
    or not.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optim
    return optimizer


def _check_matches(metadata: Any, model: dict[str, torch.Tensor]) -> None:
    """The checkpoint's model keys and shapes against every rank's: one clear error, or none."""
    saved = {
        key[len(_MODEL) + 1 :]: tuple(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(f"{_MODEL}.") and hasattr(item, "size")
    }
    mine = {name: tuple(t.shape) for name, t in model.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    held = {name: shape for part in everyone for name, shape in part.items()}
    missing = sorted(set(held) - set(saved))
    unexpected = sorted(set(saved) - set(held))
    shapes = sorted(
        f"{name} (checkpoint {saved[name]}, model {held[name]})"
        for name in set(saved) & set(held)
        if saved[name] != held[name]
    )
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {', '.join(unexpected)}")
    if shapes:
        problems.append(f"shapes differ: {', '.join(shapes)}")
    if problems:
        raise ValueError(
            "the checkpoint does not fit this model: " + "; ".join(problems) + " (was it "
            "saved from another model?)"
        )


def _pack(extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``extra`` as tensors: its tensors as they are, the rest as JSON bytes."""
    tensors = {f"t.{k}": v.detach().cpu() for k, v in extra.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in extra.items() if not isinstance(v, torch.Tensor)}
    try:
        text = json.dumps(rest)
    except TypeError as error:
        raise TypeError(
            f"extra must hold tensors or values JSON can hold (numbers, strings, lists, dicts): "
            f"{error}"
        ) from error
    return {"json": torch.tensor(list(text.encode()), dtype=torch.uint8), **tensors}


def _unpack(packed: dict[str, torch.Tensor]) -> dict[str, Any]:
    values: dict[str, Any] = json.loads(bytes(packed["json"].tolist()).decode())
    values.update({k[2:]: v for k, v in packed.items() if k.startswith("t.")})
    return values


def _agreed(value: str) -> str:
    """Rank 0's ``value`` on every rank."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return str(holder[0])
