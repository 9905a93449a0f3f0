"""Pretraining rows and batches: packed MLM rows, NSP sentence-pair rows, the data order and the validation set.

Packed rows (the default): the corpus token stream is cut into samples
``[CLS] piece [SEP]`` laid end to end in fixed-length rows (128), so no row is
padded except when a document ends one or two slots before the row does (a
sample needs at least three).  Each sample gets its own document id, which the
encoder turns into a block-diagonal attention mask with restarting positions:
no token ever reads across a document boundary.

Every random choice (data order, masks, NSP pairs) comes from a generator
seeded by the position in the data, so the data stream is a pure function of
(seed, epoch, cursor): resuming restores two integers, not an RNG object.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from twotower.encoder.pretraining.corpus import TokenizedCorpus
from twotower.encoder.pretraining.masking import MaskingSpec, TokenSpace, mask_tokens

MIN_SAMPLE = 3  # [CLS] one-token [SEP]


@dataclass
class PretrainBatch:
    """(B, T) tensors; next_sentence_label (B,) only in NSP mode; n_tokens = real (non-pad) tokens."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    document_ids: torch.Tensor | None
    next_sentence_label: torch.Tensor | None
    n_tokens: int

    def to(self, device: torch.device | str) -> PretrainBatch:
        def mv(t):
            return None if t is None else t.to(device, non_blocking=True)

        return PretrainBatch(mv(self.input_ids), mv(self.labels), mv(self.attention_mask), mv(self.token_type_ids),
                             mv(self.document_ids), mv(self.next_sentence_label), self.n_tokens)

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "labels": self.labels, "attention_mask": self.attention_mask,
                "token_type_ids": self.token_type_ids, "document_ids": self.document_ids,
                "next_sentence_label": self.next_sentence_label}


def seed_for(*parts: int) -> int:
    """A 63-bit seed from integers (SplitMix-style mixing; stable across processes and Python versions)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x ^= (int(p) + 0x9E3779B97F4A7C15 + ((x << 6) & (2**64 - 1)) + (x >> 2)) & (2**64 - 1)
        x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        x ^= x >> 31
    return x & (2**63 - 1)


def pack_pieces(doc_offsets: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Lay documents into rows of `seq_len` as ``[CLS] piece [SEP]`` samples.

    returns pieces (P, 2) int64 (start token, length) in row order and row_ptr (R + 1,):
    row r holds pieces[row_ptr[r]:row_ptr[r + 1]].  A final partial row is dropped.
    """
    if seq_len < MIN_SAMPLE + 1:
        raise ValueError(f"seq_len must be at least {MIN_SAMPLE + 1}, got {seq_len}")
    pieces: list[tuple[int, int]] = []
    row_ptr = [0]
    space = seq_len
    for d in range(len(doc_offsets) - 1):
        pos, end = int(doc_offsets[d]), int(doc_offsets[d + 1])
        while pos < end:
            if space < MIN_SAMPLE:  # 1-2 slots left: the only padding packing ever leaves
                row_ptr.append(len(pieces))
                space = seq_len
            take = min(end - pos, space - 2)
            pieces.append((pos, take))
            pos += take
            space -= take + 2
            if space == 0:
                row_ptr.append(len(pieces))
                space = seq_len
    arr = np.asarray(pieces, dtype=np.int64).reshape(-1, 2)
    return arr, np.asarray(row_ptr, dtype=np.int64)


class PackedRows:
    """Fixed-length MLM rows over a tokenized corpus."""

    def __init__(self, corpus: TokenizedCorpus, seq_len: int, tokenizer) -> None:
        self.corpus, self.seq_len = corpus, seq_len
        self.cls_id, self.sep_id, self.pad_id = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id
        self.pieces, self.row_ptr = pack_pieces(corpus.doc_offsets, seq_len)
        if len(self.row_ptr) < 2:
            raise ValueError(
                f"corpus has {corpus.n_tokens} tokens in {corpus.n_docs} documents: fewer than one row of "
                f"seq_len={seq_len}; give more text or a smaller --seq-len"
            )

    def __len__(self) -> int:
        return len(self.row_ptr) - 1

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """input_ids, word_starts, document_ids, attention_mask: (B, T) arrays for rows `indices`."""
        B, T = len(indices), self.seq_len
        ids = np.full((B, T), self.pad_id, dtype=np.int64)
        ws = np.ones((B, T), dtype=bool)
        doc = np.full((B, T), -1, dtype=np.int64)
        attn = np.zeros((B, T), dtype=np.int64)
        tokens = self.corpus.tokens
        for b, r in enumerate(indices):
            p = 0
            for j, (start, n) in enumerate(self.pieces[self.row_ptr[r]:self.row_ptr[r + 1]]):
                ids[b, p] = self.cls_id
                ids[b, p + 1:p + 1 + n] = tokens[start:start + n]
                ws[b, p + 1:p + 1 + n] = self.corpus.word_starts(start, start + n)
                ids[b, p + 1 + n] = self.sep_id
                doc[b, p:p + n + 2] = j
                attn[b, p:p + n + 2] = 1
                p += n + 2
            doc[b, p:] = np.arange(j + 1, j + 1 + T - p)  # each pad slot its own "document"
        return {"input_ids": ids, "word_starts": ws, "document_ids": doc, "attention_mask": attn}


