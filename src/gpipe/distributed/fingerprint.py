"""Before the first step: every rank must have built the same pipe, or none runs."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import gpipe

__all__ = ["check_same_everywhere"]


def check_same_everywhere(settings: dict[str, Any]) -> None:
    """Compare this rank's ``settings`` (and versions) with every rank's.

    A collective over the whole job. Ranks given different arguments (another balance, a
    different model, another torch) would exchange messages that do not fit and hang or
    compute nonsense; here they all stop at once instead, each naming what differs.

    Raises:
        ValueError: on every rank, when any rank's fingerprint differs from rank 0's.
    """
    mine = {**settings, "torch": torch.__version__, "gpipe": gpipe.__version__}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        differ = [key for key in mine if theirs[key] != everyone[0][key]]
        if differ:
            shown = ", ".join(
                f"{key}: rank 0 has {everyone[0][key]!r}, rank {rank} has {theirs[key]!r}"
                for key in differ
            )
            raise ValueError(
                f"the ranks built different pipes ({shown}): every rank must construct "
                "DistributedGPipe with the same model and arguments"
            )
