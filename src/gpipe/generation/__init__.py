"""Generating text through a pipeline: sampling each lane's next token on the last stage."""

from gpipe.generation.sampling import Sampling, Stopping, next_tokens, warp

__all__ = ["Sampling", "Stopping", "next_tokens", "warp"]
