"""Checkpoints of a distributed pipe: torch.distributed.checkpoint, keyed by the user's names.

Every parameter and buffer is saved under its fully qualified name in the user's model
(``3.weight``, ``blocks.2.fc1.bias``), and optimizer state under the same names (through
``torch.distributed.checkpoint.state_dict``), so the keys do not depend on the layout: a
checkpoint saved by 4 ranks with balance [2, 2, 2, 2] loads into 2 ranks with [4, 4], or
into a pipe with data-parallel replicas, or (after :func:`consolidate`) into the plain model
in one process. Under ``data_parallel="fsdp"`` the parameters and optimizer state are
DTensors: each replica saves its shard, and a load fills whatever each rank holds (a shard
or the whole tensor), so such a checkpoint too loads into any layout and engine.

``path`` is a folder of numbered checkpoints (see :mod:`gpipe.distributed.checkpoint_folder`):
a crash at any moment of a save leaves the newest complete one loadable. What is saved is
tensors only: the optimizer's settings (lr, betas...) and ``extra``'s other values as JSON
in uint8 tensors, so loading unpickles nothing (see :mod:`gpipe.distributed.checkpoint_reader`).
"""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from gpipe.distributed import checkpoint_digest, checkpoint_folder
from gpipe.distributed.checkpoint_calls import (
    TrackedReader,
    TrackedWriter,
    agreed,
    in_checkpoint_thread,
)
from gpipe.distributed.checkpoint_contents import (
    check_matches,
    empty_like_saved,
    entries,
    from_json_tensor,
    json_tensor,
    pack,
    refuse_bytes,
    unpack,
)
from gpipe.distributed.checkpoint_reader import SafeReader, read_metadata
from gpipe.distributed.json_collectives import all_gather_json, broadcast_json

if TYPE_CHECKING:
    from gpipe.distributed.pipe import DistributedGPipe

__all__ = ["consolidate", "load", "newest_checkpoint", "save"]

_MODEL, _OPTIMIZER, _SETTINGS, _EXTRA = "model", "optimizer", "optimizer_settings", "extra"


def save(
    pipe: DistributedGPipe,
    path: str | os.PathLike[str],
    *,
    optimizer: Any = None,
    extra: dict[str, Any] | None = None,
    keep: int | None = 2,
) -> Path:
    """Save this rank's part of the model (and optimizer state) as the next checkpoint in
    the folder ``path``; return the checkpoint's own folder (``path/save-<n>``).

    Every rank calls it. ``extra`` holds anything else to keep (the step, the data loader's
    position, ``torch.get_rng_state()``...): tensors, and values JSON can hold (numbers,
    strings, lists, dicts). ``keep``: how many complete checkpoints to leave in ``path``
    (the older ones are deleted once this one is complete); None keeps every one.

    Raises:
        TypeError: an ``extra`` value that is neither a tensor nor JSON, or a model or
            optimizer entry that is not a tensor and not JSON.
        ValueError: ``optimizer`` holds parameters this rank does not train (one built
            over the whole model, not ``pipe.parameters()``); ``keep`` below 1; ``path`` is
            a checkpoint of the single-folder layout.
    """
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r}: give how many checkpoints to keep (1 or more), or None")
    folder = Path(path)
    guard = pipe._guard
    with guard.running("saving"):
        pipe._agree_on("save")
        state = agreed(guard, "saving", lambda: _saved_state(pipe, optimizer, extra))
        number = agreed(guard, "saving", lambda: _begin(folder), source=0)
        number = broadcast_json(number, 0, guard.everyone, wait=guard.wait)
        staging = checkpoint_folder.staging(folder, number)
        in_checkpoint_thread(
            guard,
            "saving (writing its files)",
            lambda: dcp.save(
                state, storage_writer=TrackedWriter(staging, guard), process_group=guard.everyone
            ),
        )
    # NOTE: DCP's save returns on rank 0 only once every rank's files and the .metadata are
    # written, so rank 0 commits at once; the others wait to hear whether it could
    with guard.running("committing"):
        agreed(guard, "committing", lambda: _commit(folder, number, keep), source=0)
    return folder / f"save-{number}"


def _saved_state(pipe: DistributedGPipe, optimizer: Any, extra: Any) -> dict[str, Any]:
    """What this rank saves: its tensors, optimizer state and ``extra``, by the user's names."""
    view = pipe.user_view()
    state: dict[str, Any] = {_MODEL: _tensors(view)}
    if optimizer is not None:
        state[_OPTIMIZER], settings = _split_settings(_optimizer_state(view, optimizer))
        state[_SETTINGS] = {key: json_tensor(value) for key, value in settings.items()}
    if extra is not None:
        state[_EXTRA] = pack(extra)
    return state


