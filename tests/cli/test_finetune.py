"""`twotower finetune|predict classify|tag|qa` end to end on tiny files, and bad input with file and line."""

from __future__ import annotations

import json
import os

import pytest

from twotower.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py


def _write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


SST = "sentence\tlabel\n" + "i love this movie\t1\ngreat acting\t1\ni hate this movie\t0\nterrible\t0\n" * 4


def test_finetune_and_predict_classify(tiny_dir, tmp_path, capsys):
    train = _write(tmp_path / "train.tsv", SST)
    out = str(tmp_path / "clf")
    rc = main(["finetune", "classify", "--model", tiny_dir, "--train", train, "--dev", train, "--test", train,
               "--out", out, "--epochs", "2", "--batch-size", "8", "--seeds", "0,1", "--no-progress",
               "--freeze-encoder", "--lr", "1e-2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "dev accuracy:" in printed and "(2 seeds)" in printed and "test macro_f1:" in printed
    assert os.path.isfile(os.path.join(out, "finetune_report.json"))
    rc = main(["predict", "classify", "--model", out, "--input", train, "--no-progress"])
    assert rc == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert len(rows) == 16 and {r["label"] for r in rows} <= {"0", "1"}
    assert rows[0]["text"] == "i love this movie" and set(rows[0]["probs"]) == {"0", "1"}
    assert "accuracy=" in captured.err and "precision" in captured.err  # gold present: scores + per-class table
    # unlabelled input: one text a line
    txt = _write(tmp_path / "in.txt", "i love this movie\nterrible\n")
    assert main(["predict", "classify", "--model", out, "--input", txt, "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2 and captured.err == ""
    for flags in (["--batch-size", "0"], ["--threads", "0"]):  # range() arg 3 must not be zero; ignored
        assert main(["predict", "classify", "--model", out, "--input", txt, *flags]) == 2
        assert f"{flags[0]} must be >= 1, got 0" in capsys.readouterr().err


def test_finetune_tag_and_qa(tiny_dir, tmp_path, capsys):
    conll = "john\tB-per\nsmith\tI-per\nlives\tO\nin\tO\nparis\tB-loc\n\nmary\tB-per\nworks\tO\n\n"
    train = _write(tmp_path / "train.conll", conll * 3)
    out = str(tmp_path / "tag")
    assert main(["finetune", "tag", "--model", tiny_dir, "--train", train, "--dev", train, "--out", out,
                 "--epochs", "1", "--batch-size", "4", "--no-progress"]) == 0
    assert "dev f1:" in capsys.readouterr().out
    assert main(["predict", "tag", "--model", out, "--input", _write(tmp_path / "s.txt", "mary lives in paris\n"),
                 "--no-progress"]) == 0
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["tokens"] == ["mary", "lives", "in", "paris"] and len(row["tags"]) == 4

    ctx = "the tower was built in 1889 . paris is the capital of france ."
    squad = {"data": [{"title": "t", "paragraphs": [{"context": ctx, "qas": [
        {"id": "a", "question": "when was the tower built", "answers": [{"text": "1889", "answer_start": 23}]},
        {"id": "b", "question": "what is the capital", "answers": [{"text": "paris", "answer_start": 30}]},
    ]}]}]}
    train = _write(tmp_path / "train.json", json.dumps(squad))
    out = str(tmp_path / "qa")
    assert main(["finetune", "qa", "--model", tiny_dir, "--train", train, "--dev", train, "--out", out,
                 "--epochs", "1", "--max-length", "32", "--doc-stride", "8", "--no-progress"]) == 0
    assert "dev exact_match:" in capsys.readouterr().out
    assert main(["predict", "qa", "--model", out, "--input", train, "--no-progress"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(x) for x in captured.out.splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"] and "f1=" in captured.err
    for r in rows:
        assert r["no_answer"] or ctx[r["start"]:r["end"]] == r["answer"]
    with pytest.raises(SystemExit):
        main(["predict", "qa", "--model", out])  # --input is required


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_bad_input_names_file_and_line(tiny_dir, tmp_path, capsys):
    train = _write(tmp_path / "train.tsv", SST)
    out = str(tmp_path / "o")
    base = ["finetune", "classify", "--model", tiny_dir, "--train", train, "--out", out, "--no-progress"]
    dev = _write(tmp_path / "dev.tsv", "sentence\tlabel\nfine\t1\n\nso so\tmaybe\n")
    err = _error(capsys, [*base, "--dev", dev, "--labels", "0,1"])
    assert f"{dev}:4: label 'maybe' of the dev examples is not in the label map given (labels=, --labels): " \
           "['0', '1']" in err
    empty = _write(tmp_path / "empty.tsv", "sentence\tlabel\nfine\t1\n \t0\n")
    assert f"{empty}:3: empty text" in _error(capsys, [*base, "--dev", empty])
    conll = _write(tmp_path / "bad.conll", "john\tB-per\nsmith\n")
    err = _error(capsys, ["finetune", "tag", "--model", tiny_dir, "--train", conll, "--dev-fraction", "0.5",
                          "--out", out])
    assert f"{conll}:2:" in err
    jsonl = _write(tmp_path / "bad.jsonl", '{"tokens": ["a", "b"], "tags": ["O"]}\n')
    assert f"{jsonl}:1: 2 tokens but 1 tags" in _error(
        capsys, ["finetune", "tag", "--model", tiny_dir, "--train", jsonl, "--dev", jsonl, "--out", out])
    squad = {"data": [{"title": "t", "paragraphs": [{"context": "Paris is big", "qas": [
        {"id": "a", "question": "where", "answers": [{"text": "Paris", "answer_start": 3}]}]}]}]}
    bad = _write(tmp_path / "bad.json", json.dumps(squad))
    err = _error(capsys, ["finetune", "qa", "--model", tiny_dir, "--train", bad, "--dev", bad, "--out", out])
    assert bad in err and "data[0].paragraphs[0].qas[0].answers[0]" in err and "not at offset 3" in err
    missing = str(tmp_path / "missing.tsv")
    assert f"--dev {missing}: file not found" in _error(capsys, [*base, "--dev", missing])
    assert "--seeds" in _error(capsys, [*base, "--dev", train, "--seeds", "a,b"])
    assert "--seeds 0,1,0: each seed at most once" in _error(capsys, [*base, "--dev", train, "--seeds", "0,1,0"])
    # another task's flags were read by nobody: refused before any file is read
    tag = ["finetune", "tag", "--model", tiny_dir, "--train", conll, "--dev", conll, "--out", out]
    assert "--text-column applies to classify only, not tag" in _error(capsys, [*tag, "--text-column", "words"])
    assert "--pooling applies to classify only" in _error(capsys, [*tag, "--pooling", "mean"])
    err = _error(capsys, [*base, "--dev", train, "--doc-stride", "64", "--max-answer-length", "5"])
    assert "--doc-stride applies to qa and tag only, --max-answer-length to qa only, not classify: leave them out" \
        in err
    err = _error(capsys, [*tag, "--max-query-length", "8", "--max-answer-length", "5"])
    assert "--max-query-length, --max-answer-length apply to qa only, not tag: leave them out" in err
    err = _error(capsys, ["finetune", "qa", "--model", tiny_dir, "--train", bad, "--dev", bad, "--out", out,
                          "--label-column", "y", "--max-query-length", "16"])
    assert "--label-column applies to classify only, not qa" in err
    assert "--pair-column applies to classify only, not tag" in _error(
        capsys, ["predict", "tag", "--model", tiny_dir, "--input", conll, "--pair-column", "b"])
    assert not os.path.exists(out)
    # predict with a model of another head
    clf = str(tmp_path / "clf")
    assert main(["finetune", "classify", "--model", tiny_dir, "--train", train, "--dev", train, "--out", clf,
                 "--epochs", "1", "--max-steps", "1", "--no-progress"]) == 0
    capsys.readouterr()
    assert "holds a 'classify' head, not 'tag'" in _error(capsys, ["predict", "tag", "--model", clf, "--input", train])
    assert "not a fine-tuned task model" in _error(capsys, ["predict", "tag", "--model", tiny_dir, "--input", train])


def test_readers_attach_the_right_line_numbers(tmp_path):
    from twotower.eval.tasks import read_qa_examples, read_tag_examples, read_text_examples

    # WNUT-17 separates sentences with a lone tab; -DOCSTART- lines are breaks too
    conll = _write(tmp_path / "t.conll", "-DOCSTART-\tO\n\na\tO\nb\tB-x\n\t\nc\tO\n\n\nd\tI-y\n")
    assert [ex.source for ex in read_tag_examples(conll)] == [f"{conll}:3", f"{conll}:6", f"{conll}:9"]
    tsv = _write(tmp_path / "t.tsv", "text\tlabel\nx\t1\n\ny\t0\n")
    assert [ex.source for ex in read_text_examples(tsv)] == [f"{tsv}:2", f"{tsv}:4"]
    unlabelled = _write(tmp_path / "u.tsv", "sentence\nx\ny\n")
    assert [(ex.text, ex.label) for ex in read_text_examples(unlabelled, need_labels=False)] == \
        [("x", None), ("y", None)]
    jsonl = _write(tmp_path / "q.jsonl", '{"id": 1, "question": "q", "context": "ab cd", '
                                        '"answers": [{"text": "cd", "answer_start": 3}]}\n')
    (q,) = read_qa_examples(jsonl)
    assert q.id == "1" and q.answers == [("cd", 3)] and q.source == f"{jsonl}:1"
    # QA dev is carved by context: no paragraph lands on both sides
    from twotower.encoder.finetuning.task_examples import QAExample, carve_dev

    exs = [QAExample(f"q{i}", "q", f"context {i % 5}") for i in range(40)]
    train, dev = carve_dev("qa", exs, 0.2)
    assert {e.context for e in train}.isdisjoint({e.context for e in dev}) and len(train) + len(dev) == 40
