"""A checkpoint's files with their digests: recorded at its commit, checked before reading.

torch.distributed.checkpoint keeps no checksums, so a flipped bit in a ``.distcp`` file
would load as a wrong weight, and nothing would say so. :func:`record` hashes every file of
a save once every rank has written its part, and writes the digests as JSON into the save's
folder, before the rename that commits it, so a committed checkpoint has them whatever
moment a crash came::

    save-7/digests.json
    {"format": "gpipe-checkpoint-digests", "version": 1, "algorithm": "sha256",
     "files": {".metadata": {"bytes": 1493, "sha256": "9f2c..."},
               "__0_0.distcp": {"bytes": 8392, "sha256": "41d0..."}, ...}}

:func:`verify` hashes them again before a checkpoint is read, and refuses it naming every
file that is missing, or whose size or digest is not the one recorded. It guards against
damage (a disk, a copy, a truncated transfer), not against someone who means harm: whoever
can rewrite a file can rewrite the manifest too.

A checkpoint without a manifest (saved before gpipe recorded digests) loads, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from gpipe.distributed.checkpoint_reader import read_metadata

__all__ = ["MANIFEST", "record", "verify"]

MANIFEST = "digests.json"
_FORMAT, _VERSION = "gpipe-checkpoint-digests", 1
# NOTE: sha256 over blake2b: OpenSSL's uses the CPU's SHA instructions where it has them,
# about three times blake2b's speed (benchmarks/checkpoint_digest.py measures both)
_ALGORITHM = "sha256"
_CHUNK = 4 << 20


def record(folder: Path) -> None:
    """Write ``folder``'s manifest: every file in it (but the manifest), its size and digest.

    Run by the one rank that commits, once every rank's files are written; the manifest is
    fsynced before this returns, so the commit's rename that follows makes it durable.
    """
    names = sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and path.name != MANIFEST
    )
    files = {
        name: {"bytes": size, _ALGORITHM: digest}
        for name, (size, digest) in zip(names, _hash_all(folder, names, _ALGORITHM))
    }
    manifest = {"format": _FORMAT, "version": _VERSION, "algorithm": _ALGORITHM, "files": files}
    with open(folder / MANIFEST, "w") as file:
        json.dump(manifest, file, indent=1, sort_keys=True)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())


def verify(source: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Check every file of the checkpoint in ``source`` against the digests of its save.

    Reads the whole checkpoint once (its files hashed in parallel); warns, and checks
    nothing, for a checkpoint that has no manifest (one gpipe saved before it recorded
    digests). ``share=(i, n)`` checks only every ``n``-th file from the ``i``-th, in name
    order: ``n`` ranks each take theirs, and together check them all (only the first warns).

    Raises:
        ValueError: a file the manifest lists is missing, or its size or digest differs
            from the one recorded at its save (the message names each such file, and the
            entries a damaged ``.distcp`` file holds); or the manifest itself is unreadable.
    """
    manifest_path = source / MANIFEST
    if not manifest_path.is_file():
        if share[0] != 0:
            return
        warnings.warn(
            f"the checkpoint at {source} has no {MANIFEST} (saved by a gpipe that recorded "
            "no digests, or the file was removed): its files are read unchecked",
            UserWarning,
            stacklevel=2,
        )
        return
    algorithm, listed = _read_manifest(manifest_path)
    index, count = share
    files = {name: listed[name] for name in sorted(listed)[index::count]}
    problems: dict[str, str] = {}
    for name, entry in files.items():
        path = source / name
        if not path.is_file():
            problems[name] = "missing"
        elif path.stat().st_size != entry["bytes"]:
            problems[name] = f"{path.stat().st_size} bytes, not the {entry['bytes']} recorded"
    present = [name for name in files if name not in problems]
    for name, (_, digest) in zip(present, _hash_all(source, present, algorithm)):
        if digest != files[name][algorithm]:
            problems[name] = f"{algorithm} {digest}, not the {files[name][algorithm]} recorded"
    if problems:
        held = _entries_by_file(source) if ".metadata" not in problems else {}
        shown = "; ".join(
            f"{name}{_holding(held.get(name, []))}: {problem}"
            for name, problem in sorted(problems.items())
        )
        raise ValueError(
            f"the checkpoint at {source} is damaged, its files are not those its save wrote "
            f"({shown}): restore them from a copy, or load an earlier save (its save-<n> "
            "folder)"
        )


def _read_manifest(path: Path) -> tuple[str, dict[str, dict[str, Any]]]:
    """The manifest's algorithm and files, or a ValueError saying what is wrong with it."""
    try:
        manifest = json.loads(path.read_text())
        algorithm, files = manifest["algorithm"], manifest["files"]
        if manifest["format"] != _FORMAT:
            raise ValueError(f"its format is {manifest['format']!r}, not {_FORMAT!r}")
        if manifest["version"] != _VERSION:
            raise ValueError(f"version {manifest['version']!r}: a newer gpipe wrote it")
        if algorithm not in hashlib.algorithms_guaranteed:
            raise ValueError(f"its digests are {algorithm!r}, which hashlib does not know")
        odd = [
            name
            for name, entry in files.items()
            if not _inside(name)
            or not isinstance(entry.get("bytes"), int)
            or not isinstance(entry.get(algorithm), str)
        ]
        if odd:
            raise ValueError(f"its entries for {', '.join(map(repr, odd[:3]))} are malformed")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{path} is damaged or not gpipe's ({type(error).__name__}: {error}), so the "
            "checkpoint's files cannot be checked: restore it from a copy, or load an "
            "earlier save"
        ) from error
    return algorithm, files


def _inside(name: str) -> bool:
    """Whether ``name`` is a relative path that stays inside the checkpoint's folder."""
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _hash_all(folder: Path, names: list[str], algorithm: str) -> list[tuple[int, str]]:
    """Each file's size and hex digest, in ``names``' order; files hashed in parallel
    (hashlib lets go of the GIL while it hashes)."""
    if not names:
        return []
    workers = min(len(names), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(workers, thread_name_prefix="gpipe-digest") as pool:
        return list(pool.map(lambda name: _hash(folder / name, algorithm), names))


def _hash(path: Path, algorithm: str) -> tuple[int, str]:
    """The size and hex digest of the file ``path``, read in chunks."""
    digest = hashlib.new(algorithm)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
            size += count
    return size, digest.hexdigest()


def _entries_by_file(source: Path) -> dict[str, list[str]]:
    """The checkpoint's entries (``model.3.weight``) by the file that holds them; empty
    if its ``.metadata`` cannot be read."""
    try:
        metadata = read_metadata(source)
    except Exception:  # NOTE: only to name entries in an error already being raised
        return {}
    held: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        held.setdefault(str(info.relative_path), set()).add(index.fqn)
    return {name: sorted(entries) for name, entries in held.items()}


def _holding(entries: list[str]) -> str:
    if not entries:
        return ""
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    return f", which holds {shown}"
