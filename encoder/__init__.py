"""twotower.encoder: a from-scratch BERT encoder, its tokenizer, heads, pretraining and checkpoints."""

from encoder.checkpoint import load_encoder, save_encoder, save_pretrained
from encoder.config import EncoderConfig
from encoder.device import autocast, bf16_supported, default_device, resolve_bf16
from encoder.model import BertModel
from encoder.tokenizer import Batch, Tokenizer

__all__ = [
    "Batch",
    "BertModel",
    "EncoderConfig",
    "Tokenizer",
    "autocast",
    "bf16_supported",
    "default_device",
    "load_encoder",
    "resolve_bf16",
    "save_encoder",
    "save_pretrained",
]
