"""What a checkpoint holds, read from its metadata: the entries of a section, tensors to
load them into, the checks before a load (no pickled bytes, the model's keys and shapes),
and ``extra``'s and the optimizer settings' values as JSON in uint8 tensors, so that
loading unpickles nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = [
    "check_matches",
    "empty_like_saved",
    "entries",
    "from_json_tensor",
    "json_tensor",
    "pack",
    "refuse_bytes",
    "unpack",
]

_MODEL = "model"


def entries(metadata: Metadata, section: str) -> dict[str, Any]:
    """The checkpoint's entries under ``section``, by their key within it."""
    start = f"{section}."
    return {
        key[len(start) :]: item
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(start)
    }


def empty_like_saved(metadata: Metadata, section: str) -> dict[str, torch.Tensor]:
    """Tensors to load ``section``'s entries into, as the checkpoint holds them."""
    return {
        key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for key, item in entries(metadata, section).items()
    }


def refuse_bytes(metadata: Metadata, source: Path) -> None:
    """Raise if the checkpoint holds entries that are not tensors: DCP would unpickle them."""
    odd = sorted(
        key
        for key, item in metadata.state_dict_metadata.items()
        if not isinstance(item, TensorStorageMetadata)
    )
    if odd:
        shown = ", ".join(odd[:5]) + (f" and {len(odd) - 5} more" if len(odd) > 5 else "")
        raise ValueError(
            f"the checkpoint at {source} holds entries that are not tensors ({shown}): "
            "torch.distributed.checkpoint would unpickle them, which can run code, so gpipe "
            "does not load it (gpipe before numbered checkpoints saved optimizer settings so: "
            "load such a checkpoint without optimizer=, or with the gpipe that wrote it)"
        )


def check_matches(metadata: Metadata, shapes: list[dict[str, list[int]]]) -> None:
    """The checkpoint's model keys and shapes against every rank's (``shapes``: each rank's
    tensors' shapes, gathered before the checks): one clear error, or none."""
    saved = {key: tuple(item.size) for key, item in entries(metadata, _MODEL).items()}
    held = {name: tuple(shape) for part in shapes for name, shape in part.items()}
    missing = sorted(set(held) - set(saved))
    unexpected = sorted(set(saved) - set(held))
    differ = sorted(
        f"{name} (checkpoint {saved[name]}, model {held[name]})"
        for name in set(saved) & set(held)
        if saved[name] != held[name]
    )
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {', '.join(unexpected)}")
    if differ:
        problems.append(f"shapes differ: {', '.join(differ)}")
    if problems:
        raise ValueError(
            "the checkpoint does not fit this model: " + "; ".join(problems) + " (was it "
            "saved from another model?)"
        )


def json_tensor(value: Any) -> torch.Tensor:
    """``value`` as UTF-8 JSON bytes in a uint8 tensor."""
    try:
        text = json.dumps(value, allow_nan=True)
    except TypeError as error:
        raise TypeError(
            "a checkpoint keeps tensors, and values JSON can hold (numbers, strings, lists, "
            f"dicts): {error}"
        ) from error
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def from_json_tensor(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.numpy()).decode())


def pack(extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``extra`` as tensors: its tensors as they are, the rest as JSON bytes."""
    tensors = {f"t.{k}": v.detach().cpu() for k, v in extra.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in extra.items() if not isinstance(v, torch.Tensor)}
    return {"json": json_tensor(rest), **tensors}


def unpack(packed: dict[str, torch.Tensor]) -> dict[str, Any]:
    values: dict[str, Any] = from_json_tensor(packed["json"])
    values.update({k[2:]: v for k, v in packed.items() if k.startswith("t.")})
    return values
