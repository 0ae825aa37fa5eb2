"""What checkpoint digests cost: a 1 GiB save's commit with and without them, and the check.

One process saves 1 GiB of float32 tensors with torch.distributed.checkpoint (as one rank
writes its part: one ``.distcp`` file) into a numbered folder, and commits it the way
``pipe.save`` does, through ``gpipe.distributed.checkpoint_folder.commit``: with the
digests recorded (every file hashed, the manifest written and fsynced), and with the
recording patched away; the two alternate, round by round. Then it times
``checkpoint_digest.verify`` (what ``load`` and ``consolidate`` run first) beside DCP's own
load of the same files, the hash speed of sha256 and blake2b on this CPU, and the check of
the same 1 GiB saved as 4 files (hashed on parallel threads). Files are in the page cache,
as right after a save; a checkpoint read cold from disk costs its read once more. Each
figure is the fastest of its rounds.

    python benchmarks/checkpoint_digest.py [--gib 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from gpipe.distributed import checkpoint_digest, checkpoint_folder
from gpipe.distributed.checkpoint_reader import SafeReader

_TENSOR_MIB = 64


def _state(gib: float) -> dict[str, dict[str, torch.Tensor]]:
    count = max(1, round(gib * 1024 / _TENSOR_MIB))
    generator = torch.Generator().manual_seed(0)
    numel = _TENSOR_MIB << 18  # float32s in 64 MiB
    return {"model": {f"{i}.weight": torch.rand(numel, generator=generator) for i in range(count)}}


def _timed(call: Callable[[], object]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def _save(
    folder: Path, state: dict[str, dict[str, torch.Tensor]], digests: bool, saves: list[float]
) -> float:
    """One save into ``folder``, committed with or without digests; the commit's seconds
    (DCP's writing, before it, noted in ``saves``)."""
    number = checkpoint_folder.begin(folder)
    staging = checkpoint_folder.staging(folder, number)
    saves.append(_timed(lambda: dcp.save(state, checkpoint_id=staging, no_dist=True)))
    real = checkpoint_digest.record
    if not digests:
        checkpoint_digest.record = lambda folder: None
    try:
        return _timed(lambda: checkpoint_folder.commit(folder, number, keep=None))
    finally:
        checkpoint_digest.record = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    state = _state(args.gib)
    total = sum(t.numel() * t.element_size() for t in state["model"].values())
    with tempfile.TemporaryDirectory(prefix="gpipe-digest-bench-") as tmp:
        folder = Path(tmp) / "ckpt"
        without: list[float] = []
        with_digests: list[float] = []
        saves: list[float] = []
        for _ in range(args.rounds):
            without.append(_save(folder, state, False, saves))
            with_digests.append(_save(folder, state, True, saves))
            newest = checkpoint_folder.newest(folder)
            for old in set(folder.glob("save-*")) - {newest}:
                shutil.rmtree(old)  # NOTE: outside the timed commit, so keep=None above
        assert newest is not None and (newest / checkpoint_digest.MANIFEST).is_file()
        verify = [_timed(lambda: checkpoint_digest.verify(newest)) for _ in range(args.rounds)]
        empty = {"model": {k: torch.empty_like(t) for k, t in state["model"].items()}}
        load = [
            _timed(lambda: dcp.load(empty, storage_reader=SafeReader(newest), no_dist=True))
            for _ in range(args.rounds)
        ]
        data = next(newest.glob("*.distcp"))
        speeds = {}
        for algorithm in ("sha256", "blake2b"):
            seconds = min(
                _timed(functools.partial(checkpoint_digest._hash, data, algorithm))
                for _ in range(args.rounds)
            )
            speeds[algorithm] = data.stat().st_size / seconds / 2**30
        split = Path(tmp) / "four-files"
        dcp.save(state, storage_writer=FileSystemWriter(split, thread_count=4), no_dist=True)
        checkpoint_digest.record(split)
        files = len(list(split.glob("*.distcp")))
        split_verify = [_timed(lambda: checkpoint_digest.verify(split)) for _ in range(args.rounds)]
    commit_without, commit_with = min(without), min(with_digests)
    verify_s, load_s = min(verify), min(load)
    save_s = min(saves)
    split_s = min(split_verify)
    # NOTE: the fastest of the rounds: hashing is CPU work, which other load only slows
    print(f"a {total / 2**30:.2f} GiB save by one rank, the fastest of {args.rounds} rounds")
    print(f"DCP's save (every file written, before the commit): {save_s:.3f} s")
    print(f"commit without digests: {commit_without:.3f} s")
    print(f"commit with digests:    {commit_with:.3f} s (+{commit_with - commit_without:.3f} s)")
    print(f"verify (load, consolidate): {verify_s:.3f} s, beside DCP's load of it {load_s:.3f} s")
    print(f"verify of the same bytes as {files} .distcp files: {split_s:.3f} s")
    print(f"hash speed: sha256 {speeds['sha256']:.2f} GiB/s, blake2b {speeds['blake2b']:.2f} GiB/s")
    print(
        f"RESULT gib={total / 2**30:.2f} save_s={save_s:.3f} commit_without_s={commit_without:.3f} "
        f"commit_with_s={commit_with:.3f} verify_s={verify_s:.3f} load_s={load_s:.3f} "
        f"verify_{files}_files_s={split_s:.3f} sha256_gib_s={speeds['sha256']:.2f} "
        f"blake2b_gib_s={speeds['blake2b']:.2f}"
    )


if __name__ == "__main__":
    main()
