"""Hostile and damaged input at the command line: exit status 2, one line naming the file (and line) or the flag,
nothing encoded and nothing left behind; never a traceback.

Each case is one the integrity review found failing (a traceback, a check after encoding, a misleading message).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from tests.cli.cli_run import build_index, run_cli
from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus
from twotower.retrieval.dual_encoder import DualEncoder

GOOD = [json.dumps(d) for d in toy_docs(12)]


@pytest.fixture
def no_encoding(monkeypatch):
    """Fail the test if any document is encoded: every check must come before the expensive work."""

    def refuse(self, texts, **kw):
        raise AssertionError(f"{len(texts)} documents were encoded before the input was refused")

    monkeypatch.setattr(DualEncoder, "encode_documents", refuse)


def _build(capsys, tmp_path: Path, corpus: Path, *flags: str) -> tuple[int, str]:
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx"),
                         "--model", tiny_model_dir(), "--no-progress", *flags)
    return rc, err


def _lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# Each: (file name, how to write it, message expected after "<file>:" ). Line numbers are 1-based as in an editor.
CASES = {
    "truncated-gzip": ("c.jsonl.gz", lambda p: p.write_bytes(gzip.compress("".join(
        json.dumps(d) + "\n" for d in toy_docs(500)).encode())[:-300]), ":", "the gzip data ends early: the file is truncated"),
    "not-gzip": ("c.jsonl.gz", lambda p: _lines(p, GOOD), ": ", "not a gzip file, although its name ends in .gz"),
    "surrogate-in-text": ("c.jsonl", lambda p: _lines(p, GOOD[:3] + ['{"_id": "s", "text": "tea \\ud800 cup"}']),
                          ":4: ", "text holds a lone surrogate '\\ud800' at character 4"),
    "surrogate-in-title": ("c.jsonl", lambda p: _lines(p, GOOD[:3] + ['{"_id": "s", "title": "\\udfff", "text": "x"}']),
                           ":4: ", "title holds a lone surrogate '\\udfff'"),
    "surrogate-in-id": ("c.jsonl", lambda p: _lines(p, GOOD[:2] + ['{"_id": "a\\ud83d", "text": "tea"}']),
                        ":3: ", "_id holds a lone surrogate '\\ud83d'"),
    "deep-nesting": ("c.jsonl", lambda p: _lines(p, GOOD[:2] + ['{"_id": "x", "text": "t", "metadata": {"a": '
                                                               + "[" * 100_000 + "]" * 100_000 + "}}"]),
                     ":3: ", "JSON nested too deeply to read"),
    "metadata-40-deep": ("c.jsonl", lambda p: _lines(p, GOOD[:2] + ['{"_id": "x", "text": "t", "metadata": {"a": '
                                                                   + "[" * 40 + "]" * 40 + "}}"]),
                         ":3: ", "metadata.a[0][0]"),
    "nan-metadata": ("c.jsonl", lambda p: _lines(p, GOOD[:5] + ['{"_id": "n", "text": "t", "metadata": {"x": NaN}}']),
                     ":6: ", "metadata.x is NaN, which is not a JSON number"),
    "infinity-metadata": ("c.jsonl", lambda p: _lines(p, GOOD[:1] + ['{"_id": "n", "text": "t", "metadata": '
                                                                    '{"x": [1, -Infinity]}}']),
                          ":2: ", "metadata.x[1] is -Infinity"),
    "5000-digit-id": ("c.jsonl", lambda p: _lines(p, GOOD[:3] + ['{"_id": ' + "9" * 5000 + ', "text": "t"}']),
                      ":4: ", "a number too long to read"),
    "600-digit-id": ("c.jsonl", lambda p: _lines(p, GOOD[:3] + ['{"_id": ' + "7" * 600 + ', "text": "t"}']),
                     ":4: ", "document id of 600 bytes ('77777777777777777777'...) is longer than the limit of 512"),
    "space-in-id": ("c.jsonl", lambda p: _lines(p, GOOD[:6] + ['{"_id": "doc 7", "text": "t"}']),
                    ":7: ", "document id 'doc 7' contains whitespace or a control character (' ' at character 3)"),
    "newline-in-id": ("c.jsonl", lambda p: _lines(p, GOOD[:1] + ['{"_id": "a\\nb", "text": "t"}']),
                      ":2: ", "document id 'a\\nb' contains whitespace"),
    "tab-in-id": ("c.jsonl", lambda p: _lines(p, GOOD[:1] + ['{"_id": "a\\tb", "text": "t"}']),
                  ":2: ", "document id 'a\\tb' contains whitespace"),
    "nbsp-in-id": ("c.jsonl", lambda p: _lines(p, GOOD[:1] + ['{"_id": "a\\u00a0b", "text": "t"}']),
                   ":2: ", "contains whitespace or a control character ('\\xa0' at character 1)"),
    "control-in-id": ("c.jsonl", lambda p: _lines(p, GOOD[:1] + ['{"_id": "a\\u0007b", "text": "t"}']),
                      ":2: ", "contains whitespace or a control character ('\\x07'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_corpus_is_refused_before_encoding_and_leaves_nothing(case, tmp_path, capsys, no_encoding):
    name, write, where, message = CASES[case]
    corpus = tmp_path / name
    write(corpus)
    rc, err = _build(capsys, tmp_path, corpus)
    assert rc == 2, err
    assert f"{corpus}{where}" in err and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == [name]  # no idx, no idx.build


def test_a_300_digit_integer_id_is_kept_as_its_decimal_text(tmp_path, capsys):
    """Integer ids are normalised to their decimal text (run files compare ids as text); short ones are fine."""
    big = "1" + "0" * 299
    corpus = _lines(tmp_path / "c.jsonl", GOOD[:2] + ['{"_id": ' + big + ', "text": "tea cup"}'])
    rc, err = _build(capsys, tmp_path, corpus)
    assert rc == 0, err
    from twotower.indexing import IndexStore

    with IndexStore.open(tmp_path / "idx", readonly=True) as store:
        assert store.vectors.ids()[-1] == big and store.get([big])[0]["text"] == "tea cup"


def test_non_utf8_byte_is_reported_on_its_own_line(tmp_path, capsys):
    """The issue's case: a bad byte on line 251 (after blank lines and > 8 KiB of text) used to be reported as an
    earlier line; the line named is the one `sed -n 251p` shows."""
    lines = [json.dumps({"_id": f"d{i}", "text": "tea " * 20}) for i in range(225)] + [""] * 25
    data = "".join(line + "\n" for line in lines).encode() + b'{"_id": "bad", "text": "caf\xe9"}\n' + \
        (json.dumps({"_id": "z", "text": "x"}) + "\n").encode()
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(data)
    assert corpus.read_bytes().split(b"\n")[250].startswith(b'{"_id": "bad"')  # line 251 holds the byte
    rc, err = _build(capsys, tmp_path, corpus)
    assert rc == 2 and f"{corpus}:251: not valid UTF-8" in err, err


def test_gzip_content_without_gz_name_gets_a_hint(tmp_path, capsys, no_encoding):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(gzip.compress(("\n".join(GOOD) + "\n").encode()))
    rc, err = _build(capsys, tmp_path, corpus)
    assert rc == 2 and f"{corpus}:1: not valid UTF-8" in err and "looks gzip-compressed: name it *.gz" in err


@pytest.mark.parametrize("factory, message", [
    ("Bogus", "--factory: invalid FAISS factory string 'Bogus': FAISS cannot parse it (factory strings are case-sensitive, with no spaces)"),
    ("PQ7", "should be a multiple of the number of subquantizers"),  # without FAISS's C++ signature and file
    ("IVF64,Flat", "--factory: 'IVF64,Flat' needs at least 64 training vectors, got 12"),
    ("IVF2,PQ4", "needs at least 256 training vectors, got 12"),  # the PQ codebooks' 2^8
    ("Flat ", "--factory: invalid FAISS factory string 'Flat ': FAISS cannot parse it (factory strings are "
              "case-sensitive, with no spaces); did you mean 'Flat'?"),
    ("flat", "did you mean 'Flat'?"),
    ("LSH", "--factory: 'LSH' works only with the l2 metric (--metric l2), not ip: choose l2"),
    ("IVF2,PQ4x4fs", "--factory: 'IVF2,PQ4x4fs' is an IVF fast-scan index, which cannot return its stored vectors"),
])
def test_a_factory_faiss_cannot_build_or_train_is_refused_before_encoding(tmp_path, capsys, no_encoding, factory,
                                                                          message):
    """A typo in --factory, or an IVF/PQ too large for the corpus, was found after the whole corpus was encoded."""
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(12))
    rc, err = _build(capsys, tmp_path, Path(corpus), "--factory", factory)
    assert rc == 2 and message in err, err
    assert "Error in " not in err and ".cpp" not in err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("idx")]  # no index, no work directory


def test_a_milvus_index_type_is_checked_before_connecting_or_encoding(tmp_path, capsys, no_encoding):
    """--backend milvus takes a Milvus index type as --factory; a FAISS string was refused after the encoding."""
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(12))
    rc, err = _build(capsys, tmp_path, Path(corpus), "--backend", "milvus", "--milvus-uri", str(tmp_path / "v.db"),
                     "--factory", "HNSW32")
    assert rc == 2 and "--factory 'HNSW32': a Milvus index type is one of FLAT, IVF_FLAT, HNSW" in err, err
    assert not (tmp_path / "v.db").exists() and not (tmp_path / "idx").exists()


def test_bad_reranker_is_refused_before_encoding_and_no_index_names_it(tmp_path, capsys, no_encoding, monkeypatch):
    """A directory that has a config.json but is no cross-encoder: refused in seconds, no index left naming it."""
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(12))
    bad = tmp_path / "rr"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    rc, err = _build(capsys, tmp_path, Path(corpus), "--reranker", str(bad))
    assert rc == 2 and "rr/config.json" in err, err
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "rr"]
    # and the rebuild the issue saw refused as "already exists" now simply works
    monkeypatch.undo()  # encoding allowed again
    rc, err = _build(capsys, tmp_path, Path(corpus))
    assert rc == 0, err


@pytest.mark.parametrize("config, message", [
    (None, "--model {m}: no such directory"),
    ("", "--model {m}: not a model directory (it has no config.json or dual_encoder.json)"),
    ("{}", "{m}/config.json: missing required config keys"),
])
def test_bad_model_directory_is_refused_before_anything(tmp_path, capsys, config, message):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(5))
    model = tmp_path / "m"
    if config is not None:
        model.mkdir()
        if config:
            (model / "config.json").write_text(config)
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", str(tmp_path / "idx"), "--model",
                         str(model), "--no-progress")
    assert rc == 2 and message.format(m=model) in err, err
    assert not (tmp_path / "idx").exists() and not (tmp_path / "idx.build").exists()


def _damaged_model(tmp_path: Path, damage: str) -> tuple[Path, Path]:
    """A copy of the tiny model whose weights file is cut in half (an interrupted copy) or is a pickle."""
    import shutil

    import torch

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir(), model)
    weights = model / "model.safetensors"
    if damage == "truncated":
        os.truncate(weights, os.path.getsize(weights) // 2)
    else:
        torch.save({"embeddings.word_embeddings.weight": torch.zeros(2)}, weights)
    return model, weights


# Each command that reads --model: the arguments after its name (M: the model, T: tmp_path).
MODEL_COMMANDS = {
    "embed": ["embed", "--model", "{M}", "--input", "{T}/texts.txt", "--out", "{T}/out"],
    "index build": ["index", "build", "--model", "{M}", "--corpus", "{T}/c.jsonl", "--out", "{T}/out", "--no-progress"],
    "train dual": ["train", "dual", "--model", "{M}", "--data", "{T}/pairs.jsonl", "--corpus", "{T}/c.jsonl",
                   "--out", "{T}/out", "--no-progress"],
    "train reranker": ["train", "reranker", "--model", "{M}", "--pairs", "{T}/pairs.jsonl", "--corpus",
                       "{T}/c.jsonl", "--out", "{T}/out", "--no-progress"],
    "finetune": ["finetune", "classify", "--model", "{M}", "--train", "{T}/t.tsv", "--dev", "{T}/t.tsv", "--out",
                 "{T}/out"],
    "pretrain": ["pretrain", "--init-from", "{M}", "--tokenizer", "{M}", "--corpus", "{T}/texts.txt", "--out",
                 "{T}/out", "--steps", "1", "--seq-len", "16", "--no-progress", "--cache-dir", "{T}/cache"],
}


@pytest.mark.parametrize("damage", ["truncated", "pickle"])
@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_a_damaged_model_weights_file_is_one_line_naming_it(tmp_path, capsys, command, damage):
    """A model.safetensors cut short was a traceback of safetensors' own error ("incomplete metadata, file not
    fully covered"), exit 1, naming no file; a pickle planted there is refused as one (nothing is unpickled)."""
    model, weights = _damaged_model(tmp_path, damage)
    docs = toy_docs(12)
    write_corpus(str(tmp_path / "c.jsonl"), docs)
    (tmp_path / "texts.txt").write_text("".join(d["text"] + "\n" for d in docs), encoding="utf-8")
    _lines(tmp_path / "pairs.jsonl", [json.dumps({"query": d["text"][:20], "pos": [d["_id"]]}) for d in docs])
    (tmp_path / "t.tsv").write_text("text\tlabel\n" + "".join(f"{d['text']}\t{i % 2}\n" for i, d in enumerate(docs)),
                                    encoding="utf-8")
    argv = [a.format(M=model, T=tmp_path) for a in MODEL_COMMANDS[command]]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2, err
    assert err.startswith(f"twotower {command}: error: {weights}: ") and len(err.strip().splitlines()) == 1, err
    if damage == "truncated":
        assert "damaged: not a whole safetensors file (" in err and err.strip().endswith(
            "copy or save the model again (a copy or save cut short leaves such a file), or retrain it"), err
    else:
        assert "a pickle (torch.save) file, not safetensors: refused, as twotower never unpickles" in err, err
    assert not (tmp_path / "out").exists()