def _begin(folder: Path) -> int:
    """On rank 0: the number of the save about to be written (leftovers cleared); 0
    elsewhere. The ranks agree on it (see :func:`agreed`), so every rank writes there."""
    if dist.get_rank() != 0:
        return 0
    try:
        return checkpoint_folder.begin(folder)
    except (OSError, ValueError) as error:
        raise type(error)(f"cannot save into {folder}: {error}") from error


def _commit(folder: Path, number: int, keep: int | None) -> None:
    """On rank 0: make save ``number`` the newest complete one (see checkpoint_folder)."""
    if dist.get_rank() == 0:
        try:
            checkpoint_folder.commit(folder, number, keep)
        except OSError as error:
            raise OSError(
                f"save {number} in {folder}: rank 0 failed while committing it: {error}"
            ) from error


def load(
    pipe: DistributedGPipe,
    path: str | os.PathLike[str],
    *,
    optimizer: Any = None,
) -> dict[str, Any]:
    """Load the newest complete checkpoint in the folder ``path`` (or the checkpoint
    ``path`` itself: a ``save-<n>`` folder, or one saved before numbered checkpoints) under
    any layout; return its ``extra``.

    Trust: loading runs no code from the files (tensors are read with ``weights_only``,
    DCP's pickled ``.metadata`` with an unpickler that knows only its own classes, and byte
    entries are refused), but a checkpoint from someone else can still hold any weights:
    load those you would run.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        ValueError: the checkpoint and the model differ (keys missing on either side, or
            shapes that do not match), or it holds byte (pickled) entries, or a file of it
            is missing or differs from what its save wrote (checked against the digests
            recorded at the save); the message names them.
        pickle.UnpicklingError: its ``.metadata`` names classes a checkpoint's metadata
            does not hold (the file was written by something else).
    """
    guard = pipe._guard
    with guard.running("loading"):
        pipe._agree_on("load")
        resolved = str(_resolve(path)) if dist.get_rank() == 0 else ""
        source = Path(broadcast_json(resolved, 0, guard.everyone, wait=guard.wait))
        # NOTE: the ranks share the reading of every file against its digest
        agreed(guard, "loading", lambda: _intact(path, source), shared=True)
        view = pipe.user_view()
        # NOTE: gathered before the checks, which run no collective of their own: a rank
        # whose check fails early must not leave another in a collective it never joins
        mine = {name: list(t.shape) for name, t in _tensors(view).items()}
        shapes = all_gather_json(mine, guard.everyone, wait=guard.wait)
        state, settings = agreed(
            guard, "loading", lambda: _loaded_state(view, source, optimizer, shapes)
        )
        in_checkpoint_thread(
            guard,
            "loading (reading its files)",
            lambda: dcp.load(
                state, storage_reader=TrackedReader(source, guard), process_group=guard.everyone
            ),
        )
        if optimizer is not None:
            flat = _join_settings(state[_OPTIMIZER], settings, state[_SETTINGS], source)
            set_optimizer_state_dict(view, _holding(optimizer), flat, options=_FLAT)
        return unpack(state[_EXTRA]) if _EXTRA in state else {}


def _intact(path: str | os.PathLike[str], source: Path) -> None:
    """That ``source`` is a complete checkpoint whose files are as saved (this rank's share
    of them)."""
    if not (source / ".metadata").exists():
        raise FileNotFoundError(
            f"no complete checkpoint at {path} (neither a .metadata file nor a save-<n> "
            "folder holding one): save with pipe.save(path) first"
        )
    checkpoint_digest.verify(source, (dist.get_rank(), dist.get_world_size()))


