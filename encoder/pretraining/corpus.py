"""A pretraining corpus tokenized once into flat on-disk arrays, cached by corpus and tokenizer fingerprint.

Layout of one cache entry (a directory swapped into place atomically):
    tokens.bin        raw uint16 (vocabulary <= 65536) or uint32 token ids, all documents concatenated
    word_starts.bin   np.packbits of a parallel bit array: 1 where a token starts a word (from the
                      tokenizer's word ids), which is what whole-word masking needs
    doc_offsets.npy   int64 (n_docs + 1,): document d is tokens[off[d]:off[d+1]]
    meta.json         counts, dtype, fingerprints, replaced-byte count

Documents: in .txt / .txt.gz a blank line ends a document and every other line is
a paragraph of it (the BERT convention, and how gutenberg-en-mlm is laid out); in
.jsonl every record is one document (``text``, optionally ``title``).  Bytes that
are not UTF-8 are replaced with U+FFFD and counted, never a crash.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from twotower.common.atomic import atomic_replace_dir, atomic_write_text
from twotower.common.lines import RepeatedKeyError, no_repeated_keys

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
_replaced = [0]


def _count_and_replace(exc: UnicodeError) -> tuple[str, int]:
    _replaced[0] += exc.end - exc.start
    return "\ufffd", exc.end


codecs.register_error("twotower.count_replace", _count_and_replace)


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("TWOTOWER_CACHE", os.path.expanduser("~/.cache/twotower")), "tokens")


def check_corpus_files(paths: Sequence[str], what: str = "corpus") -> list[str]:
    """Fail early with the file name: missing, not a file, empty, or an unsupported extension."""
    if not paths:
        raise ValueError(f"no {what} files given")
    out = []
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{what} file not found: {p}")
        if not p.endswith((".txt", ".txt.gz", ".jsonl", ".jsonl.gz")):
            raise ValueError(f"{what} file {p}: unsupported extension (use .txt, .txt.gz or .jsonl)")
        if os.path.getsize(p) == 0:
            raise ValueError(f"{what} file {p} is empty")
        out.append(os.path.abspath(p))
    return out


def read_documents(path: str) -> Iterator[list[str]]:
    """Yield each document of `path` as its list of non-empty paragraphs."""
    opener = gzip.open if path.endswith(".gz") else open
    is_jsonl = path.endswith((".jsonl", ".jsonl.gz"))
    doc: list[str] = []
    with opener(path, "rt", encoding="utf-8", errors="twotower.count_replace") as f:
        for lineno, line in enumerate(f, 1):
            if is_jsonl:
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line, object_pairs_hook=no_repeated_keys)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
                except RepeatedKeyError as exc:
                    raise ValueError(f"{path}:{lineno}: {exc}") from None
                text = obj.get("text") if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: missing string field 'text'")
                title = obj.get("title")
                paras = ([title] if isinstance(title, str) and title.strip() else []) + text.split("\n")
                paras = [p.strip() for p in paras if p.strip()]
                if paras:
                    yield paras
                continue
            line = line.strip()
            if line:
                doc.append(line)
            elif doc:
                yield doc
                doc = []
    if doc:
        yield doc


def _file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def corpus_key(paths: Sequence[str], tokenizer) -> tuple[str, list[dict]]:
    """Cache key = hash(format version, tokenizer fingerprint, content hash of every file in order)."""
    files = [{"path": p, "sha256": _file_sha(p), "size": os.path.getsize(p)} for p in paths]
    h = hashlib.sha256(f"v{CACHE_VERSION}|{tokenizer.fingerprint()}".encode())
    for f in files:
        h.update(f["sha256"].encode())
    return h.hexdigest()[:20], files


@dataclass
class TokenizedCorpus:
    """Memory-mapped arrays of one cache entry."""

    directory: str
    tokens: np.ndarray  # (N,) uint16 | uint32
    word_starts_packed: np.ndarray  # (ceil(N / 8),) uint8
    doc_offsets: np.ndarray  # (n_docs + 1,) int64
    meta: dict

    @property
    def n_tokens(self) -> int:
        return int(self.doc_offsets[-1])

    @property
    def n_docs(self) -> int:
        return len(self.doc_offsets) - 1

    def word_starts(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) bool slice of the word-start bit array."""
        lo, hi = start // 8, (stop + 7) // 8
        bits = np.unpackbits(self.word_starts_packed[lo:hi])
        return bits[start - 8 * lo: stop - 8 * lo].astype(bool)

    @classmethod
    def open(cls, directory: str) -> TokenizedCorpus:
        with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        dtype = np.dtype(meta["dtype"])
        n = int(meta["n_tokens"])
        tokens = (np.memmap(os.path.join(directory, "tokens.bin"), dtype=dtype, mode="r", shape=(n,))
                  if n else np.zeros(0, dtype))
        ws = np.fromfile(os.path.join(directory, "word_starts.bin"), dtype=np.uint8)
        offsets = np.load(os.path.join(directory, "doc_offsets.npy"), allow_pickle=False)
        return cls(directory, tokens, ws, offsets, meta)


