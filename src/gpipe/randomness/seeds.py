"""Seeds: one per step, drawn from the global generator, and one per (layer, micro-batch)."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["LOSS_KEY", "LayerKey", "draw_step_seed", "stream_seed"]

LayerKey = int | str
# The key of the loss a pipe computes on its last stage (no submodule name has brackets).
LOSS_KEY = "<loss>"


def draw_step_seed() -> int:
    """A seed for one training step, drawn from the global CPU generator.

    Drawing (rather than reading ``torch.initial_seed()``) makes consecutive steps differ while
    ``torch.manual_seed(s)`` still fixes every step that follows it: right after
    ``torch.manual_seed(s)``, ``draw_step_seed()`` returns the seed of the pipe's next step.
    """
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def stream_seed(step_seed: int, key: LayerKey, microbatch: int) -> int:
    """The seed of one layer's random stream for one micro-batch: a stable hash of the three.

    Args:
        step_seed: the step's seed (:func:`draw_step_seed`).
        key: the layer's position in the user's model (int), its qualified submodule name
            (str), or :data:`LOSS_KEY`.
        microbatch: the micro-batch index within the step.

    Returns:
        A seed in ``[0, 2**63)``, the same in every process and on every platform.

    Raises:
        TypeError: ``key`` is neither an int nor a str.
    """
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"a layer key is an int position or a str name, got {key!r}")
    # NOTE: hashlib, not hash(): Python salts str hashes per process, and every process of a
    # distributed pipe must derive the very same stream.
    kind = "i" if isinstance(key, int) else "s"
    text = f"{step_seed}|{kind}{key}|{microbatch}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
