"""WordPiece tokenizer on top of HF `tokenizers`: train, load, save, and encode batches the BERT way.

One text becomes ``[CLS] A [SEP]``, a pair ``[CLS] A [SEP] B [SEP]`` with segment
id 0 up to and including the first [SEP] and 1 after it.  Batches are padded to
their longest item, never to a fixed length a loaded tokenizer.json may carry
(all-MiniLM-L6-v2's pads everything to 128).

Threads. An HF tokenizer keeps one truncation setting, changed by ``enable_truncation``: shared mutable
state. It used to be set and used under one module-wide lock, so a writer thread tokenizing a whole
request (an index's ``add`` measures and encodes thousands of documents in one call) made every query
of a serving thread wait seconds for its few tokens. Now no tokenizer in use is ever changed: the
untruncated one (``_tok``, also read directly by a few callers) keeps no truncation and no padding from
construction on, and each truncation setting gets its own copy, made once and then only read
(`Tokenizer._for_truncation`). Encoding only reads, so threads tokenize at the same time; the lock is
held only to make a copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from twotower.common.atomic import atomic_write_text
from twotower.common.errors import DataError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# What `Tokenizer.save_pretrained` writes: a directory holding only these is a tokenizer and nothing else.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")
TRUNCATION_STRATEGIES = ("longest_first", "only_first", "only_second")


# Held only while a truncation setting's copy of the HF tokenizer is made (see the module docstring), never
# while text is tokenized. Module-level, so Tokenizer objects stay picklable.
_COPY_LOCK = threading.Lock()
# Truncation settings whose copies a Tokenizer keeps: a handful in practice (query, document, pair lengths);
# past this many the oldest copy is dropped (a thread still using it keeps its own reference).
MAX_TRUNCATION_COPIES = 16


@dataclass
class Batch:
    """A padded batch. Tensors are (B, T) with T = the longest item of this batch."""

    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    attention_mask: torch.Tensor
    offsets: list[list[tuple[int, int]]] = field(default_factory=list)
    word_ids: list[list[int | None]] = field(default_factory=list)
    sequence_ids: list[list[int | None]] = field(default_factory=list)
    overflowing: list[bool] = field(default_factory=list)

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        d = {"input_ids": self.input_ids, "token_type_ids": self.token_type_ids, "attention_mask": self.attention_mask}
        return {k: v.to(device) for k, v in d.items()} if device is not None else d

    def __len__(self) -> int:
        return self.input_ids.shape[0]


class Tokenizer:
    """A BERT WordPiece tokenizer with the special tokens [PAD] [UNK] [CLS] [SEP] [MASK]."""

    def __init__(self, hf: HFTokenizer, lowercase: bool = True, model_max_length: int = 512) -> None:
        self._tok = hf
        self.lowercase = lowercase
        self.model_max_length = model_max_length
        missing = [t for t in SPECIAL_TOKENS if hf.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}; a BERT tokenizer needs {list(SPECIAL_TOKENS)}")
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            hf.token_to_id(t) for t in SPECIAL_TOKENS
        )
        # Registered as special, as transformers' BertTokenizerFast does: a tokenizer built from vocab.txt (or
        # saved from one) had them as plain vocabulary, so decode(skip_special_tokens=True) kept [CLS] and
        # [SEP], and a literal "[MASK]" in text became '[', 'mask', ']'. Only those not registered yet: adding
        # one again would reset its flags (a [MASK] with lstrip=True came back without it).
        registered = {t.content for t in hf.get_added_tokens_decoder().values()}
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS
                               if t not in registered])
        hf.no_padding()
        hf.no_truncation()
        hf.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", self.cls_id), ("[SEP]", self.sep_id)],
        )
        # (max_length, strategy) -> a copy of `hf` with that truncation; `hf` itself is never truncated.
        self._truncated: dict[tuple[int, str], HFTokenizer] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_truncated"] = {}  # copies are remade on demand; no need to pickle them
        return state

    # ---- construction ------------------------------------------------------------------------------
    @staticmethod
    def _blank(lowercase: bool, vocab: dict[str, int] | None = None) -> HFTokenizer:
        hf = HFTokenizer(models.WordPiece(vocab=vocab or {}, unk_token="[UNK]", max_input_chars_per_word=100))
        hf.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
        )
        hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        hf.decoder = decoders.WordPiece(prefix="##")
        return hf

    @classmethod
    def train(
        cls,
        files: Sequence[str] | None = None,
        iterator: Iterable[str] | None = None,
        vocab_size: int = 16000,
        lowercase: bool = True,
        min_frequency: int = 2,
        limit_alphabet: int = 1000,
        progress: bool = True,
    ) -> Tokenizer:
        """Learn a WordPiece vocabulary from text files (.txt, .txt.gz, .jsonl with `text`) or an iterator."""
        if (files is None) == (iterator is None):
            raise ValueError("give exactly one of files= or iterator=")
        hf = cls._blank(lowercase)
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            limit_alphabet=limit_alphabet,
            special_tokens=list(SPECIAL_TOKENS),
            continuing_subword_prefix="##",
            show_progress=progress,
        )
        if iterator is None:
            iterator = iter_text_files(files or [])
        hf.train_from_iterator(iterator, trainer=trainer)
        if hf.get_vocab_size() <= len(SPECIAL_TOKENS):
            raise ValueError("tokenizer training saw no text (empty corpus?)")
        return cls(hf, lowercase=lowercase)

    @classmethod
    def from_vocab(cls, vocab_path: str, lowercase: bool = True) -> Tokenizer:
        if not os.path.isfile(vocab_path):
            raise FileNotFoundError(f"vocab file not found: {vocab_path}")
        with open(vocab_path, encoding="utf-8") as f:
            vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
        return cls(cls._blank(lowercase, vocab), lowercase=lowercase)

    @classmethod
    def from_pretrained(cls, directory: str) -> Tokenizer:
        """Load from `tokenizer.json` (preferred) or `vocab.txt`, honouring tokenizer_config.json."""
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        cfg = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        lowercase = bool(cfg.get("do_lower_case", True))
        max_len = int(cfg.get("model_max_length", 512)) if cfg.get("model_max_length", 512) < 10**6 else 512
        tok_json, vocab_txt = os.path.join(directory, "tokenizer.json"), os.path.join(directory, "vocab.txt")
        if os.path.isfile(tok_json):
            return cls(HFTokenizer.from_file(tok_json), lowercase=lowercase, model_max_length=max_len)
        if os.path.isfile(vocab_txt):
            tok = cls.from_vocab(vocab_txt, lowercase=lowercase)
            tok.model_max_length = max_len
            return tok
        raise FileNotFoundError(f"no tokenizer in {directory}: expected tokenizer.json or vocab.txt")

    def save_pretrained(self, directory: str) -> None:
        """Write tokenizer.json, vocab.txt, tokenizer_config.json and special_tokens_map.json."""
        os.makedirs(directory, exist_ok=True)
        atomic_write_text(os.path.join(directory, "tokenizer.json"), self._tok.to_str(pretty=True))
        vocab = sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1])
        atomic_write_text(os.path.join(directory, "vocab.txt"), "".join(t + "\n" for t, _ in vocab))
        special = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                   "mask_token": "[MASK]"}
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": self.lowercase,
                  "model_max_length": self.model_max_length, **special}
        atomic_write_text(os.path.join(directory, "tokenizer_config.json"), json.dumps(config, indent=2) + "\n")
        atomic_write_text(os.path.join(directory, "special_tokens_map.json"), json.dumps(special, indent=2) + "\n")

    # ---- properties --------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def get_vocab(self) -> dict[str, int]:
        """token -> id, the whole vocabulary (special tokens included)."""
        return self._tok.get_vocab()

    @property
    def special_ids(self) -> list[int]:
        return [self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id]

    def fingerprint(self) -> str:
        """Stable hash of the vocabulary and normalisation: equal fingerprints tokenize identically."""
        h = hashlib.sha256()
        vocab = sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1])
        h.update("\n".join(t for t, _ in vocab).encode())
        h.update(f"lower={self.lowercase}".encode())
        return h.hexdigest()[:16]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def tokenize(self, text: str) -> list[str]:
        return self._tok.encode(text, add_special_tokens=False).tokens

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- encoding ----------------------------------------------------------------------------------
    def _for_truncation(self, max_length: int | None, strategy: str) -> HFTokenizer:
        """The HF tokenizer that truncates at `max_length` with `strategy` (the untruncated one for None).

        Each setting has its own copy, configured before anyone can see it and never changed after:
        concurrent encodes never touch shared mutable state, so none waits for another.
        """
        if strategy not in TRUNCATION_STRATEGIES:
            raise ValueError(f"truncation={strategy!r}; choose one of {TRUNCATION_STRATEGIES}")
        if not max_length:
            return self._tok
        key = (max_length, strategy)
        hf = self._truncated.get(key)
        if hf is None:
            with _COPY_LOCK:
                hf = self._truncated.get(key)
                if hf is None:
                    hf = HFTokenizer.from_str(self._tok.to_str())  # the same tokenizer, its own settings
                    hf.enable_truncation(max_length=max_length, strategy=strategy)
                    copies = dict(self._truncated)  # readers see the old dict or the new one, whole
                    while len(copies) >= MAX_TRUNCATION_COPIES:
                        del copies[next(iter(copies))]
                    copies[key] = hf
                    self._truncated = copies
        return hf

    def _encode_batch(self, texts: Sequence[str], pairs: Sequence[str] | None, max_length: int, truncation: str):
        """HF encodings with special tokens, truncated; the library's bare Exception becomes a ValueError."""
        inputs = list(zip(texts, pairs)) if pairs is not None else list(texts)
        try:
            return self._for_truncation(max_length, truncation).encode_batch(inputs, add_special_tokens=True)
        except Exception as exc:  # tokenizers raises a plain Exception for impossible truncations
            if "runcat" not in str(exc):
                raise
            raise ValueError(
                f"cannot truncate to max_length={max_length} with truncation={truncation!r}: {exc} "
                "(the sequence that may be cut is too short; try truncation='longest_first')"
            ) from None

    def encode_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids without special tokens or truncation (for building pretraining data)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def token_spans(self, texts: Sequence[str]) -> list[tuple[list[tuple[int, int]], list[int | None]]]:
        """Per text: (character offsets, word ids) of its tokens, without special tokens or truncation.

        Offsets index the original string (the normaliser's changes are mapped back), so
        ``text[s:e]`` is the text of a token; splitting long documents into windows uses them.
        """
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [(e.offsets, e.word_ids) for e in encs]

    def encode(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        max_length: int | None = None,
        truncation: str = "longest_first",
    ) -> Batch:
        """Tokenize a batch of texts (or text pairs) and pad to the batch's longest item.

        max_length defaults to `model_max_length`; truncation is one of
        longest_first / only_first / only_second (HF semantics).
        """
        if isinstance(texts, str):
            raise TypeError("encode takes a list of texts; wrap a single text in a list")
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} pairs")
        encs = self._encode_batch(texts, pairs, max_length or self.model_max_length, truncation)
        batch = self.pad([e.ids for e in encs], [e.type_ids for e in encs])
        batch.offsets = [e.offsets for e in encs]
        batch.word_ids = [e.word_ids for e in encs]
        batch.sequence_ids = [e.sequence_ids for e in encs]
        batch.overflowing = [bool(e.overflowing) for e in encs]
        return batch

    def encode_unpadded(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        max_length: int | None = None,
        truncation: str = "longest_first",
    ) -> tuple[list[list[int]], list[list[int]]]:
        """(ids, type_ids) per item, with special tokens and truncation but no padding.

        Fast bulk encoding tokenizes every text exactly once with this, sorts
        by length, and pads each batch with `pad` -- instead of tokenizing
        twice (once to measure, once to batch).
        """
        if isinstance(texts, str):
            raise TypeError("encode_unpadded takes a list of texts; wrap a single text in a list")
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} pairs")
        encs = self._encode_batch(texts, pairs, max_length or self.model_max_length, truncation)
        return [e.ids for e in encs], [e.type_ids for e in encs]

    def pad(self, ids: Sequence[Sequence[int]], type_ids: Sequence[Sequence[int]] | None = None) -> Batch:
        """Pad token-id lists to the longest one: (B, T) tensors with [PAD], segment 0 and mask 0 after each."""
        B = len(ids)
        T = max((len(x) for x in ids), default=0)
        out_ids = np.full((B, T), self.pad_id, dtype=np.int64)
        types = np.zeros((B, T), dtype=np.int64)
        mask = np.zeros((B, T), dtype=np.int64)
        for i, x in enumerate(ids):
            n = len(x)
            out_ids[i, :n] = x
            if type_ids is not None:
                types[i, :n] = type_ids[i]
            mask[i, :n] = 1
        return Batch(
            input_ids=torch.from_numpy(out_ids),
            token_type_ids=torch.from_numpy(types),
            attention_mask=torch.from_numpy(mask),
        )

    def lengths(self, texts: Sequence[str], max_length: int | None = None) -> np.ndarray:
        """Token counts with special tokens, capped at max_length (used to sort batches by length)."""
        cap = max_length or self.model_max_length
        encs = self._tok.encode_batch(list(texts))
        n = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(texts))
        return np.minimum(n, cap)


def iter_text_files(paths: Iterable[str]) -> Iterator[str]:
    """Yield non-empty lines of .txt / .txt.gz files and `text` fields of .jsonl(.gz) files.

    Read through `numbered_lines` / `json_lines`, like every other reader of user files, so a damaged
    file stops the training with ``path:line: ...`` (a `DataError`) rather than a traceback from gzip or
    json, or a vocabulary learned from garbage: a truncated or non-gzip ``.gz``, gzip data in a file not
    named ``*.gz``, a byte that is not UTF-8 (it was replaced by U+FFFD and learned as a character
    without a word), JSON nested too deep or holding a lone surrogate.
    """
    from twotower.common.lines import json_lines, numbered_lines

    for path in paths:
        if path.endswith((".jsonl", ".jsonl.gz")):
            for lineno, obj in json_lines(path):
                text = obj.get("text")
                if not isinstance(text, str):
                    raise DataError(path, lineno, "missing string field 'text'")
                title = obj.get("title")
                line = f"{title}. {text}" if isinstance(title, str) and title else text
                if line := line.strip():
                    yield line
        else:
            for _, line in numbered_lines(path):
                if line := line.strip():
                    yield line