def test_add_refuses_ids_that_a_run_file_cannot_hold(tmp_path, capsys):
    """`index add` applies the same rules as build, naming file and line; the index is unchanged."""
    build_index(tmp_path, 10)
    extra = _lines(tmp_path / "more.jsonl", ['{"_id": "n1", "text": "tea"}', '{"_id": "n 2", "text": "cup"}'])
    rc, _, err = run_cli(capsys, "index", "add", "--index", str(tmp_path / "idx"), "--corpus", str(extra),
                         "--no-progress")
    assert rc == 2 and f"{extra}:2: document id 'n 2' contains whitespace" in err, err
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(tmp_path / "idx"))
    assert "documents   10" in out


def test_in_memory_documents_follow_the_same_rules(tmp_path):
    from twotower.common.errors import DataError
    from twotower.retrieval import SearchPipeline

    enc = DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)
    docs = [{"_id": "a", "text": "tea"}, {"_id": "b", "text": "x", "metadata": {"w": float("nan")}}]
    with pytest.raises(DataError, match=r"docs\[1\]: metadata.w is NaN"):
        SearchPipeline.build(docs, tmp_path / "idx", enc, progress=False)
    with pytest.raises(DataError, match=r"docs\[0\]: field 'text' holds a lone surrogate"):
        SearchPipeline.build([{"_id": "a", "text": "tea \udc80"}], tmp_path / "idx", enc, progress=False)
    with pytest.raises(DataError, match=r"docs\[0\]: document id 'a\\nb' contains whitespace"):
        SearchPipeline.build([{"_id": "a\nb", "text": "tea"}], tmp_path / "idx", enc, progress=False)
    assert os.listdir(tmp_path) == []


