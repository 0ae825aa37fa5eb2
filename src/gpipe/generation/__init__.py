"""Generating text through a pipeline: each stage keeps its own KV cache, lanes keep the pipe
full, and the last stage samples each lane's next token (``pipe.generate``)."""

from gpipe.generation.cache import DecodeStep, LayerCache, StageCache
from gpipe.generation.generate import GenerationStats
from gpipe.generation.memory import CacheFit
from gpipe.generation.programs import CachedLayer
from gpipe.generation.sampling import Sampling, Stopping, next_tokens, warp

__all__ = [
    "CacheFit",
    "CachedLayer",
    "DecodeStep",
    "GenerationStats",
    "LayerCache",
    "Sampling",
    "StageCache",
    "Stopping",
    "next_tokens",
    "warp",
]
