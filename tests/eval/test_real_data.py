"""Readers on the real staged datasets (skipped when /work/shared/data is absent), and a real-qrels CLI check."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from twotower.cli import main
from twotower.eval import (
    load_beir,
    read_beir_qrels,
    read_classification_tsv,
    read_conll,
    read_qrels,
    read_squad,
    squad_references,
    squad_v1_scores,
    tagging_report,
    write_trec_run,
)


def test_beir_scifact(data_dir):
    root = data_dir("beir-scifact")
    test = load_beir(root, "test")
    assert (len(test.corpus), len(test.queries), len(test.qrels)) == (5183, 1109, 300)
    assert sum(len(j) for j in test.qrels.values()) == 339
    assert test.corpus["4983"].title.startswith("Microstructural development of human newborn")
    train = load_beir(root, "train", corpus=False)
    assert (len(train.qrels), sum(len(j) for j in train.qrels.values())) == (809, 919)
    assert set(test.qrels).isdisjoint(train.qrels)


@pytest.mark.parametrize(
    ("name", "docs", "judged_queries", "qrels_rows"),
    [
        ("cranfield", 1400, 225, 1837),
        ("cisi", 1460, 76, 3114),
        ("medline", 1033, 30, 696),
        ("adi", 82, 35, 170),
    ],
)
def test_classic_ir(data_dir, name, docs, judged_queries, qrels_rows):
    data = load_beir(data_dir("classic-ir") / name, "test")
    assert len(data.corpus) == docs
    assert len(data.qrels) == judged_queries
    assert sum(len(j) for j in data.qrels.values()) == qrels_rows


def test_cranfield_cleverdon_codes(data_dir):
    codes = read_beir_qrels(data_dir("classic-ir") / "cranfield" / "qrels" / "test.cleverdon_codes.tsv")
    counts = Counter(v for j in codes.values() for v in j.values())
    assert counts == {-1: 225, 1: 128, 2: 387, 3: 734, 4: 363}


def test_xquad_en(data_dir):
    examples = read_squad(data_dir("xquad-en") / "xquad.en.json", check_offsets=True)
    assert len(examples) == 1190
    assert len({ex.context for ex in examples}) == 240 and len({ex.title for ex in examples}) == 48
    # SOURCE.md says "3 reference answers", but the staged file holds one answer per question (XQuAD's form).
    assert all(len(ex.answers) == 1 and not ex.is_impossible for ex in examples)
    refs = squad_references(examples)
    oracle = squad_v1_scores({q: golds[0] for q, golds in refs.items()}, refs)
    assert oracle["exact_match"] == 100.0 and oracle["f1"] == 100.0
    empty = squad_v1_scores({q: "" for q in refs}, refs)
    assert empty["exact_match"] == 0.0 and empty["f1"] == 0.0


@pytest.mark.parametrize(
    ("filename", "sentences", "tokens"),
    [
        ("wnut17train.conll", 3394, 62730),
        ("emerging.dev.conll", 1009, 15733),
        ("emerging.test.annotated", 1287, 23394),
    ],
)
def test_wnut17(data_dir, filename, sentences, tokens):
    data = read_conll(data_dir("wnut17") / filename)
    assert len(data) == sentences
    assert sum(len(s.tokens) for s in data) == tokens


def test_wnut17_entities_match_seqeval(data_dir):
    seqeval = pytest.importorskip("seqeval.metrics")
    tags = [s.tags for s in read_conll(data_dir("wnut17") / "wnut17train.conll")]
    begins = Counter(t[2:] for sent in tags for t in sent if t.startswith("B-"))
    assert sum(begins.values()) == 1975 and begins["person"] == 660 and begins["location"] == 548
    gold = tagging_report(tags, tags)
    assert gold.f1 == 1.0 and gold.num_true >= 1975
    # a corrupted copy (every 7th I- tag becomes O) scored both ways
    corrupted = [
        [("O" if t.startswith("I-") and (i * 31 + j) % 7 == 0 else t) for j, t in enumerate(s)]
        for i, s in enumerate(tags)
    ]
    ours = tagging_report(tags, corrupted)
    assert ours.f1 == pytest.approx(seqeval.f1_score(tags, corrupted))
    assert ours.precision == pytest.approx(seqeval.precision_score(tags, corrupted))


def test_sst2(data_dir):
    root = data_dir("sst2")
    sizes = {split: len(read_classification_tsv(root / f"{split}.tsv")) for split in ("train", "dev", "test")}
    assert sizes == {"train": 60614, "dev": 6735, "test": 872}
    labels = Counter(ex.label for ex in read_classification_tsv(root / "test.tsv"))
    assert labels == {"1": 444, "0": 428}


def test_trec_qc(data_dir):
    root = data_dir("trec-qc")
    train = read_classification_tsv(root / "train.tsv", label_column="label_coarse")
    test = read_classification_tsv(root / "test.tsv", label_column="label_coarse")
    assert (len(train), len(test)) == (5452, 500)
    assert Counter(ex.label for ex in test) == {
        "ABBR": 9,
        "DESC": 138,
        "ENTY": 94,
        "HUM": 65,
        "LOC": 81,
        "NUM": 113,
    }
    fine = read_classification_tsv(root / "train.tsv", label_column="label_fine")
    assert len({ex.label for ex in fine}) == 50


def test_cli_on_scifact_matches_pytrec_eval(data_dir, tmp_path, capsys):
    """A trivial run over the real SciFact test qrels, scored by `twotower eval` and by pytrec_eval."""
    pytrec_eval = pytest.importorskip("pytrec_eval")
    root = data_dir("beir-scifact")
    data = load_beir(root, "test")
    doc_ids = sorted(data.corpus)
    rng = np.random.default_rng(0)
    run = {}
    for qid, judged in data.qrels.items():
        if rng.random() < 0.05:
            continue  # a few judged queries left unanswered: they count 0 in our mean
        picked = {doc_ids[i] for i in rng.choice(len(doc_ids), size=150, replace=False)}
        if rng.random() < 0.6:
            picked |= set(judged)
        run[qid] = {d: float(rng.integers(0, 20)) / 4 for d in picked}  # coarse scores: many ties
    run_path = tmp_path / "trivial.trec"
    write_trec_run(run, run_path, tag="trivial")
    qrels_path = root / "qrels" / "test.tsv"
    metrics = "ndcg@10,recall@100,map,p@5,rprec"
    assert (
        main(["eval", "--run", str(run_path), "--qrels", str(qrels_path), "--metrics", metrics, "--json"])
        == 0
    )
    ours = json.loads(capsys.readouterr().out)

    with open(run_path) as handle:
        ref_run = pytrec_eval.parse_run(handle)  # pytrec_eval reads our file itself
    qrels = read_qrels(qrels_path)
    measures = {"ndcg_cut.10", "recall.100", "map", "P.5", "Rprec"}
    reference = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(ref_run)
    keys = {
        "ndcg@10": "ndcg_cut_10",
        "recall@100": "recall_100",
        "map": "map",
        "p@5": "P_5",
        "rprec": "Rprec",
    }
    assert ours["num_queries"] == 300 and len(reference) == len(run) < 300
    for label, key in keys.items():
        per_query = [reference[q][key] if q in reference else 0.0 for q in qrels]
        assert ours[label] == pytest.approx(sum(per_query) / 300, abs=1e-9)
        for qid in reference:
            assert ours["per_query"][qid][label] == pytest.approx(reference[qid][key], abs=1e-9)
    assert 0.3 < ours["recall@100"] < 0.9  # the planted relevant documents are found