def test_delete_ids_file_with_a_bad_byte_names_the_line_and_an_empty_one_is_said_empty(tmp_path, capsys):
    build_index(tmp_path, 5)
    ids = tmp_path / "ids.txt"
    ids.write_bytes(b"d0\n\nd1\nd\xff2\n")
    rc, _, err = run_cli(capsys, "index", "delete", "--index", str(tmp_path / "idx"), "--ids-file", str(ids))
    assert rc == 2 and f"{ids}:4: not valid UTF-8" in err, err
    ids.write_text("\n \n")  # it said "give document ids to delete", with the file given
    rc, _, err = run_cli(capsys, "index", "delete", "--index", str(tmp_path / "idx"), "--ids-file", str(ids))
    assert rc == 2 and f"--ids-file {ids}: empty (no ids, or only blank lines); nothing to delete" in err, err


# ---------------------------------------------------------------------- reranker in the manifest, --rerank-alpha
@pytest.fixture(scope="module")
def reranked(tmp_path_factory):
    """An index whose manifest names a cross-encoder by a path relative to the index directory."""
    from twotower.retrieval.cross_encoder import CrossEncoder

    root = tmp_path_factory.mktemp("rr")
    build_index(root, 20)
    CrossEncoder.from_encoder(tiny_model_dir(), bf16=False, device="cpu").save_pretrained(str(root / "ce"))
    return root


