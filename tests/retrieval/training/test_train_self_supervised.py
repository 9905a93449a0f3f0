"""Self-supervised pairs: independent cropping and the inverse cloze task."""

from __future__ import annotations

import pytest

from twotower.retrieval.training.self_supervised import (
    independent_crops,
    inverse_cloze,
    split_sentences,
    write_pairs_jsonl,
)
from twotower.retrieval.training.training_data import read_jsonl_training

DOCS = {
    "a": " ".join(f"w{i}" for i in range(40)),
    "b": "Tea is a drink. It is made from leaves. Green tea is not fermented. Black tea is.",
    "short": "too short",
}


def test_crops_are_spans_of_their_document():
    data = independent_crops(DOCS, pairs_per_document=3, seed=0)
    assert len(data.examples) == 6 and data.skipped.as_dict() == {"documents shorter than 10 words": 1}
    for ex in data.examples:
        source = DOCS[ex.query_id.split(":")[1]]
        positive = data.corpus[ex.positives[0]]
        assert ex.query in source and positive in source
        n = len(source.split())
        assert 5 <= len(ex.query.split()) <= max(5, round(0.5 * n))
    assert independent_crops(DOCS, seed=0).examples == independent_crops(DOCS, seed=0).examples
    with pytest.raises(ValueError, match="min_ratio"):
        independent_crops(DOCS, min_ratio=0.6, max_ratio=0.5)


def test_inverse_cloze_removes_the_sentence_usually():
    assert split_sentences(DOCS["b"]) == ["Tea is a drink.", "It is made from leaves.", "Green tea is not fermented.",
                                          "Black tea is."]
    removed = kept = 0
    for seed in range(40):
        data = inverse_cloze({"b": DOCS["b"]}, seed=seed)
        ex = data.examples[0]
        context = data.corpus[ex.positives[0]]
        assert ex.query in split_sentences(DOCS["b"])
        if ex.query in split_sentences(context):
            kept += 1
        else:
            removed += 1
            assert len(split_sentences(context)) == 3
    assert removed > kept > 0  # kept ~10% of the time
    assert inverse_cloze(DOCS).skipped.as_dict() == {"documents with fewer than 3 sentences": 2}


def test_pairs_file_feeds_the_training_reader(tmp_path):
    data = independent_crops(DOCS, seed=0)
    path = str(tmp_path / "pairs.jsonl")
    assert write_pairs_jsonl(path, data) == len(data.examples)
    read = read_jsonl_training(path)
    assert [e.query for e in read.examples] == [e.query for e in data.examples]
    assert [read.corpus[e.positives[0]] for e in read.examples] == [data.corpus[e.positives[0]] for e in data.examples]


@pytest.mark.parametrize("argv, message", [
    (["--pairs-per-document", "0"], "--pairs-per-document must be >= 1, got 0"),  # was "no document is long enough ()"
    (["--pairs-per-document", "-2"], "--pairs-per-document must be >= 1, got -2"),
    (["--method", "ict", "--pairs-per-document", "3"], "--pairs-per-document applies to --method crop"),  # was ignored
])
def test_cli_pairs_flags_are_refused_in_their_own_words(tmp_path, capsys, argv, message):
    import json

    from twotower.cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "a", "text": " ".join(f"w{i}." for i in range(40))}) + "\n")
    assert main(["train", "pairs", "--corpus", str(corpus), "--out", str(tmp_path / "p.jsonl"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl").exists()


def test_crop_count_is_every_crop_the_sampler_can_draw():
    import random

    from twotower.retrieval.training.self_supervised import _crop, crop_count

    for n in (10, 17, 40):
        words = [f"w{i}" for i in range(n)]
        rng = random.Random(0)
        assert len({_crop(words, rng, 0.1, 0.5, 5) for _ in range(20_000)}) == crop_count(n)
    with pytest.raises(ValueError, match=r"pairs_per_document=457: the longest document \(40 words\) can be cropped "
                                         r"456 distinct ways.*give at most 456 \(--pairs-per-document\)"):
        independent_crops(DOCS, pairs_per_document=457)
    assert len(independent_crops({"a": DOCS["a"]}, pairs_per_document=456).examples) == 456


def test_cli_pairs_per_document_beyond_what_the_corpus_can_crop_is_refused(tmp_path, capsys):
    """--pairs-per-document 100000000000 drew crops without end; the corpus bounds how many distinct ones exist."""
    import json
    import signal

    from twotower.cli import main

    def hung(*_):
        raise AssertionError("train pairs did not return")

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"_id": "a", "text": " ".join(f"w{i}" for i in range(40))}) + "\n"
                      + json.dumps({"_id": "b", "text": "too short"}) + "\n")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        rc = main(["train", "pairs", "--corpus", str(corpus), "--out", str(tmp_path / "p.jsonl"),
                   "--pairs-per-document", "100000000000"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert rc == 2 and (f"--pairs-per-document 100000000000: the longest document of --corpus {corpus} (40 words) "
                        "can be cropped 456 distinct ways") in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl").exists()
    assert main(["train", "pairs", "--corpus", str(corpus), "--out", str(tmp_path / "p.jsonl"),
                 "--pairs-per-document", "456"]) == 0
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 456


def test_cli_pairs_corpus_that_is_a_directory_says_so(tmp_path, capsys):
    """A BEIR directory given as --corpus was "corpus file not found"."""
    from twotower.cli import main

    (tmp_path / "beir").mkdir()
    (tmp_path / "beir" / "corpus.jsonl").write_text('{"_id": "a", "text": "tea"}\n')
    rc = main(["train", "pairs", "--corpus", str(tmp_path / "beir"), "--out", str(tmp_path / "p.jsonl")])
    assert rc == 2 and (f"--corpus {tmp_path / 'beir'}: a directory, not a file; give the file inside it: --corpus "
                        f"{tmp_path / 'beir' / 'corpus.jsonl'}") in capsys.readouterr().err
