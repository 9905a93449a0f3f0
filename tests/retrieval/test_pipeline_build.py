"""Index builds: bad input leaves nothing behind, crashes resume from the finished shards, shard size is invisible,
and an index refuses query encoders, directories and versions it was not built for."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus
from twotower.indexing import IndexFormatError, IndexStore
from twotower.retrieval import DualEncoder, EncoderMismatchError, SearchPipeline
from twotower.retrieval.build import PLAN_NAME, build_index, shard_path

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def encoder():
    return DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory, encoder):
    root = tmp_path_factory.mktemp("built")
    corpus = write_corpus(str(root / "c.jsonl"), toy_docs(30))
    SearchPipeline.build(corpus, root / "idx", encoder, progress=False).close()
    return root / "idx"


def _vectors(directory) -> tuple[list[str], np.ndarray]:
    with IndexStore.open(directory, readonly=True) as store:
        ids = store.vectors.ids()
        return ids, store.vectors.reconstruct(ids)


class _CrashAfter:
    """Wraps a DualEncoder; raises on the n-th document-encoding call, counting the documents it encoded."""

    def __init__(self, inner: DualEncoder, crash_on_call: int | None) -> None:
        self.encode = inner.encode_documents  # the real method, bound before it is patched
        self.crash_on_call, self.calls, self.encoded = crash_on_call, 0, 0

    def encode_documents(self, texts, **kw):
        self.calls += 1
        if self.crash_on_call is not None and self.calls == self.crash_on_call:
            raise KeyboardInterrupt("simulated crash")
        self.encoded += len(texts)
        return self.encode(texts, **kw)


def test_interrupted_build_resumes_from_finished_shards(tmp_path, encoder, monkeypatch):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(50))
    out = tmp_path / "idx"
    crash = _CrashAfter(encoder, crash_on_call=3)  # shards 0 and 1 finish, shard 2 dies
    monkeypatch.setattr(encoder, "encode_documents", crash.encode_documents)
    with pytest.raises(KeyboardInterrupt):
        SearchPipeline.build(corpus, out, encoder, shard_size=16, progress=False)
    assert not out.exists()  # nothing half-written at the destination
    work = tmp_path / "idx.build"
    assert (work / PLAN_NAME).is_file()
    assert os.path.isfile(shard_path(str(work), 0)) and os.path.isfile(shard_path(str(work), 1))
    assert not os.path.isfile(shard_path(str(work), 2))

    resume = _CrashAfter(encoder, crash_on_call=None)
    monkeypatch.setattr(encoder, "encode_documents", resume.encode_documents)
    SearchPipeline.build(corpus, out, encoder, shard_size=16, progress=False).close()
    assert resume.encoded == 50 - 32  # only shards 2 and 3 were encoded again
    assert not work.exists()
    monkeypatch.undo()

    fresh = tmp_path / "fresh"
    SearchPipeline.build(corpus, fresh, encoder, shard_size=16, progress=False).close()
    ids_a, vec_a = _vectors(out)
    ids_b, vec_b = _vectors(fresh)
    assert ids_a == ids_b == [f"d{i}" for i in range(50)]
    np.testing.assert_allclose(vec_a, vec_b, atol=1e-6)


class NumberEncoder:
    """A document encoder for a build in a child process: the vector of "doc i" is drawn from seed i.

    It has what `build_index` uses of a DualEncoder (dim, metric, fingerprint, encode_documents) and
    counts the documents it encoded; no model, so the child starts fast.
    """

    dim, metric = 8, "cosine"

    def __init__(self) -> None:
        self.encoded: list[int] = []

    def fingerprint(self) -> str:
        return "number-encoder-1"

    def encode_documents(self, texts, batch_size=64, progress=False):
        numbers = [int(t.split()[-1]) for t in texts]
        self.encoded.extend(numbers)
        return np.stack([np.random.default_rng(n).normal(size=self.dim) for n in numbers]).astype(np.float32)


def test_sigkill_mid_build_then_resume(tmp_path):
    """Kill a build (a real process, no cleanup runs) while it encodes; the rerun encodes only unfinished shards."""
    corpus = write_corpus(str(tmp_path / "c.jsonl"), [{"_id": f"d{i}", "text": f"doc {i}"} for i in range(200)])
    out, flag = tmp_path / "idx", tmp_path / "signal"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tests.retrieval.test_pipeline_build import NumberEncoder
        from twotower.retrieval.build import build_index

        class Slow(NumberEncoder):
            def encode_documents(self, texts, batch_size=64, progress=False):
                first = int(texts[0].split()[-1])
                if first >= 75:
                    open({str(flag)!r}, "a").close()  # shards 0-2 are on disk: tell the parent
                # Slow enough that the parent's random kill lands in the next shards on any machine;
                # from shard 5 on stall, so a fast machine can never finish before the kill.
                time.sleep(0.02 if first < 125 else 120)
                return super().encode_documents(texts, batch_size, progress)

        build_index({corpus!r}, {str(out)!r}, Slow(), shard_size=25, progress=False)
    """))
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flag.exists(), "the child build never reached its fourth shard"
        time.sleep(float(np.random.default_rng().uniform(0, 0.3)))  # somewhere in the next shards
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not out.exists()  # the index appears only whole, at the very end
    work = str(tmp_path / "idx.build")
    done = [i for i in range(8) if os.path.isfile(shard_path(work, i))]
    assert done == list(range(len(done))) and 3 <= len(done) <= 5  # whole shards, in order

    resume = NumberEncoder()
    assert build_index(corpus, str(out), resume, shard_size=25, progress=False)
    assert resume.encoded == list(range(25 * len(done), 200))  # finished shards were not encoded again
    with IndexStore.open(out, readonly=True) as store:
        assert len(store) == 200 and store.vectors.ids() == [f"d{i}" for i in range(200)]
        want = NumberEncoder().encode_documents(["doc 10", "doc 199"])  # (2, 8)
        want /= np.linalg.norm(want, axis=1, keepdims=True)  # a cosine index stores unit vectors
        np.testing.assert_allclose(store.vectors.reconstruct(["d10", "d199"]), want, atol=1e-6)
    assert not os.path.exists(work)


