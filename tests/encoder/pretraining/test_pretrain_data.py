"""Tokenized-corpus cache, packing without padding or cross-document attention, NSP rows, data order."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
import torch

from tests.encoder import pretrain_fixtures as fx
from twotower.encoder.core.model import build_attention_mask
from twotower.encoder.pretraining.corpus import read_documents, tokenize_corpus
from twotower.encoder.pretraining.masking import MaskingSpec, TokenSpace
from twotower.encoder.pretraining.pretrain_data import (
    BatchMaker,
    NSPRows,
    PackedRows,
    RowOrder,
    pack_pieces,
    validation_batches,
)

tiny_tokenizer, tiny_tokenizer_dir = fx.tiny_tokenizer, fx.tiny_tokenizer_dir


def test_documents_from_txt_gz_and_jsonl(tmp_path):
    txt = tmp_path / "a.txt.gz"
    with gzip.open(txt, "wt", encoding="utf-8") as f:
        f.write("p1 of d1\np2 of d1\n\n\np1 of d2\n")
    assert list(read_documents(str(txt))) == [["p1 of d1", "p2 of d1"], ["p1 of d2"]]
    js = tmp_path / "b.jsonl"
    js.write_text(json.dumps({"title": "T", "text": "x\ny"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    assert list(read_documents(str(js))) == [["T", "x", "y"], ["z"]]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing string field 'text'"):
        list(read_documents(str(tmp_path / "bad.jsonl")))


def test_cache_is_built_once_and_keyed_by_content(tmp_path, tiny_tokenizer):
    path = fx.write_corpus(str(tmp_path), n_docs=5)
    cache = str(tmp_path / "cache")
    a = tokenize_corpus([path], tiny_tokenizer, cache)
    assert a.tokens.dtype == np.uint16 and a.n_docs == 5
    mtime = os.path.getmtime(os.path.join(a.directory, "tokens.bin"))
    b = tokenize_corpus([path], tiny_tokenizer, cache)
    assert b.directory == a.directory and os.path.getmtime(os.path.join(b.directory, "tokens.bin")) == mtime
    # tokens equal a direct tokenization of each document's paragraphs
    docs = list(read_documents(path))
    want = [i for p in docs[2] for i in tiny_tokenizer.encode_ids([p])[0]]
    assert a.tokens[a.doc_offsets[2]:a.doc_offsets[3]].tolist() == want
    with open(path, "a", encoding="utf-8") as f:
        f.write("one more paragraph\n")
    c = tokenize_corpus([path], tiny_tokenizer, cache)
    assert c.directory != a.directory


def test_word_starts_follow_the_tokenizer_word_ids(tmp_path, tiny_tokenizer):
    path = fx.write_corpus(str(tmp_path), n_docs=2)
    c = tokenize_corpus([path], tiny_tokenizer, str(tmp_path / "cache"))
    para = list(read_documents(path))[0][0]
    enc = tiny_tokenizer.encode([para])
    wids = [w for w in enc.word_ids[0] if w is not None]
    want = [True] + [wids[i] != wids[i - 1] for i in range(1, len(wids))]
    got = c.word_starts(0, len(wids)).tolist()
    assert got == want
    assert not all(want), "the fixture must contain multi-token words"


def test_non_utf8_is_replaced_and_counted(tmp_path, tiny_tokenizer):
    p = tmp_path / "latin1.txt"
    p.write_bytes(fx.synthetic_text(n_docs=2).encode() + b"caf\xe9 na\xefve\n")
    c = tokenize_corpus([str(p)], tiny_tokenizer, str(tmp_path / "cache"))
    assert c.meta["replaced_bytes"] == 2


def test_bad_corpus_files(tmp_path, tiny_tokenizer):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        tokenize_corpus([str(tmp_path / "nope.txt")], tiny_tokenizer, str(tmp_path))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        tokenize_corpus([str(tmp_path / "empty.txt")], tiny_tokenizer, str(tmp_path))
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(ValueError, match="blank.txt holds no text"):
        tokenize_corpus([str(tmp_path / "blank.txt")], tiny_tokenizer, str(tmp_path))
    (tmp_path / "short.txt").write_text("abc abc\n")
    small = tokenize_corpus([str(tmp_path / "short.txt")], tiny_tokenizer, str(tmp_path))
    with pytest.raises(ValueError, match="fewer than one row"):
        PackedRows(small, 128, tiny_tokenizer)


def test_pack_pieces_wastes_only_unfillable_slots():
    offsets = np.cumsum([0, 5, 200, 3, 1, 60, 61])
    pieces, row_ptr = pack_pieces(offsets, 16)
    used = []
    for r in range(len(row_ptr) - 1):
        used.append(sum(int(n) + 2 for _, n in pieces[row_ptr[r]:row_ptr[r + 1]]))
    assert all(16 - MIN <= u <= 16 for u, MIN in zip(used, [2] * len(used)))
    assert sum(16 - u for u in used) <= 2 * 7  # at most 2 pad slots per document end
    # every token of every complete row appears exactly once, in order
    covered = np.concatenate([np.arange(s, s + n) for s, n in pieces])
    assert (np.diff(covered) == 1).all() and covered[0] == 0


def test_packed_rows_isolate_documents(tmp_path, tiny_tokenizer):
    path = fx.write_corpus(str(tmp_path), n_docs=8, paras=2)
    c = tokenize_corpus([path], tiny_tokenizer, str(tmp_path / "cache"))
    rows = PackedRows(c, 64, tiny_tokenizer)
    r = rows.rows(np.arange(len(rows)))
    ids, doc, attn = r["input_ids"], r["document_ids"], r["attention_mask"]
    assert attn.mean() > 0.97  # packing, not padding
    n_boundaries = 0
    for b in range(len(ids)):
        for j in np.unique(doc[b][attn[b] == 1]):
            seg = ids[b][(doc[b] == j) & (attn[b] == 1)]
            assert seg[0] == tiny_tokenizer.cls_id and seg[-1] == tiny_tokenizer.sep_id
            assert tiny_tokenizer.cls_id not in seg[1:] and tiny_tokenizer.sep_id not in seg[:-1]
        n_boundaries += len(np.unique(doc[b][attn[b] == 1])) - 1
    assert n_boundaries > 0
    # the mask the encoder builds: no query attends to a key of another sample (or to padding)
    mask = build_attention_mask(torch.from_numpy(attn), torch.from_numpy(doc))[:, 0]  # (B, T, T)
    same = torch.from_numpy(doc)[:, :, None] == torch.from_numpy(doc)[:, None, :]
    assert not (mask & ~same).any()
    # all real tokens of the corpus appear, in order (the last partial row dropped)
    real = ids[(attn == 1) & (ids != tiny_tokenizer.cls_id) & (ids != tiny_tokenizer.sep_id)]
    assert real.tolist() == c.tokens[:len(real)].tolist()


def test_batches_mask_dynamically_and_validation_is_fixed(tmp_path, tiny_tokenizer):
    path = fx.write_corpus(str(tmp_path), n_docs=8)
    c = tokenize_corpus([path], tiny_tokenizer, str(tmp_path / "cache"))
    rows = PackedRows(c, 32, tiny_tokenizer)
    space = TokenSpace.from_tokenizer(tiny_tokenizer)
    maker = BatchMaker(rows, space, MaskingSpec(), seed=1)
    idx = np.arange(6)
    a, b = maker.make(idx, 0, 0), maker.make(idx, 1, 0)
    assert not torch.equal(a.labels, b.labels)  # a new mask each time the rows are seen
    static = BatchMaker(rows, space, MaskingSpec(), seed=1, static_copies=2)
    s0, s2 = static.make(idx, 0, 0), static.make(idx, 2, 99)
    assert torch.equal(s0.labels, s2.labels) and not torch.equal(s0.labels, static.make(idx, 1, 0).labels)
    v1 = validation_batches(rows, space, 4, max_rows=10)
    v2 = validation_batches(rows, space, 4, max_rows=10)
    assert all(torch.equal(x.labels, y.labels) and torch.equal(x.input_ids, y.input_ids) for x, y in zip(v1, v2))


def test_nsp_rows(tmp_path, tiny_tokenizer):
    path = fx.write_corpus(str(tmp_path), n_docs=10)
    c = tokenize_corpus([path], tiny_tokenizer, str(tmp_path / "cache"))
    rows = NSPRows(c, 48, tiny_tokenizer, seed=0)
    r = rows.rows(np.arange(len(rows)), epoch=0)
    labels = r["next_sentence_label"]
    assert 0.3 < labels.mean() < 0.7
    flat = c.tokens.tolist()
    for b in range(len(labels)):
        ids, types = r["input_ids"][b], r["token_type_ids"][b]
        seps = np.flatnonzero(ids == tiny_tokenizer.sep_id)
        assert ids[0] == tiny_tokenizer.cls_id and len(seps) == 2
        assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1: seps[1] + 1] == 1).all()
        a, bseg = ids[1:seps[0]].tolist(), ids[seps[0] + 1:seps[1]].tolist()
        joined = a + bseg
        is_next = any(flat[i:i + len(joined)] == joined for i in range(len(flat) - len(joined) + 1)
                      if flat[i] == joined[0])
        if labels[b] == 0:
            assert is_next


def test_row_order_covers_each_rank_disjointly():
    a, b = RowOrder(100, seed=3, world_size=2, rank=0), RowOrder(100, seed=3, world_size=2, rank=1)
    ra = np.concatenate([m[0] for _ in range(4) for m in a.next_step(5, 2)])
    rb = np.concatenate([m[0] for _ in range(4) for m in b.next_step(5, 2)])
    assert len(set(ra) | set(rb)) == 80 and not set(ra) & set(rb)
    c = RowOrder(100, seed=3, world_size=2, rank=0)
    c.load_state(a.state())
    assert np.array_equal(c.next_step(5, 2)[0][0], a.next_step(5, 2)[0][0])
    with pytest.raises(ValueError, match="rows"):
        RowOrder(10, seed=0).next_step(8, 2)