def _encode_paragraphs(tokenizer, paras: list[str]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Token ids, word-start bits and per-paragraph token counts, without special tokens."""
    # Word ids are what whole-word masking needs; the public encode_ids drops them, so use the
    # underlying HF tokenizer, which never truncates (`twotower.encoder.core.tokenizer`, "Threads").
    encs = tokenizer._tok.encode_batch(paras, add_special_tokens=False)
    ids = np.fromiter((i for e in encs for i in e.ids), dtype=np.int64)
    wid = np.fromiter((-1 if w is None else w for e in encs for w in e.word_ids), dtype=np.int64, count=len(ids))
    counts = [len(e.ids) for e in encs]
    starts = np.ones(len(ids), dtype=bool)
    if len(ids):
        starts[1:] = wid[1:] != wid[:-1]
        para_starts = np.cumsum([0] + counts[:-1])
        starts[para_starts[np.asarray(counts) > 0]] = True
    return ids, starts, counts


def tokenize_corpus(
    paths: Sequence[str], tokenizer, cache_dir: str | None = None, progress: bool = False,
    batch_paragraphs: int = 4096,
) -> TokenizedCorpus:
    """Tokenize `paths` once (or reuse the cache entry of the same files + tokenizer) and open it."""
    paths = check_corpus_files(paths)
    key, files = corpus_key(paths, tokenizer)
    root = cache_dir or default_cache_dir()
    target = os.path.join(root, key)
    if os.path.isfile(os.path.join(target, "meta.json")):
        logger.info("reusing tokenized corpus %s", target)
        return TokenizedCorpus.open(target)
    os.makedirs(root, exist_ok=True)
    build = tempfile.mkdtemp(prefix=f".{key}.", dir=root)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    offsets, starts_chunks, n_tokens = [0], [], 0
    before = _replaced[0]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(f["size"] for f in files), unit="B", unit_scale=True, desc="tokenize")
    try:
        with open(os.path.join(build, "tokens.bin"), "wb") as out:
            pending: list[list[str]] = []

            def flush() -> None:
                nonlocal n_tokens
                paras = [p for d in pending for p in d]
                ids, starts, counts = _encode_paragraphs(tokenizer, paras)
                out.write(ids.astype(dtype).tobytes())
                starts_chunks.append(starts)
                i = 0
                for d in pending:
                    n = sum(counts[i:i + len(d)])
                    i += len(d)
                    if n:
                        n_tokens += n
                        offsets.append(n_tokens)
                pending.clear()

            for p in paths:
                n_para = 0
                for doc in read_documents(p):
                    pending.append(doc)
                    n_para += len(doc)
                    if sum(len(d) for d in pending) >= batch_paragraphs:
                        flush()
                if n_para == 0:
                    raise ValueError(f"corpus file {p} holds no text")
                if bar is not None:
                    bar.update(os.path.getsize(p))
            if pending:
                flush()
    except BaseException:
        import shutil

        shutil.rmtree(build, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    replaced = _replaced[0] - before
    if replaced:
        logger.warning("corpus: %d bytes were not valid UTF-8 and were replaced with U+FFFD", replaced)
    starts = np.concatenate(starts_chunks) if starts_chunks else np.zeros(0, bool)
    np.packbits(starts).tofile(os.path.join(build, "word_starts.bin"))
    np.save(os.path.join(build, "doc_offsets.npy"), np.asarray(offsets, dtype=np.int64), allow_pickle=False)
    meta = {"version": CACHE_VERSION, "tokenizer": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size,
            "files": files, "n_tokens": n_tokens, "n_docs": len(offsets) - 1, "dtype": np.dtype(dtype).name,
            "replaced_bytes": replaced}
    atomic_write_text(os.path.join(build, "meta.json"), json.dumps(meta, indent=2) + "\n")
    if os.path.isfile(os.path.join(target, "meta.json")):  # another process won the race
        import shutil

        shutil.rmtree(build, ignore_errors=True)
    else:
        atomic_replace_dir(build, target)
    return TokenizedCorpus.open(target)
