"""twotower.encoder: a from-scratch BERT encoder, its tokenizer, heads, pretraining and checkpoints."""

from twotower.common.device import autocast, bf16_supported, default_device, resolve_bf16
from twotower.encoder.core.checkpoint import load_encoder, save_encoder, save_pretrained
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.encode import SentenceEncoder, encode_texts
from twotower.encoder.core.model import BertModel
from twotower.encoder.core.pooling import cls_pool, max_pool, mean_pool, pool
from twotower.encoder.core.sentence_config import SentenceConfig, read_sentence_config, write_sentence_config
from twotower.encoder.core.tokenizer import Batch, Tokenizer
from twotower.encoder.pretraining.masking import MaskingSpec, mask_tokens, masked_lm_loss
from twotower.encoder.pretraining.mlm import BertForPreTraining
from twotower.encoder.pretraining.pretrain import PretrainArgs, pretrain
from twotower.encoder.training.budget import Budget

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