def test_stale_work_dir_for_another_corpus_is_discarded(tmp_path, encoder):
    out = tmp_path / "idx"
    work = tmp_path / "idx.build"
    (work / "shards").mkdir(parents=True)
    (work / PLAN_NAME).write_text(json.dumps({"corpus_sha256": "something else"}))
    np.save(shard_path(str(work), 0), np.zeros((16, encoder.dim), dtype=np.float32))  # would be wrong if reused
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(20))
    SearchPipeline.build(corpus, out, encoder, shard_size=16, progress=False).close()
    _, vecs = _vectors(out)
    assert np.abs(vecs).sum(axis=1).min() > 0


def test_shard_size_does_not_change_the_index(tmp_path, encoder):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(37))
    SearchPipeline.build(corpus, tmp_path / "a", encoder, shard_size=5, progress=False).close()
    SearchPipeline.build(corpus, tmp_path / "b", encoder, shard_size=100, progress=False).close()
    ids_a, vec_a = _vectors(tmp_path / "a")
    ids_b, vec_b = _vectors(tmp_path / "b")
    assert ids_a == ids_b
    np.testing.assert_allclose(vec_a, vec_b, atol=1e-5)


def test_documents_are_batched_by_tokens_unless_a_batch_size_is_given(tmp_path, encoder, monkeypatch):
    """Build and add leave batching to the encoder's token budget (length-sorted batches of ~2,048 tokens on a
    CPU); they fixed 64 documents a batch, which built the demo index 12 % slower in fp32 (docs/results.md)."""
    import twotower.encoder.core.encode as encode

    seen = []
    real = encode.encode_texts

    def spy(*args, **kw):
        seen.append((kw.get("batch_size"), kw.get("batch_tokens")))
        return real(*args, **kw)

    monkeypatch.setattr(encode, "encode_texts", spy)
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(12))
    SearchPipeline.build(corpus, tmp_path / "idx", encoder, progress=False).close()
    with SearchPipeline.load(tmp_path / "idx", encoder, readonly=False, use_default_reranker=False) as pipe:
        pipe.add([{"_id": "new", "text": "green tea"}])
    assert seen == [(None, None), (None, None)]
    SearchPipeline.build(corpus, tmp_path / "idx8", encoder, progress=False, batch_size=8).close()
    assert seen[-1] == (8, None)


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], "corpus is empty"),
        (['{"_id": "a", "text": "tea"}', "{oops"], "c.jsonl:2: not valid JSON"),
        (['{"_id": "a", "text": "tea"}', '{"title": "no id", "text": "x"}'], "c.jsonl:2: missing field '_id'"),
        (['{"_id": "a", "text": "tea"}', '{"_id": "b"}'], "c.jsonl:2: missing string field 'text'"),
        (['{"_id": "a", "text": "tea"}', '{"_id": "a", "text": "x"}'], "c.jsonl:2: duplicate document id 'a'"),
    ],
)
def test_bad_corpus_writes_nothing(tmp_path, encoder, lines, message):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ValueError, match=message):
        SearchPipeline.build(str(corpus), tmp_path / "idx", encoder, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_duplicate_policies_at_build(tmp_path, encoder, caplog):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), [
        {"_id": "a", "text": "first"}, {"_id": "b", "text": "tea"}, {"_id": "a", "text": "second"}])
    with SearchPipeline.build(corpus, tmp_path / "skip", encoder, on_duplicate="skip", progress=False) as p:
        assert len(p) == 2 and p.store.get(["a"])[0]["text"] == "first"
    with SearchPipeline.build(corpus, tmp_path / "repl", encoder, on_duplicate="replace", progress=False) as p:
        assert len(p) == 2 and p.store.get(["a"])[0]["text"] == "second"
        assert p.store.vectors.ids() == ["b", "a"]
    # the copies not indexed are counted (they were dropped without a word)
    assert [r.getMessage() for r in caplog.records if "duplicate" in r.getMessage()] == [
        "1 duplicate document not indexed: kept the first copy (on duplicate: skip)",  # no index to keep one of
        "1 duplicate document not indexed: kept the last copy (on duplicate: replace)"]


