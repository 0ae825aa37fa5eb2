"""Example models: an MLP, tiny GPTs (a Sequential one and one in GPT-2's layout), a
ResNet-like CNN, a U-Net-like model, an encoder-decoder, and latency layers."""

from gpipe.models.char import CharTokenizer, char_config, generate, windows
from gpipe.models.gpt import GPTConfig, gpt, gpt_loss, synthetic_tokens
from gpipe.models.gpt2 import GPT2, GPT2Config, gpt2
from gpipe.models.mlp import mlp
from gpipe.models.resnet import ResNet, ResNetConfig, resnet
from gpipe.models.seq2seq import Seq2Seq, Seq2SeqConfig, seq2seq, seq2seq_loss
from gpipe.models.sleep import SleepLayer, delay, sleep_stages
from gpipe.models.unet import UNet, UNetConfig, unet

__all__ = [
    "GPT2",
    "CharTokenizer",
    "GPT2Config",
    "GPTConfig",
    "ResNet",
    "ResNetConfig",
    "Seq2Seq",
    "Seq2SeqConfig",
    "SleepLayer",
    "UNet",
    "UNetConfig",
    "char_config",
    "delay",
    "generate",
    "gpt",
    "gpt2",
    "gpt_loss",
    "mlp",
    "resnet",
    "seq2seq",
    "seq2seq_loss",
    "sleep_stages",
    "synthetic_tokens",
    "unet",
    "windows",
]
