"""twotower.encoder: a from-scratch BERT encoder, its tokenizer, heads, pretraining and checkpoints."""

from encoder.budget import Budget
from encoder.checkpoint import load_encoder, save_encoder, save_pretrained
from encoder.config import EncoderConfig
from encoder.device import autocast, bf16_supported, default_device, resolve_bf16
from encoder.encode import SentenceEncoder, encode_texts
from encoder.masking import MaskingSpec, mask_tokens, masked_lm_loss
from encoder.mlm import BertForPreTraining
from encoder.model import BertModel
from encoder.pooling import cls_pool, max_pool, mean_pool, pool
from encoder.pretrain import PretrainArgs, pretrain
from encoder.sentence_config import SentenceConfig, read_sentence_config, write_sentence_config
from encoder.tokenizer import Batch, Tokenizer

__all__ = [
    "pretrain",
    "PretrainArgs",
    "BertForPreTraining",
    "masked_lm_loss",
    "mask_tokens",
    "MaskingSpec",
    "Budget",
    "Batch",
    "BertModel",
    "EncoderConfig",
    "SentenceConfig",
    "SentenceEncoder",
    "Tokenizer",
    "autocast",
    "bf16_supported",
    "cls_pool",
    "default_device",
    "encode_texts",
    "load_encoder",
    "max_pool",
    "mean_pool",
    "pool",
    "read_sentence_config",
    "resolve_bf16",
    "save_encoder",
    "save_pretrained",
    "write_sentence_config",
]
