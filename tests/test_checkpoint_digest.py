"""A damaged checkpoint is refused by name: every file's digest is recorded at the commit, and
load and consolidate check them first. Also: no stale pointer to the newest save, and ranks
that built different models are told the first tensor that differs."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import gpipe.distributed as gd
from dist_scenarios import WIDTH, mlp
from gpipe.distributed import checkpoint_folder
from gpipe.distributed.checkpoint_digest import MANIFEST, verify
from ranks import check, launch

# NOTE: DCP warns when it writes in one process; here we mean to
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _saved(folder: Path, weight: float) -> Path:
    """One save through begin and commit, as rank 0 does it, of one rank's files."""
    number = checkpoint_folder.begin(folder)
    state = {"model": {"w": torch.full((64,), weight), "b": torch.zeros(3)}}
    dcp.save(state, checkpoint_id=checkpoint_folder.staging(folder, number), no_dist=True)
    return checkpoint_folder.commit(folder, number, keep=2)


def _flip(path: Path) -> None:
    """Flip one bit in the middle of the file ``path``."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_commit_records_every_file_and_an_intact_save_consolidates(tmp_path: Path) -> None:
    done = _saved(tmp_path / "ckpt", 2.0)
    manifest = json.loads((done / MANIFEST).read_text())
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp"]
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (done / name).stat().st_size
        assert len(entry["sha256"]) == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an intact save warns of nothing
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        gd.consolidate(tmp_path / "ckpt", tmp_path / "model.pt")
    assert torch.equal(
        torch.load(tmp_path / "model.pt", weights_only=True)["w"], torch.full((64,), 2.0)
    )


@pytest.mark.parametrize("damaged", ["__0_0.distcp", ".metadata"])
def test_a_flipped_bit_is_refused_naming_the_file(tmp_path: Path, damaged: str) -> None:
    done = _saved(tmp_path / "ckpt", 2.0)
    _flip(done / damaged)
    # a damaged data file is also told by what it holds (its .metadata being intact)
    held = ", which holds model.b, model.w" if damaged == "__0_0.distcp" else ""
    digest = "[0-9a-f]{64}"
    expected = rf"is damaged.* \({re.escape(damaged + held)}: sha256 {digest}, not the {digest} "
    with pytest.raises(ValueError, match=expected + "recorded\\)"):
        gd.consolidate(tmp_path / "ckpt", tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()


def test_a_missing_or_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    done = _saved(tmp_path / "ckpt", 2.0)
    data = done / "__0_0.distcp"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(
        ValueError,
        match=rf"distcp, which holds model.b, model.w: {size - 10} bytes, not the {size}",
    ):
        verify(done)
    data.unlink()
    with pytest.raises(ValueError, match=r"__0_0.distcp, which holds model.b, model.w: missing"):
        gd.consolidate(tmp_path / "ckpt", tmp_path / "model.pt")


def test_a_damaged_manifest_is_refused(tmp_path: Path) -> None:
    done = _saved(tmp_path / "ckpt", 2.0)
    manifest = done / MANIFEST
    manifest.write_text(manifest.read_text()[:-20])
    with pytest.raises(ValueError, match=rf"{MANIFEST} is damaged or not gpipe's"):
        gd.consolidate(tmp_path / "ckpt", tmp_path / "model.pt")
    entry = {"bytes": 1, "sha256": "0" * 64}
    escaping = {"format": "gpipe-checkpoint-digests", "version": 1, "algorithm": "sha256"}
    manifest.write_text(json.dumps({**escaping, "files": {"../outside": entry}}))
    with pytest.raises(ValueError, match=r"entries for '../outside' are malformed"):
        verify(done)


def test_a_checkpoint_saved_without_digests_loads_with_a_warning(tmp_path: Path) -> None:
    old = tmp_path / "old"  # as gpipe saved before it recorded digests
    dcp.save({"model": {"w": torch.full((2,), 7.0)}}, checkpoint_id=old, no_dist=True)
    with pytest.warns(UserWarning, match=rf"has no {MANIFEST}.*read unchecked"):
        gd.consolidate(old, tmp_path / "old.pt")
    assert torch.equal(
        torch.load(tmp_path / "old.pt", weights_only=True)["w"], torch.full((2,), 7.0)
    )


def test_no_pointer_to_the_newest_save_is_left_to_go_stale(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _saved(folder, 1.0)
    # an earlier gpipe's pointer, and a commit cut short after its rename, before the pointer
    (folder / "latest").write_text("save-1\n")
    number = checkpoint_folder.begin(folder)
    assert not (folder / "latest").exists()  # the next save clears it: it would go stale
    staging = checkpoint_folder.staging(folder, number)
    dcp.save({"model": {"w": torch.full((2,), 2.0)}}, checkpoint_id=staging, no_dist=True)
    checkpoint_folder.commit(folder, number, keep=None)
    assert sorted(p.name for p in folder.iterdir()) == ["save-1", "save-2"]
    assert gd.newest_checkpoint(folder) == folder / "save-2"


def two_ranks(path: str) -> Any:
    """On 2 ranks: build a pipe whose model differs on rank 1 (its first layer has no bias,
    so its tensor list is one shorter), then save with the same model and load that save
    intact, and with each kind of damage in turn."""
    built = mlp(2)
    if dist.get_rank() == 1:
        built[0] = nn.Linear(WIDTH, WIDTH, bias=False).double()
    try:
        gd.DistributedGPipe(built, chunks=2, timeout=30)
        mismatch = ""
    except ValueError as error:
        mismatch = str(error)
    pipe = gd.DistributedGPipe(mlp(2), chunks=2, timeout=30)
    saved = Path(pipe.save(path))
    refused = {}
    for damage in ["none", "__1_0.distcp", ".metadata", "missing __0_0.distcp"]:
        target = saved / damage.removeprefix("missing ")
        if dist.get_rank() == 0 and damage != "none":
            backup = target.read_bytes()
            if damage.startswith("missing"):
                target.unlink()
            else:
                _flip(target)
        dist.barrier()
        try:
            pipe.load(path)
            refused[damage] = ""
        except ValueError as error:
            refused[damage] = str(error)
        dist.barrier()
        if dist.get_rank() == 0 and damage != "none":
            target.write_bytes(backup)
        dist.barrier()
    pipe.close()
    return {"mismatch": mismatch, "refused": refused}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """What each of 2 ranks saw in :func:`two_ranks` (one launch for the tests below)."""
    path = tmp_path_factory.mktemp("ckpt")
    return check(launch("test_checkpoint_digest:two_ranks", 2, timeout=150, path=str(path)))


@pytest.mark.timeout(180)
def test_load_refuses_a_damaged_checkpoint_on_every_rank_naming_the_file(
    ranks: list[Any],
) -> None:
    for result in ranks:
        refused = result["refused"]
        assert refused["none"] == ""
        assert (
            "__1_0.distcp, which holds model.2.bias, model.2.weight: sha256"
            in refused["__1_0.distcp"]
        )
        assert ".metadata: sha256" in refused[".metadata"]
        assert (
            "__0_0.distcp, which holds model.0.bias, model.0.weight: missing"
            in refused["missing __0_0.distcp"]
        )


@pytest.mark.timeout(180)
def test_ranks_with_different_tensor_lists_are_told_the_first_difference_only(
    ranks: list[Any],
) -> None:
    for result in ranks:
        assert (
            "tensors[1]: rank 0 has ['0.bias', [6], 'float64'], "
            "rank 1 has ['2.weight', [6, 6], 'float64'] (4 entries on rank 0, 3 on rank 1)"
        ) in result["mismatch"], result["mismatch"]
        assert "2.bias" not in result["mismatch"]  # not the whole list