def _set_reranker(index: Path, value) -> None:
    path = index / "manifest.json"
    m = json.loads(path.read_text())
    m["extra"]["pipeline"]["reranker"] = value
    path.write_text(json.dumps(m))


def test_relative_reranker_path_resolves_against_the_index_directory(reranked, tmp_path, capsys, monkeypatch):
    _set_reranker(reranked / "idx", "../ce")
    elsewhere = tmp_path / "a" / "b"  # from here "../ce" would be tmp_path/a/ce, which does not exist
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    rc, out, err = run_cli(capsys, "search", "--index", str(reranked / "idx"), "-k", "3", "--json", "tea")
    assert rc == 0, err
    assert all(h["rerank_score"] is not None for h in json.loads(out)[0]["hits"])


@pytest.mark.parametrize("value, message", [
    (5, 'pipeline.reranker must be a directory path, "default" or null, got 5'),
    (["ce"], 'pipeline.reranker must be a directory path, "default" or null, got [\'ce\']'),
    ("no-such-ce", "the index's default reranker"),
])
def test_bad_reranker_entry_in_the_manifest_is_a_clear_error(reranked, tmp_path, capsys, value, message):
    import shutil

    idx = tmp_path / "idx"
    shutil.copytree(reranked / "idx", idx)
    _set_reranker(idx, value)
    rc, _, err = run_cli(capsys, "search", "--index", str(idx), "tea")
    assert rc == 2 and message in err and "manifest.json" in err, err
    rc, _, err = run_cli(capsys, "search", "--index", str(idx), "--no-rerank", "tea")  # still searchable without it
    assert rc == 0, err