class NSPRows:
    """Sentence-pair rows ``[CLS] A [SEP] B [SEP]``: B is the true continuation half the time, else random.

    The corpus is cut into chunks of up to T - 3 tokens within documents; row i splits chunk i at a random
    word start.  Label 0 = B follows A, 1 = B is a random span from another document (HF convention).
    """

    def __init__(self, corpus: TokenizedCorpus, seq_len: int, tokenizer, seed: int = 0) -> None:
        self.corpus, self.seq_len, self.seed = corpus, seq_len, seed
        self.cls_id, self.sep_id, self.pad_id = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id
        L = seq_len - 3
        chunks = []
        for d in range(corpus.n_docs):
            s, e = int(corpus.doc_offsets[d]), int(corpus.doc_offsets[d + 1])
            chunks += [(p, min(L, e - p), d) for p in range(s, e, L) if min(L, e - p) >= 2]
        if not chunks:
            raise ValueError(f"corpus has {corpus.n_tokens} tokens: too few for one NSP row of seq_len={seq_len}")
        self.chunks = np.asarray(chunks, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.chunks)

    def rows(self, indices: np.ndarray, epoch: int) -> dict[str, np.ndarray]:
        B, T = len(indices), self.seq_len
        ids = np.full((B, T), self.pad_id, dtype=np.int64)
        ws = np.ones((B, T), dtype=bool)
        types = np.zeros((B, T), dtype=np.int64)
        attn = np.zeros((B, T), dtype=np.int64)
        nsp = np.zeros(B, dtype=np.int64)
        off, tok = self.corpus.doc_offsets, self.corpus.tokens
        for b, r in enumerate(indices):
            rng = np.random.default_rng(seed_for(self.seed, epoch, r))
            start, n, d = (int(x) for x in self.chunks[r])
            starts = self.corpus.word_starts(start, start + n)
            cands = np.flatnonzero(starts[1:]) + 1  # split points at word starts
            split = int(rng.choice(cands)) if len(cands) else int(rng.integers(1, n))
            a = (start, split)
            if rng.random() < 0.5:
                bspan = (start + split, n - split)
            else:
                nsp[b] = 1
                other = int(rng.integers(self.corpus.n_docs - 1)) if self.corpus.n_docs > 1 else d
                other += int(self.corpus.n_docs > 1 and other >= d)
                os_, oe = int(off[other]), int(off[other + 1])
                m = min(n - split, oe - os_)
                bstart = os_ + int(rng.integers(0, oe - os_ - m + 1))
                bspan = (bstart, m)
            p = 0
            ids[b, p] = self.cls_id
            p += 1
            for seg, (s, m) in enumerate((a, bspan)):
                ids[b, p:p + m] = tok[s:s + m]
                ws[b, p:p + m] = self.corpus.word_starts(s, s + m)
                types[b, p:p + m + 1] = seg
                ids[b, p + m] = self.sep_id
                p += m + 1
            attn[b, :p] = 1
        return {"input_ids": ids, "word_starts": ws, "token_type_ids": types, "attention_mask": attn,
                "next_sentence_label": nsp}


