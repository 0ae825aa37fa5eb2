"""Example models: an MLP, a tiny GPT, and latency layers for benchmarks and tests."""

from gpipe.models.gpt import GPTConfig, gpt, gpt_loss, synthetic_tokens
from gpipe.models.latency import SleepLayer, delay, sleep_stages
from gpipe.models.mlp import mlp

__all__ = [
    "GPTConfig",
    "SleepLayer",
    "delay",
    "gpt",
    "gpt_loss",
    "mlp",
    "sleep_stages",
    "synthetic_tokens",
]
