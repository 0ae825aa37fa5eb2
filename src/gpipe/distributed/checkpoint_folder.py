"""A folder of numbered checkpoints that a crash at any moment leaves loadable.

::

    ckpt/
      save-3/          complete checkpoints (each one a torch.distributed.checkpoint folder,
      save-4/            with digests.json: every file's digest, see checkpoint_digest)
      .save-5.saving/  the save under way: every rank writes here

A save writes ``.save-<n>.saving``; once every rank has written its part (and DCP's
``.metadata`` is written last), one rank hashes its files into ``digests.json`` and renames
it to ``save-<n>``: that rename, atomic on a POSIX file system, is the commit. So a
``save-<n>`` folder is complete by construction, digests included, and :func:`newest` (the
highest-numbered one) is the newest complete checkpoint whatever moment a crash cut a save
short: leftovers of the cut save are dot-names it never reads. Older saves beyond ``keep``
are renamed out of the numbered names before they are deleted, so a crash while deleting
never leaves half a checkpoint under a name :func:`newest` reads.

NOTE: no ``latest`` file names the newest save (gpipe wrote one before): written after the
rename, it was stale whenever a crash came between the two, and nothing read it; the
numbered names say it, and ``gpipe.distributed.newest_checkpoint`` reads them.

Files and folders are fsynced where a power cut could otherwise lose the commit: the
manifest and the staging folder before its rename, the parent after it (DCP fsyncs the
files it writes).

Only one rank touches the folder's names; all of them write into the staging folder.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from gpipe.distributed import checkpoint_digest

__all__ = ["begin", "commit", "newest", "staging"]

_NUMBERED = re.compile(r"save-(\d+)")
# what earlier gpipe wrote beside the saves: a file naming the newest ("save-4")
_OLD_POINTER = "latest"


def newest(folder: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``folder``: its ``save-<n>`` folder, or None."""
    saves = _complete(Path(folder))
    return saves[max(saves)] if saves else None


def begin(folder: Path) -> int:
    """Make ``folder`` ready for the next save; return its number.

    Clears what earlier saves cut short left behind (their staging and half-deleted
    folders), so no rank writes beside a dead save's files.
    """
    if (folder / ".metadata").exists():
        raise ValueError(
            f"{folder} is itself a checkpoint (one folder, as gpipe saved before numbered "
            "checkpoints): save into another folder, which will hold numbered ones; "
            f"pipe.load({str(folder)!r}) still reads this one"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(".save-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    # NOTE: left, an earlier gpipe's pointer would name an older save after this one
    (folder / f".{_OLD_POINTER}.writing").unlink(missing_ok=True)
    pointer = folder / _OLD_POINTER
    if pointer.is_file() and _NUMBERED.fullmatch(pointer.read_text(errors="replace").strip()):
        pointer.unlink()
    saves = _complete(folder)
    return max(saves, default=0) + 1


def staging(folder: Path, number: int) -> Path:
    """Where every rank writes save ``number`` until :func:`commit`."""
    return folder / f".save-{number}.saving"


def commit(folder: Path, number: int, keep: int | None) -> Path:
    """Make save ``number`` a complete checkpoint (atomically), its digests recorded, and
    delete the complete ones beyond the newest ``keep`` (None: keep every one)."""
    done = folder / f"save-{number}"
    checkpoint_digest.record(staging(folder, number))
    _fsync(staging(folder, number))
    staging(folder, number).rename(done)
    _fsync(folder)
    if keep is not None:
        saves = _complete(folder)
        for old in sorted(saves)[:-keep]:
            doomed = folder / f".save-{old}.deleting"
            saves[old].rename(doomed)
            shutil.rmtree(doomed)
    return done


def _complete(folder: Path) -> dict[int, Path]:
    """The numbered, so complete, checkpoints in ``folder`` by number."""
    if not folder.is_dir():
        return {}
    found = {}
    for entry in folder.iterdir():
        match = _NUMBERED.fullmatch(entry.name)
        if match and (entry / ".metadata").is_file():
            found[int(match.group(1))] = entry
    return found


def _fsync(path: Path) -> None:
    """Make ``path``'s own entries (a folder's names) durable."""
    # NOTE: a folder cannot be opened for fsync everywhere (Windows, some network file
    # systems); there the rename is as durable as the file system makes it anyway
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
