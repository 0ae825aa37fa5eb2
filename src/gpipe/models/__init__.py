"""Example models: an MLP, a tiny GPT (also character-level), and latency layers."""

from gpipe.models.char import CharTokenizer, char_config, generate, windows
from gpipe.models.gpt import GPTConfig, gpt, gpt_loss, synthetic_tokens
from gpipe.models.latency import SleepLayer, delay, sleep_stages
from gpipe.models.mlp import mlp

__all__ = [
    "CharTokenizer",
    "GPTConfig",
    "SleepLayer",
    "char_config",
    "delay",
    "generate",
    "gpt",
    "gpt_loss",
    "mlp",
    "sleep_stages",
    "synthetic_tokens",
    "windows",
]