def test_empty_documents_at_build(tmp_path, encoder, caplog):
    """A document with blank text and title stopped every build (Cranfield has two); on_empty="skip" leaves
    them out, from a file or from memory, and says how many and which."""
    docs = [{"_id": "a", "text": "tea"}, {"_id": "b", "title": " ", "text": ""}, {"_id": "c", "text": "milk"}]
    corpus = write_corpus(str(tmp_path / "c.jsonl"), docs)
    with pytest.raises(ValueError, match=r"c.jsonl:2: document 'b' has empty 'text' and 'title'; use --on-empty skip"):
        SearchPipeline.build(corpus, tmp_path / "err", encoder, progress=False)
    assert not (tmp_path / "err").exists()
    for name, given in (("file", corpus), ("memory", docs)):
        with SearchPipeline.build(given, tmp_path / name, encoder, on_empty="skip", progress=False) as p:
            assert len(p) == 2 and p.store.vectors.ids() == ["a", "c"] and p.get(["b"]) == [None]
            assert p.block["corpus"]["empty"] == 1 and p.block["corpus"]["on_empty"] == "skip"
    assert [r.getMessage() for r in caplog.records if "empty" in r.getMessage()] == [
        "1 empty document (blank 'text' and 'title') not indexed: 'b' (on empty: skip)"] * 2
    with pytest.raises(ValueError, match="on_empty='keep'"):
        SearchPipeline.build(corpus, tmp_path / "bad", encoder, on_empty="keep", progress=False)


def test_build_arguments_are_checked_before_anything_is_encoded(tmp_path, encoder, monkeypatch):
    """A metric typo was refused after the whole corpus was encoded, and left `idx.build/`, from which the next
    call resumed past the checks (batch_size=-1 then reached the manifest)."""
    docs = toy_docs(6)
    monkeypatch.setattr(DualEncoder, "encode_documents", lambda *a, **k: pytest.fail("encoded"))
    for kw, words in (({"metric": "cos"}, "metric must be one of cosine, ip, l2, got 'cos'"),
                      ({"batch_size": -1}, "batch_size must be a positive int or None"),
                      ({"batch_size": 0}, "batch_size must be a positive int or None")):
        with pytest.raises(ValueError, match=words):
            SearchPipeline.build(docs, tmp_path / "idx", encoder, progress=False, **kw)
    # documents in memory: a repeated id names both positions (it named the lines of a temporary file)
    with pytest.raises(ValueError, match=r"^docs\[6\]: duplicate document id 'd0' \(already in docs\[0\]\)"):
        SearchPipeline.build(docs + [docs[0]], tmp_path / "idx", encoder, progress=False)
    with pytest.raises(TypeError, match="corpus must be a path or an iterable of documents"):
        SearchPipeline.build(docs[0], tmp_path / "idx", encoder, progress=False)
    assert sorted(os.listdir(tmp_path)) == []


def test_build_takes_a_numpy_batch_size(tmp_path, encoder):
    """batch_size=np.int64(2) was refused ("must be a positive int"), where k and the depths take numpy's
    integers (`is_count`); the manifest records it as a plain int."""
    with SearchPipeline.build(toy_docs(4), tmp_path / "idx", encoder, batch_size=np.int64(2), progress=False) as p:
        assert len(p) == 4
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert '"batch_size": 2' in json.dumps(manifest)


