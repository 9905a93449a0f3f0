"""EncoderConfig: the hyper-parameters of the BERT encoder, serialised with HF `BertConfig` keys.

Keeping the JSON keys identical to `transformers.BertConfig` is what lets a
directory we write load in `transformers.BertModel.from_pretrained` and lets us
load any BERT-family directory (all-MiniLM-L6-v2, bert-base-uncased, ...)
without a conversion step.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from twotower.common.distributed import launched_as

logger = logging.getLogger(__name__)

# Keys HF writes that carry no meaning for an encoder forward pass; accepted silently.
_HF_IGNORED_KEYS = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "gradient_checkpointing", "use_cache", "classifier_dropout", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "chunk_size_feed_forward", "is_decoder", "add_cross_attention",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "sep_token_id", "directionality",
    "pooler_fc_size", "pooler_num_attention_heads", "pooler_num_fc_layers", "pooler_size_per_head",
    "pooler_type", "tokenizer_class", "finetuning_task", "problem_type", "task_specific_params",
    "num_labels", "id2label", "label2id", "prefix", "decoder_start_token_id", "embedding_size",
    "is_encoder_decoder", "pruned_heads", "tie_encoder_decoder", "cross_attention_hidden_size",
    "output_scores", "return_dict_in_generate", "sentence_transformers", "pad_token_id",
    # a reranker head's settings (twotower.retrieval.cross_encoder): read there, not by the encoder
    "classifier_pooling", "rerank_windows",
}

_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


@dataclass
class EncoderConfig:
    """Hyper-parameters of a BERT encoder.

    Defaults are BERT-base because that is what a bare `BertConfig()` means to
    everyone who has used transformers; the named sizes below are what we
    pretrain on a CPU.  `norm_first`, `ffn_type="geglu"` and `use_bias=False`
    are modern options that are *off* by default so that BERT checkpoints
    load unchanged.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"
    # Options beyond original BERT (written to config.json only when not default).
    norm_first: bool = False
    ffn_type: str = "mlp"  # "mlp" (BERT) or "geglu"
    use_bias: bool = True
    # Task-head metadata and anything else from config.json we round-trip untouched.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"position_embedding_type={self.position_embedding_type!r} is not supported (only 'absolute')"
            )
        if self.ffn_type not in ("mlp", "geglu"):
            raise ValueError(f"ffn_type must be 'mlp' or 'geglu', got {self.ffn_type!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    # ---- named sizes -------------------------------------------------------------------------------
    @classmethod
    def named(cls, size: str, vocab_size: int, **overrides: Any) -> EncoderConfig:
        """Named sizes for pretraining: tiny 2L/128H, mini 4L/256H, small 4L/512H, base 12L/768H."""
        sizes = {
            "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
            "mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
            "small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
            "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
        }
        if size not in sizes:
            raise ValueError(f"unknown size {size!r}; choose one of {sorted(sizes)}")
        return cls(vocab_size=vocab_size, **{**sizes[size], **overrides})

    # ---- (de)serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        defaults = EncoderConfig()
        for opt in ("norm_first", "ffn_type", "use_bias"):
            if getattr(self, opt) == getattr(defaults, opt):
                d.pop(opt)
        return {"architectures": ["BertModel"], "model_type": "bert", **d, **extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> EncoderConfig:
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required config keys {missing}")
        said = launched_as().is_main  # every torchrun rank loads the same model: its warnings are said once
        if d.get("model_type", "bert") not in ("bert", "twotower") and said:
            logger.warning("%s: model_type=%r is not 'bert'; loading as BERT", source, d.get("model_type"))
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known and k not in ("architectures", "model_type")}
        unknown = sorted(k for k in extra if k not in _HF_IGNORED_KEYS)
        if unknown and said:
            logger.warning("%s: unknown config keys kept but unused: %s", source, unknown)
        return cls(**kwargs, extra=extra)

    def save(self, path: str) -> None:
        from twotower.common.atomic import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str) -> EncoderConfig:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(d, source=path)

    def diff(self, other: EncoderConfig) -> list[str]:
        """Names of fields that differ (used to refuse resuming with another config)."""
        a, b = self.to_dict(), other.to_dict()
        return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