@pytest.mark.parametrize("flags, message", [
    (["--rerank-alpha", "0.5"], "--rerank-alpha: the index"),
    (["--rerank-alpha", "2"], "--rerank-alpha must be between 0 and 1, got 2.0"),
    (["--rerank-alpha", "-0.1"], "--rerank-alpha must be between 0 and 1, got -0.1"),
    (["--rerank-alpha", "nan"], "--rerank-alpha must be between 0 and 1, got nan"),
    (["--rerank-alpha", "0.5", "--no-rerank"], "--no-rerank turns reranking off"),
    # flags of a mode that is off were ignored without a word
    (["--rerank-k", "5"], "--rerank-k: the index"),
    (["--rerank-k", "5", "--no-rerank"], "--rerank-k sets how the reranker reranks, but --no-rerank"),
    (["--fusion", "minmax"], "--fusion sets how --hybrid fuses"),
    (["--tag", "mine"], "--tag names the run that --run writes"),
    (["--aggregate", "sum"], "--aggregate: the index"),
])
def test_rerank_alpha_without_a_reranker_or_out_of_range(reranked, tmp_path, capsys, flags, message):
    """The index of `reranked` before its manifest names a reranker: `--rerank-alpha` has nothing to weigh,
    and the flags of modes that are off (`--fusion` without `--hybrid`, ...) are refused too."""
    import shutil

    idx = tmp_path / "idx"
    shutil.copytree(reranked / "idx", idx)
    _set_reranker(idx, None)
    rc, _, err = run_cli(capsys, "search", "--index", str(idx), *flags, "tea")
    assert rc == 2 and message in err, err
