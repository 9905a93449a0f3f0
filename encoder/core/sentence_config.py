"""The sentence-transformers side files of a model directory: how token vectors become one text vector.

A sentence-embedding model is more than its BERT weights: all-MiniLM-L6-v2 is
mean-pooled, L2-normalised and truncated at 256 tokens, and those three facts
live in ``1_Pooling/config.json``, ``modules.json`` (a ``Normalize`` module) and
``sentence_bert_config.json``.  Reading them is what makes our defaults give
the vectors sentence-transformers gives; writing them is what lets
``SentenceTransformer(our_dir)`` load a dual encoder we trained.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from twotower.common.atomic import atomic_write_text
from twotower.encoder.core.pooling import POOLING_MODES, ST_POOLING_KEYS

MODULES_NAME = "modules.json"
ST_CONFIG_NAME = "sentence_bert_config.json"
POOLING_CONFIG = os.path.join("1_Pooling", "config.json")
ST_VERSION_NAME = "config_sentence_transformers.json"

_ST_MODULE = "sentence_transformers.models."  # the spelling we write: every release since 2.x loads it
_ST_PACKAGE = "sentence_transformers."
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


def module_kind(type_name: str) -> str | None:
    """The class name of a known sentence-transformers module type, in any of its module paths, else None.

    Releases moved the classes: 2.x-4.x write ``sentence_transformers.models.Transformer``,
    5.x and later ``sentence_transformers.base.modules.transformer.Transformer`` and
    ``sentence_transformers.sentence_transformer.modules.pooling.Pooling``; all name the
    same three modules, so the class name is what counts, within the package.
    """
    if not type_name.startswith(_ST_PACKAGE):
        return None
    name = type_name.rsplit(".", 1)[-1]
    return name if name in _KNOWN_MODULES else None


@dataclass(frozen=True)
class SentenceConfig:
    """pooling: mean | cls | max; normalize: L2-normalise the pooled vector; max_length: token cap (None: model's)."""

    pooling: str = "mean"
    normalize: bool = False
    max_length: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling={self.pooling!r}; choose one of {POOLING_MODES}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length={self.max_length} leaves no room for [CLS] and [SEP]")


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def read_sentence_config(directory: str) -> SentenceConfig | None:
    """The directory's sentence-transformers settings, or None when it has no ``modules.json``.

    Only the module stack BERT -> Pooling [-> Normalize] is understood; a
    stack with a Dense layer or another pooling mode is refused rather than
    silently giving different vectors.
    """
    modules_path = os.path.join(directory, MODULES_NAME)
    if not os.path.isfile(modules_path):
        return None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path}: expected a JSON list of modules")
    pooling: str | None = None
    normalize = False
    for i, m in enumerate(modules):
        kind = m.get("type", "") if isinstance(m, dict) else ""
        name = module_kind(kind) if isinstance(kind, str) else None
        if name == "Transformer":
            continue
        if name == "Normalize":
            normalize = True
        elif name == "Pooling":
            pooling = _read_pooling(os.path.join(directory, m.get("path", "1_Pooling"), "config.json"))
        else:
            raise ValueError(f"{modules_path}: module {i} has type {kind!r}; only Transformer, Pooling and "
                             "Normalize are supported")
    if pooling is None:
        raise ValueError(f"{modules_path}: no Pooling module, so this directory does not define sentence vectors")
    max_length = None
    st_path = os.path.join(transformer_dir(directory), ST_CONFIG_NAME)
    if not os.path.isfile(st_path):
        st_path = os.path.join(directory, ST_CONFIG_NAME)
    if os.path.isfile(st_path):
        value = _read_json(st_path).get("max_seq_length")
        if value is not None:
            if not isinstance(value, int) or value < 2:
                raise ValueError(f"{st_path}: max_seq_length must be an integer >= 2, got {value!r}")
            max_length = value
    return SentenceConfig(pooling=pooling, normalize=normalize, max_length=max_length)


def transformer_dir(directory: str) -> str:
    """Where the BERT files are: `directory` itself, or the Transformer module's folder in older
    sentence-transformers layouts (``0_Transformer/``)."""
    modules_path = os.path.join(directory, MODULES_NAME)
    if not os.path.isfile(modules_path):
        return directory
    modules = _read_json(modules_path)
    for m in modules if isinstance(modules, list) else []:
        if isinstance(m, dict) and module_kind(str(m.get("type", ""))) == "Transformer":
            return os.path.join(directory, m.get("path") or "")
    return directory


def _read_pooling(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pooling config not found: {path}")
    cfg = _read_json(path)
    if isinstance(cfg.get("pooling_mode"), str):  # newer sentence-transformers spelling
        mode = {"mean": "mean", "cls": "cls", "max": "max"}.get(cfg["pooling_mode"])
        if mode is None:
            raise ValueError(f"{path}: pooling_mode={cfg['pooling_mode']!r} is not supported; use one of {POOLING_MODES}")
        return mode
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(on) != 1 or on[0] not in ST_POOLING_KEYS:
        raise ValueError(f"{path}: exactly one of {sorted(ST_POOLING_KEYS)} must be true, found {on}")
    return ST_POOLING_KEYS[on[0]]


def write_sentence_config(directory: str, config: SentenceConfig, dim: int, model_max_length: int) -> None:
    """Write modules.json, sentence_bert_config.json, 1_Pooling/config.json (and 2_Normalize/) atomically.

    `model_max_length` is used when `config.max_length` is None, because
    sentence-transformers needs a number.
    """
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": _ST_MODULE + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST_MODULE + "Pooling"},
    ]
    if config.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": _ST_MODULE + "Normalize"})
        os.makedirs(os.path.join(directory, "2_Normalize"), exist_ok=True)
    pooling = {"word_embedding_dimension": dim}
    for key, mode in ST_POOLING_KEYS.items():
        pooling[key] = config.pooling == mode
    pooling["pooling_mode_mean_sqrt_len_tokens"] = False
    os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
    st = {"max_seq_length": config.max_length or model_max_length, "do_lower_case": False}
    version = {"__version__": {"sentence_transformers": "3.0.0"}, "prompts": {}, "default_prompt_name": None,
               # what twotower ranks by: the inner product of the vectors, a cosine only when they are normalised
               # (it said cosine always, so SentenceTransformer.similarity ranked an unnormalised model otherwise)
               "similarity_fn_name": "cosine" if config.normalize else "dot"}
    for name, obj in ((POOLING_CONFIG, pooling), (ST_CONFIG_NAME, st), (ST_VERSION_NAME, version),
                      (MODULES_NAME, modules)):
        atomic_write_text(os.path.join(directory, name), json.dumps(obj, indent=2) + "\n")