def _loaded_state(
    view: nn.Module, source: Path, optimizer: Any, shapes: list[dict[str, list[int]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What this rank loads into (its tensors, optimizer state, ``extra``), checked against
    the checkpoint's metadata and every rank's ``shapes``; and the optimizer's settings."""
    metadata = read_metadata(source)
    refuse_bytes(metadata, source)
    model = _tensors(view)
    check_matches(metadata, shapes)
    state: dict[str, Any] = {_MODEL: model}
    settings: dict[str, Any] = {}
    if optimizer is not None:
        if not entries(metadata, _OPTIMIZER):
            raise ValueError(f"the checkpoint at {source} holds no optimizer state")
        state[_OPTIMIZER], settings = _split_settings(_optimizer_state(view, optimizer))
        state[_SETTINGS] = empty_like_saved(metadata, _SETTINGS)
    if entries(metadata, _EXTRA):
        state[_EXTRA] = empty_like_saved(metadata, _EXTRA)
    return state, settings


def newest_checkpoint(path: str | os.PathLike[str]) -> Path | None:
    """The checkpoint :func:`load` would read from ``path``, or None if there is none yet.

    Reads the file system only (no process group): a script asks it to choose between
    resuming and starting afresh, ``pipe.load(path) if newest_checkpoint(path) else ...``.
    """
    found = _resolve(path)
    return found if (found / ".metadata").exists() else None


def consolidate(path: str | os.PathLike[str], out_file: str | os.PathLike[str]) -> None:
    """Write the model of a checkpoint as one ordinary ``torch.save`` state_dict file.

    ``path`` as for :func:`load`. Runs in a single process (no process group needed); the
    result loads into the plain model:
    ``model.load_state_dict(torch.load(out_file, weights_only=True))``.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        ValueError: a file of the checkpoint is missing or differs from what its save wrote
            (the message names it), or the checkpoint holds byte (pickled) entries.
    """
    source = newest_checkpoint(path)
    if source is None:
        raise FileNotFoundError(f"no complete checkpoint at {path}: save with pipe.save first")
    checkpoint_digest.verify(source)
    metadata = read_metadata(source)
    refuse_bytes(metadata, source)
    state = {_MODEL: empty_like_saved(metadata, _MODEL)}
    with warnings.catch_warnings():  # NOTE: DCP warns that it reads in one process: we mean to
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=SafeReader(source), no_dist=True)
    target = Path(out_file)
    written = target.with_name(f"{target.name}.writing-{uuid.uuid4().hex[:12]}")
    torch.save(state[_MODEL], written)
    written.replace(target)  # whole or not at all, even with several writers


def _resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint folder ``path`` names: itself if it holds a .metadata, else its newest
    complete numbered checkpoint (``path`` itself when it holds none)."""
    source = Path(path)
    if (source / ".metadata").exists():
        return source
    return checkpoint_folder.newest(source) or source


def _tensors(view: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers, by their names in the user's model."""
    state = view.state_dict(keep_vars=True)
    odd = sorted(name for name, value in state.items() if not isinstance(value, torch.Tensor))
    if odd:
        raise TypeError(
            f"the model's state_dict holds entries that are not tensors ({', '.join(odd)}, "
            "from a module's get_extra_state): a checkpoint keeps tensors only, so that "
            "loading it unpickles nothing; keep such state in tensors or in extra="
        )
    return {name: tensor.detach() for name, tensor in state.items()}


# NOTE: flattened, the state and the group settings (lr, betas...) are keyed by each
# parameter's name, so they follow the parameter to whichever rank holds it next time; keyed
# by group index (the default) the ranks' groups would overwrite each other.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _optimizer_state(view: nn.Module, optimizer: Any) -> dict[str, Any]:
    _refuse_others(view, _holding(optimizer))
    return get_optimizer_state_dict(view, _holding(optimizer), options=_FLAT)


def _split_settings(flat: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The flattened optimizer state as its tensors, and the rest (``lr``, ``betas``...)
    grouped by what precedes the setting's name (``param_groups.3.weight``)."""
    tensors = {key: value for key, value in flat.items() if isinstance(value, torch.Tensor)}
    settings: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            owner, _, name = key.rpartition(".")
            settings.setdefault(owner, {})[name] = value
    return tensors, settings


def _join_settings(
    tensors: dict[str, torch.Tensor],
    current: dict[str, dict[str, Any]],
    saved: dict[str, torch.Tensor],
    source: Path,
) -> dict[str, Any]:
    """The flattened optimizer state again: the loaded tensors and saved settings, each
    setting in the type the optimizer holds now (JSON gives lists for tuples)."""
    missing = sorted(set(current) - set(saved))
    if missing:
        raise ValueError(
            f"the checkpoint at {source} holds no optimizer settings for {', '.join(missing)} "
            "(was it saved with another optimizer, or another model?)"
        )
    flat: dict[str, Any] = dict(tensors)
    for owner, now in current.items():
        values = from_json_tensor(saved[owner])
        for name, value in values.items():
            was = now.get(name)
            flat[f"{owner}.{name}"] = tuple(value) if isinstance(was, tuple) else value
    return flat


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
