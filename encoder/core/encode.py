"""Fast bulk encoding of texts into sentence vectors, and `SentenceEncoder`, the reusable tower.

Where the time goes when encoding a corpus on a CPU, and what we do about it:

- Padding. Each text is tokenized exactly once; texts are sorted by token
  length (longest first, so an out-of-memory shows up at once) and every
  batch is padded only to its own longest item.  On a mixed-length corpus
  this removes nearly all padding compute.
- Precision. On CPUs with native bf16 matmul (AVX512-BF16 / AMX) and on
  Ampere+ GPUs, the forward runs in bf16.  By default a bf16 *copy of the
  weights* is made once (and cached until the fp32 weights change), which
  avoids autocast's per-op casts; ``bf16_mode="autocast"`` keeps LayerNorm
  and residuals in fp32 instead, for a little more accuracy.  Both are
  measured in ``benchmarks/embed_speed.py``.  ``bf16=False`` (or
  ``TWOTOWER_BF16=0``) switches it off.
- Parallelism. On a CPU, batches run concurrently, one per core, each
  single-threaded, instead of splitting every op of one batch across the
  cores: an encoder the size of MiniLM has matmuls too small to split well,
  and one thread per batch has no per-op barriers for a busy neighbour on a
  shared machine to stall.
- Overhead. ``torch.inference_mode``, no pooler, no per-batch tokenizer
  calls, Q/K/V fused into one matmul in the inference copy; rows are
  scattered back into input order in one preallocated array.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from twotower.common.device import resolve_bf16
from twotower.common.malloc import steady_thresholds_for, trim_free_heap_for
from twotower.encoder.core.model import BertModel, BertSelfAttention
from twotower.encoder.core.pooling import POOLING_MODES, pool
from twotower.encoder.core.sentence_config import (
    SentenceConfig,
    read_sentence_config,
    transformer_dir,
    write_sentence_config,
)
from twotower.encoder.core.tokenizer import Batch, Tokenizer

logger = logging.getLogger(__name__)

BF16_MODES = ("weights", "autocast")
# Padded tokens per batch when no batch size is given.  On CPU small batches keep MiniLM's activations
# near the cache and under glibc's mmap threshold: 8-16 texts of 256 tokens beat 64 or 128
# (`benchmarks/embed_speed.py --batch-size`), and 2048 tokens beat 4096 in bf16 (whose FFN activations
# at 4096 were still mapped afresh, page-faulted in, every forward) while tying in fp32 (docs/results.md).
CPU_BATCH_TOKENS = 2048
GPU_BATCH_TOKENS = 65536
MAX_BATCH_TEXTS = 1024


def default_batch_tokens(device: torch.device) -> int:
    """Padded tokens a forward when no batch size is given: the one rule for encoding and reranking."""
    return CPU_BATCH_TOKENS if device.type == "cpu" else GPU_BATCH_TOKENS

# model -> (signature of its parameters, dtype, device, inference copy)
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(model: nn.Module) -> tuple:
    """Changes whenever any weight is replaced or updated in place (optimizer step, load_state_dict)."""
    return tuple((id(t), t._version, t.data_ptr()) for t in (*model.parameters(), *model.buffers()))


def inference_copy(model: BertModel, dtype: torch.dtype, device: torch.device) -> BertModel:
    """`model` itself when it already has `dtype` on `device`, else a frozen eval-mode copy, cached per model.

    The copy also fuses each layer's Q/K/V projections into one matmul.

    The cache is invalidated as soon as the original's weights change, so a
    model that is being trained can be encoded with between steps safely.
    """
    p = next(model.parameters())
    if p.dtype == dtype and p.device == device:
        return model
    sig = _signature(model)
    hit = _COPIES.get(model)
    if hit is not None and hit[0] == sig and hit[1] == dtype and hit[2] == device:
        return hit[3]
    _COPIES.pop(model, None)  # free the stale copy before making a new one
    with torch.no_grad():
        clone = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    for q in clone.parameters():
        q.requires_grad_(False)
        q.grad = None
    for module in clone.modules():
        if isinstance(module, BertSelfAttention):
            module.fuse_qkv()  # one (3H, H) matmul instead of three; safe because the copy is frozen
    _COPIES[model] = (sig, dtype, device, clone)
    return clone


def batch_spans(sorted_lengths: np.ndarray, batch_size: int | None, batch_tokens: int | None) -> list[tuple[int, int]]:
    """[start, end) spans over length-sorted (longest first) texts.

    A fixed `batch_size`, or else as many texts as keep ``texts x longest``
    within `batch_tokens` (at least one text, at most MAX_BATCH_TEXTS).
    """
    n = len(sorted_lengths)
    if batch_size is not None:
        return [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    spans, s = [], 0
    while s < n:
        size = max(1, min(MAX_BATCH_TEXTS, batch_tokens // max(1, int(sorted_lengths[s]))))
        spans.append((s, min(s + size, n)))
        s += size
    return spans


def length_batches(lengths: np.ndarray, batch_size: int | None, batch_tokens: int | None) -> list[np.ndarray]:
    """Indices of the texts of each forward: sorted longest first (stable), cut by `batch_spans`."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[s:e] for s, e in batch_spans(np.asarray(lengths)[order], batch_size, batch_tokens)]