# ---------------------------------------------------------------------- refusing mismatches
def test_other_model_of_same_dimension_is_refused(index_dir):
    other = DualEncoder.from_pretrained(tiny_model_dir(hidden=36, seed=1), bf16=False)
    with pytest.raises(EncoderMismatchError, match="fingerprint .* does not match .*the weights differ"):
        SearchPipeline.load(index_dir, other)


def test_model_of_other_dimension_is_refused(index_dir):
    other = DualEncoder.from_pretrained(tiny_model_dir(hidden=24, seed=0), bf16=False)
    with pytest.raises(EncoderMismatchError, match="36-dimensional vectors but the query encoder produces 24"):
        SearchPipeline.load(index_dir, other)


def test_same_weights_other_pooling_or_prefix_is_refused(index_dir):
    cls_pooled = DualEncoder.from_pretrained(tiny_model_dir(), pooling="cls", bf16=False)
    with pytest.raises(EncoderMismatchError, match="pooling: index 'mean' vs model 'cls'"):
        SearchPipeline.load(index_dir, cls_pooled)
    prefixed = DualEncoder.from_pretrained(tiny_model_dir(), query_prefix="query: ", bf16=False)
    with pytest.raises(EncoderMismatchError, match="query_prefix"):
        SearchPipeline.load(index_dir, prefixed)


