"""Reading a torch.distributed.checkpoint folder without running code from it.

The folder's ``.metadata`` file is a pickle (DCP writes it so); a plain ``pickle.load``
would call whatever the file names. :class:`SafeReader` reads it with an unpickler that
knows only the metadata's own classes (dataclasses, ``torch.Size``, dtypes, paths), the way
``torch.load(weights_only=True)`` reads tensors, and refuses anything else. Tensors are read
by DCP with ``weights_only=True``; byte entries (arbitrary objects DCP pickles) are refused
by the caller before loading.
"""

from __future__ import annotations

import collections
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

__all__ = ["SafeReader", "read_metadata"]

_ALLOWED: dict[tuple[str, str], Any] = {
    (dcp_metadata.__name__, name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED[(dcp_filesystem.__name__, "_StorageInfo")] = dcp_filesystem._StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
_ALLOWED[("collections", "OrderedDict")] = collections.OrderedDict
for _path in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
    _ALLOWED[("pathlib", _path)] = getattr(pathlib, _path)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"the checkpoint's .metadata names {module}.{name}, which is not part of a "
            "torch.distributed.checkpoint's metadata: gpipe does not load it, since "
            "unpickling it could run code (was the file written by something else?)"
        )


def read_metadata(folder: str | os.PathLike[str]) -> dcp_metadata.Metadata:
    """The metadata of the DCP checkpoint in ``folder``, read without running its code."""
    with open(os.path.join(folder, ".metadata"), "rb") as file:
        metadata = _MetadataUnpickler(file).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(
            f"{folder}/.metadata holds a {type(metadata).__name__}, not a checkpoint's Metadata"
        )
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, but its metadata read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("gpipe reads checkpoints saved with one .metadata file only")
        metadata = read_metadata(self.path)
        storage = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata
