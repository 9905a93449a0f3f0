"""`twotower finetune|predict`: the label set (--labels, --dev-fraction), empty files, inputs without a label,
the notes the commands print, and their --help."""

from __future__ import annotations

import json

import pytest

from tests.cli.cli_run import run_cli
from twotower.cli import build_parser

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py

SST = "sentence\tlabel\n" + "i love this movie\t1\ngreat acting\t1\ni hate this movie\t0\nterrible\t0\n" * 4
QUICK = ["--epochs", "1", "--max-steps", "1", "--batch-size", "4", "--no-progress"]


def _write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture()
def classifier(tiny_dir, tmp_path, capsys) -> str:
    train = _write(tmp_path / "train.tsv", SST)
    out = str(tmp_path / "clf")
    rc, _, err = run_cli(capsys, "finetune", "classify", "--model", tiny_dir, "--train", train, "--dev", train,
                         "--out", out, *QUICK)
    assert rc == 0, err
    return out


def test_an_empty_split_names_its_flag_and_file(tiny_dir, tmp_path, capsys):
    """A dev file holding only a header said "fine-tuning needs training and dev examples (got 300 and 0)"."""
    train = _write(tmp_path / "train.tsv", SST)
    header = _write(tmp_path / "hdr.tsv", "sentence\tlabel\n")
    base = ["finetune", "classify", "--model", tiny_dir, "--out", str(tmp_path / "o"), *QUICK]
    for flag, files in (("--dev", ["--train", train, "--dev", header]),
                        ("--train", ["--train", header, "--dev", train]),
                        ("--test", ["--train", train, "--dev", train, "--test", header])):
        rc, _, err = run_cli(capsys, *base, *files)
        assert rc == 2 and f"{flag} {header}: no examples in it (a header alone" in err


def test_labels_flag_and_a_rare_label_with_dev_fraction(tiny_dir, tmp_path, capsys):
    """A label only in the carved dev split stopped the run naming a --train line and never --dev-fraction; the
    command line could not give the label set."""
    # one NUM:perc example (line 2): the split keeps it in train, so the error below names that line
    rows = "".join(f"question {i}\tNUM:{'perc' if i < 1 else 'date'}\n" for i in range(20))
    train = _write(tmp_path / "trec.tsv", "text\tlabel_fine\n" + rows)
    base = ["finetune", "classify", "--model", tiny_dir, "--train", train, "--label-column", "label_fine", *QUICK]
    rc, _, err = run_cli(capsys, *base, "--dev-fraction", "0.5", "--out", str(tmp_path / "a"))
    assert rc == 0, err
    labels = _write(tmp_path / "labels.txt", "NUM:perc\nNUM:date\nNUM:count\n")
    rc, _, err = run_cli(capsys, *base, "--dev-fraction", "0.5", "--out", str(tmp_path / "c"), "--labels", labels)
    assert rc == 0 and "note: 1 label of the label map has no training example" in err and "'NUM:count'" in err
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["id2label"] == {"0": "NUM:perc", "1": "NUM:date", "2": "NUM:count"}
    rc, _, err = run_cli(capsys, *base, "--dev-fraction", "0.5", "--out", str(tmp_path / "d"), "--labels", "NUM:date")
    assert rc == 2 and f"{train}:2: label 'NUM:perc' of the train examples is not in the label map given " \
                       "(labels=, --labels): ['NUM:date']" in err
    rc, _, err = run_cli(capsys, *base, "--dev-fraction", "0.5", "--out", str(tmp_path / "e"), "--labels", "a,b,a")
    assert rc == 2 and "labels=['a', 'b', 'a']: give each label once, at least one (--labels); repeated: ['a']" in err
    rc, _, err = run_cli(capsys, *base, "--dev-fraction", "0.5", "--out", str(tmp_path / "f"), "--labels", "labls.txt")
    assert rc == 2 and "--labels labls.txt: no such file" in err


def test_a_missing_label_is_treated_alike_in_tsv_and_jsonl(classifier, tmp_path, capsys):
    """A blank TSV label cell was refused; a JSONL record without one skipped scoring without a word."""
    tsv = _write(tmp_path / "partial.tsv", "sentence\tlabel\ngood movie\t1\nbad movie\t\n")
    jsonl = _write(tmp_path / "partial.jsonl", '{"text": "good movie", "label": 1}\n{"text": "bad movie"}\n')
    blank = _write(tmp_path / "blank.jsonl", '{"text": "good movie", "label": 1}\n{"text": "bad", "label": " "}\n')
    for path, line in ((tsv, 3), (jsonl, 2), (blank, 2)):  # a blank JSONL label was the class " "
        rc, out, err = run_cli(capsys, "predict", "classify", "--model", classifier, "--input", path,
                               "--no-progress")
        assert rc == 0 and len(out.splitlines()) == 2
        assert (f"note: not scored: 1 of 2 inputs have no label (first: {path}:{line}); every input needs one to "
                "be scored") in err and "accuracy=" not in err


def test_predict_notes_truncated_texts(classifier, tmp_path, capsys):
    """60 of 60 reviews were cut to the model's length without a word."""
    text = _write(tmp_path / "long.txt", " ".join(["the quick brown fox jumps over the lazy dog"] * 20) + "\nterrible\n")
    rc, _, err = run_cli(capsys, "predict", "classify", "--model", classifier, "--input", text, "--no-progress")
    assert rc == 0 and "note: 1 of 2 texts is longer than 96 tokens (the model's --max-length) and was truncated at it" in err


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_shows_the_defaults_and_says_what_happens(capsys):
    """finetune, predict and answer showed no default for --epochs, --batch-size ...; predict said its device
    was cuda when available (it is cpu); --label-column suggested TREC files were recognised."""
    text = _help(capsys, "finetune", "classify")
    for shown in ("per seed) (default: 3)", "training examples per step (default: 32)", "decay) (default: 0.1)",
                  "AdamW weight decay (default: 0.01)", "--seeds SEEDS comma-separated seeds, e.g. 0,1,2 (default: 0)",
                  "best checkpoint) (default: 1)", "(default: auto)",
                  "(default: cuda if available)", "needs this flag", "--no-progress no progress bars"):
        assert shown in text, shown
    text = _help(capsys, "predict", "classify")
    assert "texts per forward pass (default: length-sorted batches of about 2,048 tokens on a CPU" in text
    assert "(default: cpu)" in text and "(default: None)" not in text
    assert "cuda if available" not in text
    assert "(default: cpu)" in _help(capsys, "answer")
