"""Re-materialization modes: which micro-batches keep only their stage input."""

from __future__ import annotations

__all__ = ["CHECKPOINT_MODES", "check_checkpoint", "checkpointed"]

CHECKPOINT_MODES = ("always", "except_last", "never")


def check_checkpoint(mode: str) -> str:
    """Return ``mode`` if it is a known checkpoint mode, else raise a ValueError naming them."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, got {mode!r}"
        )
    return mode


def checkpointed(mode: str, microbatch: int, microbatches: int) -> bool:
    """Whether ``microbatch`` of ``microbatches`` is re-materialized in its backward.

    A checkpointed micro-batch runs its forward without autograd, keeps only the stage input,
    and recomputes the forward (same random stream) right before its backward. "except_last"
    spares the last real micro-batch: under fill-drain its backward comes first, so its
    activations would be recomputed at once anyway.
    """
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch < microbatches - 1
    return False
