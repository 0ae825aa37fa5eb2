"""The checkpoint folder and reader, in one process: which save is the newest complete one,
what a commit leaves, and what loading refuses to unpickle."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import gpipe.distributed as gd
from gpipe.distributed import checkpoint_folder
from gpipe.distributed.checkpoint_reader import read_metadata

# NOTE: DCP warns when it writes in one process; here we mean to
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _dcp(folder: Path, state: dict[str, object]) -> None:
    """A torch.distributed.checkpoint of ``state``, written in this process."""
    dcp.save(state, checkpoint_id=folder, no_dist=True)


def _saved(folder: Path, keep: int | None, weight: float) -> Path:
    """One save through begin and commit, as rank 0 does it."""
    number = checkpoint_folder.begin(folder)
    _dcp(checkpoint_folder.staging(folder, number), {"model": {"w": torch.full((2,), weight)}})
    return checkpoint_folder.commit(folder, number, keep)


def test_saves_are_numbered_the_highest_is_the_newest_and_keep_deletes_the_oldest(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    assert gd.newest_checkpoint(folder) is None
    for weight in (1.0, 2.0, 3.0):
        done = _saved(folder, keep=2, weight=weight)
    assert done == folder / "save-3"
    assert sorted(p.name for p in folder.iterdir()) == ["save-2", "save-3"]
    assert gd.newest_checkpoint(folder) == folder / "save-3"
    _saved(folder, keep=None, weight=4.0)
    _saved(folder, keep=None, weight=5.0)
    assert sorted(p.name for p in folder.glob("save-*")) == [f"save-{n}" for n in (2, 3, 4, 5)]


def test_a_cut_save_is_never_read_and_the_next_save_clears_it(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _saved(folder, keep=2, weight=1.0)
    number = checkpoint_folder.begin(folder)
    assert number == 2
    # cut short: the whole checkpoint written, even its .metadata, but never renamed
    _dcp(checkpoint_folder.staging(folder, number), {"model": {"w": torch.full((2,), 2.0)}})
    (folder / ".save-1.deleting").mkdir()  # and a deletion cut short
    assert gd.newest_checkpoint(folder) == folder / "save-1"
    # a commit cut short right after its rename: the save is complete, so newest
    (folder / ".save-2.saving").rename(folder / "save-2")
    assert gd.newest_checkpoint(folder) == folder / "save-2"
    (folder / ".save-7.saving").mkdir()
    assert checkpoint_folder.begin(folder) == 3
    assert not list(folder.glob(".save-*"))  # the leftovers are gone


def test_consolidate_reads_the_newest_save_and_a_folder_of_the_old_layout(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _saved(folder, keep=2, weight=1.0)
    _saved(folder, keep=2, weight=2.0)
    gd.consolidate(folder, tmp_path / "new.pt")
    assert torch.equal(
        torch.load(tmp_path / "new.pt", weights_only=True)["w"], torch.full((2,), 2.0)
    )
    old = tmp_path / "old"  # one checkpoint folder, as gpipe saved before numbered saves
    _dcp(old, {"model": {"w": torch.full((2,), 7.0)}, "extra": {"json": torch.zeros(2)}})
    with pytest.warns(UserWarning, match="no digests.json"):  # saved before gpipe kept them
        gd.consolidate(old, tmp_path / "old.pt")
    assert torch.equal(
        torch.load(tmp_path / "old.pt", weights_only=True)["w"], torch.full((2,), 7.0)
    )
    with pytest.raises(ValueError, match="is itself a checkpoint"):
        checkpoint_folder.begin(old)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        gd.consolidate(tmp_path / "nothing", tmp_path / "x.pt")


def test_byte_entries_are_refused_not_unpickled(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    # a non-tensor value: DCP pickles it into the checkpoint, and would unpickle it on load
    _dcp(folder, {"model": {"w": torch.ones(2)}, "optimizer": {"param_groups.w.lr": 0.1}})
    with (
        pytest.raises(ValueError, match=r"not tensors \(optimizer.param_groups.w.lr\)"),
        pytest.warns(UserWarning, match="no digests.json"),
    ):
        gd.consolidate(folder, tmp_path / "model.pt")


class _Boom:
    """Unpickled, it makes a folder: code run by whoever reads the file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.path),))


def test_a_metadata_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt" / "save-1"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps(_Boom(tmp_path / "ran")))
    with pytest.raises(pickle.UnpicklingError, match=r"names posix\.mkdir"):
        read_metadata(folder)
    with (
        pytest.raises(pickle.UnpicklingError, match=r"names posix\.mkdir"),
        pytest.warns(UserWarning, match="no digests.json"),
    ):
        gd.consolidate(tmp_path / "ckpt", tmp_path / "model.pt")
    assert not (tmp_path / "ran").exists()


def test_a_real_metadata_file_reads_as_dcp_reads_it(tmp_path: Path) -> None:
    state = {
        "model": {"w": torch.randn(3, 2), "b": torch.zeros(4, dtype=torch.float64)},
        "extra": {"json": torch.tensor([1, 2], dtype=torch.uint8)},
    }
    _dcp(tmp_path, state)
    ours = read_metadata(tmp_path)
    theirs = dcp.FileSystemReader(tmp_path).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