def _copy(index_dir, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(index_dir, target)
    return target


def test_corrupt_manifest(index_dir, tmp_path):
    target = _copy(index_dir, tmp_path)
    (target / "manifest.json").write_text("{ not json")
    with pytest.raises(IndexFormatError, match="manifest.json: corrupt manifest JSON"):
        SearchPipeline.load(target)


def test_not_an_index_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(IndexFormatError, match="not a twotower index directory"):
        SearchPipeline.load(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not found"):
        SearchPipeline.load(tmp_path / "missing")


def test_corrupt_vectors_and_documents(index_dir, tmp_path):
    target = _copy(index_dir, tmp_path)
    vec = next(target.glob("*.faiss"))  # a vector segment
    vec.write_bytes(vec.read_bytes()[:100])
    with pytest.raises(IndexFormatError):
        SearchPipeline.load(target)
    target2 = tmp_path / "copy2"
    shutil.copytree(index_dir, target2)
    for p in target2.glob("docs.sqlite*"):
        p.unlink()
    (target2 / "docs.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(IndexFormatError, match="docs.sqlite"):
        SearchPipeline.load(target2)


def _edit_manifest(target, edit):
    path = target / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def test_index_from_a_newer_version_or_without_pipeline_block(index_dir, tmp_path):
    target = _copy(index_dir, tmp_path)
    _edit_manifest(target, lambda m: m["extra"]["pipeline"].update(format=99))
    with pytest.raises(IndexFormatError, match="pipeline.format 99 is newer"):
        SearchPipeline.load(target)
    _edit_manifest(target, lambda m: m.update(format_version=99))
    with pytest.raises(IndexFormatError, match="format_version 99 is newer"):
        SearchPipeline.load(target)
    target2 = tmp_path / "copy2"
    shutil.copytree(index_dir, target2)
    _edit_manifest(target2, lambda m: m["extra"].pop("pipeline"))
    with pytest.raises(IndexFormatError, match="not built by SearchPipeline"):
        SearchPipeline.load(target2)


def test_moved_model_is_reported(index_dir, tmp_path):
    target = _copy(index_dir, tmp_path)
    _edit_manifest(target, lambda m: m["extra"]["pipeline"]["encoder"].update(model={"path": "/no/such/model"}))
    # in the words of both callers: it said only "--model" to a Python call
    with pytest.raises(FileNotFoundError, match=r"/no/such/model, which no longer exists; pass the same model: "
                                                r"SearchPipeline\.load\(\.\.\., model=DIR\) in Python, --model DIR"):
        SearchPipeline.load(target)
    with SearchPipeline.load(target, tiny_model_dir()) as pipe:  # giving it explicitly works
        assert len(pipe.search("tea", k=2)) == 2


def test_load_rebuilds_the_encoder_the_manifest_describes(tmp_path):
    """Built with an in-memory encoder (prefixes, pooling, normalisation, lengths not in the model directory),
    the index recorded the directory and those settings, but load(dir) read the directory alone and refused
    the index (EncoderMismatchError). model=None now rebuilds the encoder the manifest describes."""
    model = tiny_model_dir()
    built = DualEncoder.from_pretrained(model, pooling="cls", normalize=False, max_length=24,
                                        query_prefix="query: ", document_prefix="passage: ", bf16=False)
    docs = toy_docs(8)
    with SearchPipeline.build(docs, tmp_path / "idx", built, progress=False) as pipe:
        want = [h.id for h in pipe.search("tea", k=3)]
    with SearchPipeline.load(tmp_path / "idx", bf16=False) as pipe:
        enc = pipe.encoder
        assert enc.fingerprint() == built.fingerprint()
        assert (enc.query_prefix, enc.document_prefix, enc.query_tower.pooling, enc.normalize) == \
            ("query: ", "passage: ", "cls", False)
        assert (enc.query_max_length, enc.document_tower.max_length) == (24, 24)
        assert [h.id for h in pipe.search("tea", k=3)] == want
    # the recorded directory given as model= is the same model: it was read alone and refused the index
    with SearchPipeline.load(tmp_path / "idx", model=model, bf16=False) as pipe:
        assert pipe.encoder.fingerprint() == built.fingerprint()
        assert [h.id for h in pipe.search("tea", k=3)] == want
    # weights changed in memory: no manifest can rebuild those, so the error says what to pass
    with torch.no_grad():
        next(built.query_tower.model.parameters()).add_(1.0)
    with SearchPipeline.build(docs, tmp_path / "tuned", built, progress=False):
        pass
    with pytest.raises(EncoderMismatchError, match=r"pass that encoder as model=, or save it with "
                                                   r"DualEncoder\.save_pretrained\(DIR\) and pass model=DIR"):
        SearchPipeline.load(tmp_path / "tuned", bf16=False)


def test_load_says_weights_changed_only_where_the_manifest_was_applied_whole(tmp_path):
    """With model=None every EncoderMismatchError was told "weights changed in memory, or another model saved
    over its directory": a dimension mismatch too, and an index whose towers were pooled differently, which
    loading by directory cannot rebuild (one pooling for both)."""
    model = tiny_model_dir()
    docs = toy_docs(6)
    with SearchPipeline.build(docs, tmp_path / "idx", model, progress=False):
        pass
    _edit_manifest(tmp_path / "idx", lambda m: m["extra"]["pipeline"]["encoder"].update(
        model={"path": tiny_model_dir(hidden=24)}))  # another model saved there: 24 dimensions, not 36
    with pytest.raises(EncoderMismatchError, match="24-dimensional ones; use the model the index was built with$"):
        SearchPipeline.load(tmp_path / "idx", bf16=False)
    query = DualEncoder.from_pretrained(model, pooling="cls", bf16=False).query_tower
    document = DualEncoder.from_pretrained(model, pooling="mean", bf16=False).query_tower
    with SearchPipeline.build(docs, tmp_path / "pooled", DualEncoder(query, document), progress=False):
        pass  # two tower objects record no directory; as if they had come from `model`:
    _edit_manifest(tmp_path / "pooled", lambda m: m["extra"]["pipeline"]["encoder"].update(model={"path": model}))
    with pytest.raises(EncoderMismatchError) as err:
        SearchPipeline.load(tmp_path / "pooled", bf16=False)
    assert str(err.value).endswith("; its towers were pooled differently (query 'cls', documents 'mean'), which "
                                   "loading by directory cannot set: pass that encoder as model=")
    assert "weights changed" not in str(err.value)


def test_load_blames_the_poolings_only_when_the_loaded_ones_differ(tmp_path):
    """Whether the recorded poolings were applied was read from the manifest alone: a two-tower directory
    (query cls, documents mean) saved with save_pretrained restores both, yet after a change of weights in
    memory the load said "its towers were pooled differently ..., which loading by directory cannot set"."""
    model = tiny_model_dir()
    query = DualEncoder.from_pretrained(model, pooling="cls", bf16=False).query_tower
    document = DualEncoder.from_pretrained(model, pooling="mean", bf16=False).query_tower
    DualEncoder(query, document).save_pretrained(str(tmp_path / "two"))
    saved = DualEncoder.from_pretrained(str(tmp_path / "two"), bf16=False)
    assert (saved.query_tower.pooling, saved.document_tower.pooling) == ("cls", "mean")
    docs = toy_docs(6)
    with SearchPipeline.build(docs, tmp_path / "idx", saved, progress=False):
        pass
    with SearchPipeline.load(tmp_path / "idx", bf16=False) as pipe:  # both poolings come back from the directory
        assert pipe.encoder.fingerprint() == saved.fingerprint()
    with torch.no_grad():
        next(saved.document_tower.model.parameters()).add_(1.0)
    with SearchPipeline.build(docs, tmp_path / "tuned", saved, progress=False):
        pass
    with pytest.raises(EncoderMismatchError) as err:
        SearchPipeline.load(tmp_path / "tuned", bf16=False)
    assert "weights changed in memory" in str(err.value) and "pooled differently" not in str(err.value)