def check_texts(texts: Any, plural: str = "texts", item: str = "texts[{i}]") -> tuple[list[str], bool]:
    """(`texts` as a list, whether one string was given); a TypeError naming the position of a non-string
    (`item`, e.g. ``"query {i}"``) or saying what `plural` must be.

    Why one check: ``DualEncoder.encode(["ok", None])`` failed inside with "unsupported operand type(s) for +"
    and ``encode(5)`` with "'int' object is not iterable", where the pipeline's queries said "query 1 is
    NoneType, not str"; the encoders and the pipeline now say it alike.
    """
    if isinstance(texts, str):
        return [texts], True
    if isinstance(texts, (bytes, bytearray)) or not isinstance(texts, Iterable):
        raise TypeError(f"{plural} must be a str or a list of str, got {type(texts).__name__}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"{item.format(i=i)} is {type(t).__name__}, not str")
    return texts, False


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings; wrap a single text in a list")
    return check_texts(texts)[0]


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def encode_texts(
    model: BertModel,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    batch_size: int | None = None,
    max_length: int | None = None,
    pooling: str = "mean",
    normalize: bool = False,
    bf16: bool | str = "auto",
    progress: bool = True,
    device: torch.device | str | None = None,
    bf16_mode: str = "weights",
    out: np.ndarray | None = None,
    workers: int | None = None,
    batch_tokens: int | None = None,
) -> np.ndarray:
    """Encode `texts` into one float32 vector each, rows in input order.

    Args:
        model, tokenizer: an encoder and its tokenizer (e.g. from `load_encoder`).
        texts: N strings.
        batch_size: texts per forward pass; None -> as many as fit in
            `batch_tokens` (so short texts go in big batches, long in small).
        max_length: token cap including [CLS]/[SEP]; None -> the tokenizer's
            `model_max_length`, never more than the model's position table.
        pooling: "mean" (over real tokens), "cls" or "max".
        normalize: L2-normalise each vector (cosine = dot product).
        bf16: "auto" (use where the hardware has native bf16), True, False.
        progress: show a tqdm bar when there is more than one batch.
        device: where to run; None -> where the model is.
        bf16_mode: "weights" (cast a cached copy of the weights to bf16) or
            "autocast" (fp32 weights, bf16 matmuls).
        out: optional preallocated (N, H) array (e.g. an `np.memmap`) to fill.
        workers: batches run concurrently, each on one thread; None -> one
            per torch thread on CPU, 1 on GPU.  1 -> batches one after the
            other with torch's intra-op threads.
        batch_tokens: padded tokens per batch when `batch_size` is None;
            None -> 2048 on CPU (small batches stay in cache), 65536 on GPU.

    Returns:
        (N, H) float32 array (`out` when given).

    Example:
        >>> vecs = encode_texts(model, tok, ["a cat", "a dog sat"], normalize=True)  # doctest: +SKIP
        >>> vecs.shape
        (2, 384)
    """
    texts = _check_texts(texts)
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling={pooling!r}; choose one of {POOLING_MODES}")
    if bf16_mode not in BF16_MODES:
        raise ValueError(f"bf16_mode={bf16_mode!r}; choose one of {BF16_MODES}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_tokens is not None and batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    N, H = len(texts), model.config.hidden_size
    if out is None:
        out = np.empty((N, H), dtype=np.float32)
    elif out.shape != (N, H):
        raise ValueError(f"out has shape {out.shape}, expected {(N, H)}")
    if N == 0:
        return out
    device = torch.device(device) if device is not None else _model_device(model)
    use_bf16 = resolve_bf16(bf16, device)
    cap = min(max_length or tokenizer.model_max_length, model.config.max_position_embeddings)
    if cap < 2:
        raise ValueError(f"max_length={cap} leaves no room for [CLS] and [SEP]")

    ids, _ = tokenizer.encode_unpadded(texts, max_length=cap)  # each text tokenized once
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=N)

    steady_thresholds_for(device)  # a forward's freed activations stay in the heap for the next (common/malloc.py)
    weights_bf16 = use_bf16 and bf16_mode == "weights"
    net = inference_copy(model, torch.bfloat16 if weights_bf16 else torch.float32, device)
    use_autocast = use_bf16 and not weights_bf16
    if batch_size is None and batch_tokens is None:
        batch_tokens = default_batch_tokens(device)
    batches = length_batches(lengths, batch_size, batch_tokens)  # longest first
    if workers is None:
        workers = torch.get_num_threads() if device.type == "cpu" else 1
    workers = max(1, min(workers, len(batches)))

    def run_batch(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        batch = tokenizer.pad([ids[i] for i in idx])
        # inference_mode and autocast are thread-local: enter them in the thread that runs the batch.
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            mask = batch.attention_mask.to(device, non_blocking=True)  # (b, T)
            # [CLS] pooling reads one state: the last layer runs at [CLS] alone (same vectors, fewer FLOPs).
            cls = torch.zeros((len(idx), 1), dtype=torch.long, device=device) if pooling == "cls" else None
            hidden, _ = net(batch.input_ids.to(device, non_blocking=True), mask, return_pooled=False,
                            query_positions=cls)  # (b, T, H), or (b, 1, H) at [CLS]
            vecs = pool(hidden, mask, pooling)  # (b, H) float32
            if normalize:
                vecs = F.normalize(vecs, dim=-1)
            return idx, vecs.float().cpu().numpy()

    bar = None
    if progress and len(batches) > 1:
        from tqdm.auto import tqdm

        bar = tqdm(total=N, desc="encode", unit="text")
    was_training, threads = net.training, torch.get_num_threads()
    executor = None
    net.eval()
    try:
        if workers == 1:
            results = map(run_batch, batches)
        else:
            # One batch per core, each single-threaded: no per-op thread barriers (MiniLM-sized
            # matmuls are too small to split well) and robust when other processes share the cores.
            torch.set_num_threads(1)  # process-wide; restored below
            executor = ThreadPoolExecutor(workers, thread_name_prefix="encode")
            results = executor.map(run_batch, batches)
        for idx, vecs in results:
            out[idx] = vecs
            if bar is not None:
                bar.update(len(idx))
    finally:
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)
        if bar is not None:
            bar.close()
        net.train(was_training)
        trim_free_heap_for(device)  # free pages left in the heap's holes go back (common/malloc.py)
    return out


class SentenceEncoder(nn.Module):
    """One tower of a dual encoder: BERT + pooling (+ L2 normalisation), with a fixed token cap.

    `forward` is differentiable (for contrastive training); `encode` is the
    fast, no-grad path for corpora and queries.  Directories written by
    `save_pretrained` load in `sentence_transformers.SentenceTransformer`.

    Example:
        >>> enc = SentenceEncoder.from_pretrained(path)  # doctest: +SKIP
        >>> enc.encode(["a cat sat", "dogs bark"]).shape
        (2, 384)
    """

    def __init__(
        self,
        model: BertModel,
        tokenizer: Tokenizer,
        pooling: str = "mean",
        normalize: bool = False,
        max_length: int | None = None,
        bf16: bool | str = "auto",
    ) -> None:
        super().__init__()
        # Checked here, on the device the model is on, not at the first encode: bf16="yes" was taken for True,
        # and True on a CPU without native bf16 failed only when the first texts were encoded.
        resolve_bf16(bf16, _model_device(model))
        self.model = model
        self.tokenizer = tokenizer
        self.sentence_config = SentenceConfig(pooling=pooling, normalize=normalize, max_length=max_length)
        self.bf16 = bf16  # the setting ("auto" is resolved per encode, on the device the model is on then)
        # The source checkpoint's pooler (pooler.dense.*), unused by sentence pooling and kept out of the
        # model (and so of the fingerprint) but written back by `save_pretrained`: without it transformers and
        # sentence-transformers load the export with a freshly initialised pooler, and say so.
        self.pooler_state: dict[str, torch.Tensor] = {}

    # ---- settings ----------------------------------------------------------------------------------
    @property
    def pooling(self) -> str:
        return self.sentence_config.pooling

    @property
    def normalize(self) -> bool:
        return self.sentence_config.normalize

    @property
    def max_length(self) -> int:
        """The effective token cap (sentence config, else tokenizer, never past the position table)."""
        cap = self.sentence_config.max_length or self.tokenizer.model_max_length
        return min(cap, self.model.config.max_position_embeddings)

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    @property
    def device(self) -> torch.device:
        return _model_device(self.model)

    # ---- loading and saving ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        directory: str,
        pooling: str | None = None,
        normalize: bool | None = None,
        max_length: int | None = None,
        bf16: bool | str = "auto",
        device: torch.device | str = "cpu",
    ) -> SentenceEncoder:
        """Load any HF BERT-family directory; defaults come from its sentence-transformers files if present.

        Without those files the defaults are mean pooling, no normalisation and
        the tokenizer's `model_max_length`.  Explicit arguments always win.
        """
        from twotower.encoder.core.checkpoint import load_encoder, read_pooler

        model, tokenizer = load_encoder(transformer_dir(directory), device=device, add_pooling_layer=False)
        st = read_sentence_config(directory) or SentenceConfig()
        enc = cls(
            model,
            tokenizer,
            pooling=pooling if pooling is not None else st.pooling,
            normalize=normalize if normalize is not None else st.normalize,
            max_length=max_length if max_length is not None else st.max_length,
            bf16=bf16,
        )
        enc.pooler_state = read_pooler(transformer_dir(directory))
        return enc

    def save_pretrained(self, directory: str) -> None:
        """Write the HF directory (config, safetensors, tokenizer) plus the sentence-transformers files; the
        source's pooler (`pooler_state`) goes with the weights, so other libraries load the export as it was."""
        from twotower.encoder.core.checkpoint import save_encoder

        save_encoder(self.model, self.tokenizer, directory, extra=self.pooler_state)
        write_sentence_config(directory, self.sentence_config, self.dim, self.max_length)

    # ---- encoding ----------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> Batch:
        """Padded batch of `texts`, truncated at `max_length`."""
        return self.tokenizer.encode(_check_texts(texts), max_length=self.max_length)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Differentiable sentence vectors. (B, T) ids and mask -> (B, H) float32."""
        hidden, _ = self.model(input_ids, attention_mask, token_type_ids, return_pooled=False)  # (B, T, H)
        vecs = pool(hidden, attention_mask, self.pooling)  # (B, H)
        return F.normalize(vecs, dim=-1) if self.normalize else vecs

    def encode(
        self,
        texts: Sequence[str],
        batch_size: int | None = None,
        progress: bool = True,
        bf16: bool | str | None = None,
        out: np.ndarray | None = None,
        batch_tokens: int | None = None,
        workers: int | None = None,
    ) -> np.ndarray:
        """Fast no-grad encoding: (N,) texts -> (N, H) float32, rows in input order (see `encode_texts`)."""
        return encode_texts(
            self.model, self.tokenizer, texts, batch_size=batch_size, max_length=self.max_length,
            pooling=self.pooling, normalize=self.normalize, bf16=self.bf16 if bf16 is None else bf16,
            progress=progress, out=out, batch_tokens=batch_tokens, workers=workers,
        )