class RowOrder:
    """Which rows each rank reads: a fresh seeded permutation per epoch, consumed `per_step` rows at a time.

    Position (epoch, cursor) is the whole state; a step that would run past the end starts the next epoch.
    """

    def __init__(self, n_rows: int, seed: int, world_size: int = 1, rank: int = 0) -> None:
        self.n_rows, self.seed, self.world, self.rank = n_rows, seed, world_size, rank
        self.epoch, self.cursor = 0, 0
        self._perm_epoch, self._perm = -1, np.zeros(0, dtype=np.int64)

    def perm(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng(seed_for(self.seed, epoch)).permutation(self.n_rows)
            self._perm_epoch = epoch
        return self._perm

    def next_step(self, batch_size: int, accum: int) -> list[tuple[np.ndarray, int, int]]:
        """Rows of this rank's `accum` micro-batches of the next step, each as (rows, epoch, global_offset)."""
        per_step = batch_size * accum * self.world
        if per_step > self.n_rows:
            raise ValueError(
                f"one optimizer step needs {per_step} rows (batch {batch_size} x accum {accum} x world "
                f"{self.world}) but the corpus packs into only {self.n_rows}; lower --batch-size"
            )
        if self.cursor + per_step > self.n_rows:
            self.epoch, self.cursor = self.epoch + 1, 0
        perm = self.perm(self.epoch)
        out = []
        for m in range(accum):
            off = self.cursor + (m * self.world + self.rank) * batch_size
            out.append((perm[off:off + batch_size], self.epoch, off))
        self.cursor += per_step
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "n_rows": self.n_rows}

    def load_state(self, s: dict) -> None:
        if s["n_rows"] != self.n_rows or s["seed"] != self.seed:
            raise ValueError(f"data position was saved for {s['n_rows']} rows / seed {s['seed']}, "
                             f"now {self.n_rows} rows / seed {self.seed}: corpus or seq_len changed")
        self.epoch, self.cursor = int(s["epoch"]), int(s["cursor"])


class BatchMaker:
    """Turns row indices into masked `PretrainBatch`es (dynamic masks by default, `static_copies` for static)."""

    def __init__(self, rows: PackedRows | NSPRows, space: TokenSpace, spec: MaskingSpec, seed: int,
                 static_copies: int = 0) -> None:
        self.rows, self.space, self.spec, self.seed, self.static_copies = rows, space, spec, seed, static_copies

    def make(self, indices: np.ndarray, epoch: int, offset: int) -> PretrainBatch:
        nsp = isinstance(self.rows, NSPRows)
        r = self.rows.rows(indices, epoch) if nsp else self.rows.rows(indices)
        ids = torch.from_numpy(r["input_ids"])
        attn = torch.from_numpy(r["attention_mask"])
        ws = torch.from_numpy(r["word_starts"]) if self.spec.whole_word else None
        if self.static_copies:
            # Static masking: row i always gets one of `static_copies` fixed masks (copy = epoch mod copies).
            parts = [mask_tokens(ids[i:i + 1], self.space, self.spec,
                                 torch.Generator().manual_seed(seed_for(self.seed, int(row), epoch % self.static_copies)),
                                 attention_mask=attn[i:i + 1], word_starts=None if ws is None else ws[i:i + 1])
                     for i, row in enumerate(indices)]
            masked_ids = torch.cat([p.input_ids for p in parts])
            labels = torch.cat([p.labels for p in parts])
        else:
            gen = torch.Generator().manual_seed(seed_for(self.seed, epoch, offset))
            m = mask_tokens(ids, self.space, self.spec, gen, attention_mask=attn, word_starts=ws)
            masked_ids, labels = m.input_ids, m.labels
        doc = None
        if not nsp and not (r["document_ids"] == r["document_ids"][:, :1]).all():
            # Only batches holding a document boundary (or padding) need the block-diagonal mask; the
            # rest run SDPA without a mask, its fastest kernel (identical result: one sample per row).
            doc = torch.from_numpy(r["document_ids"])
        return PretrainBatch(
            input_ids=masked_ids, labels=labels, attention_mask=attn,
            token_type_ids=torch.from_numpy(r["token_type_ids"]) if nsp else torch.zeros_like(ids),
            document_ids=doc,
            next_sentence_label=torch.from_numpy(r["next_sentence_label"]) if nsp else None,
            n_tokens=int(attn.sum()),
        )


def validation_batches(rows: PackedRows | NSPRows, space: TokenSpace, batch_size: int,
                       max_rows: int | None = None, seed: int = 0) -> list[PretrainBatch]:
    """The fixed validation set: evenly spaced rows, masked once at 15% with a fixed seed (comparable runs)."""
    n = len(rows) if not max_rows else min(len(rows), max_rows)
    idx = np.linspace(0, len(rows) - 1, n).round().astype(np.int64)
    maker = BatchMaker(rows, space, MaskingSpec(rate=0.15), seed=seed)
    return [maker.make(idx[i:i + batch_size], 0, i) for i in range(0, n, batch_size)]
