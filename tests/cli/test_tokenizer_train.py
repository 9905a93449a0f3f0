"""`twotower tokenizer train`: damaged input is one `path:line:` error, --out never destroys what it held and is
written as a unit, and a vocabulary other than the size asked for says why. Also: a model whose tokenizer has
more tokens than its embedding table is refused at loading.

Each case is one a probe found failing (a traceback, a silent U+FFFD, a model's tokenizer replaced in place).
"""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

import pytest

from tests.cli.cli_run import run_cli
from tests.encoder import task_fixtures

TEXT = ["the quick brown fox jumps over the lazy dog", "hello world", "tokenizers are fun"] * 3


def _train(capsys, *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, "tokenizer", "train", "--no-progress", *argv)


def _corpus(tmp_path: Path) -> str:
    path = tmp_path / "c.txt"
    path.write_text("".join(t + "\n" for t in TEXT), encoding="utf-8")
    return str(path)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _truncated_gz(p: Path) -> None:
    data = gzip.compress("".join(t + "\n" for t in TEXT * 200).encode())
    p.write_bytes(data[: len(data) // 2])


# (file name, how to write it, what the error says after "twotower tokenizer train: error: <file>")
HOSTILE = {
    "truncated-gzip": ("c.txt.gz", _truncated_gz, ":", "the gzip data ends early: the file is truncated"),
    "not-gzip": ("c.txt.gz", lambda p: p.write_text("hello\n"), ": ", "not a gzip file, although its name ends in .gz"),
    "gzip-without-gz-name": ("c.txt", lambda p: p.write_bytes(gzip.compress(b"hello world\n" * 10)), ":1: ",
                             "not valid UTF-8 (invalid start byte); it looks gzip-compressed: name it *.gz"),
    "non-utf8-byte": ("c.txt", lambda p: p.write_bytes(b"hello\nbad \xff byte\n"), ":2: ", "not valid UTF-8"),
    "deep-nesting": ("c.jsonl", lambda p: p.write_text('{"text": "ok"}\n{"text": "t", "x": ' + "[" * 100_000
                                                       + "]" * 100_000 + "}\n"), ":2: ", "JSON nested too deeply"),
    "lone-surrogate": ("c.jsonl", lambda p: p.write_text('{"text": "ok"}\n{"text": "bad \\ud800"}\n'), ":2: ",
                       "text holds a lone surrogate '\\ud800'"),
    "5000-digit-number": ("c.jsonl", lambda p: p.write_text('{"text": "ok", "n": ' + "1" * 5000 + "}\n"), ":1: ",
                          "a number too long to read"),
    "no-text-field": ("c.jsonl", lambda p: p.write_text('{"text": "ok"}\n{"title": "t"}\n'), ":2: ",
                      "missing string field 'text'"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_damaged_input_is_one_line_naming_file_and_line(case, tmp_path, capsys):
    name, write, sep, message = HOSTILE[case]
    path = tmp_path / name
    write(path)
    out = tmp_path / "tok"
    rc, stdout, err = _train(capsys, "--input", str(path), "--vocab-size", "100", "--out", str(out))
    assert rc == 2, err
    assert err.startswith(f"twotower tokenizer train: error: {path}{sep}") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and stdout == ""


def test_a_model_directory_is_refused_even_with_overwrite(tmp_path, capsys):
    model = tmp_path / "clf_model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "vocab.txt").write_text("[PAD]\n")
    before = _snapshot(model)
    for flags in ([], ["--overwrite"]):
        rc, _, err = _train(capsys, "--input", _corpus(tmp_path), "--vocab-size", "60", "--out", str(model), *flags)
        assert rc == 2 and f"--out {model}: a model directory (it has config.json)" in err, err
        assert _snapshot(model) == before


def test_an_unrelated_directory_is_refused_even_with_overwrite(tmp_path, capsys):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.md").write_text("keep me\n")
    for flags in ([], ["--overwrite"]):
        rc, _, err = _train(capsys, "--input", _corpus(tmp_path), "--vocab-size", "60", "--out", str(other), *flags)
        assert rc == 2 and "a directory holding other files (todo.md), not a tokenizer" in err, err
        assert _snapshot(other) == {"todo.md": b"keep me\n"}


def test_an_earlier_tokenizer_is_replaced_only_with_overwrite(tmp_path, capsys):
    corpus, out = _corpus(tmp_path), tmp_path / "tok"
    assert _train(capsys, "--input", corpus, "--vocab-size", "60", "--out", str(out))[0] == 0
    first = _snapshot(out)
    rc, _, err = _train(capsys, "--input", corpus, "--vocab-size", "70", "--out", str(out))
    assert rc == 2 and "already holds a tokenizer; pass --overwrite" in err, err
    assert _snapshot(out) == first
    rc, _, err = _train(capsys, "--input", corpus, "--vocab-size", "70", "--min-frequency", "1", "--out",
                        str(out) + os.sep, "--overwrite")
    assert rc == 0, err
    assert set(_snapshot(out)) == set(first) and _snapshot(out) != first
    assert sorted(os.listdir(tmp_path)) == ["c.txt", "tok"]  # no build or old folder left beside it


def test_out_the_current_directory_is_refused(tmp_path, capsys, monkeypatch):
    """An empty working directory as --out was swapped out whole: the shell was left in a removed directory."""
    corpus = _corpus(tmp_path)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    rc, _, err = _train(capsys, "--input", corpus, "--vocab-size", "60", "--out", ".")
    assert rc == 2 and "--out .: the current directory; the tokenizer replaces its directory whole" in err, err
    assert not os.listdir(tmp_path / "here")


@pytest.mark.parametrize("earlier", [False, True])
def test_a_failed_save_leaves_out_as_it_was(earlier, tmp_path, capsys, monkeypatch):
    """The four files are one unit: a disk that fills after the first leaves neither a torn mix nor a stray file."""
    from twotower.encoder.core import tokenizer as tokenizer_module

    corpus, out = _corpus(tmp_path), tmp_path / "tok"
    out.mkdir()
    flags = []
    if earlier:
        assert _train(capsys, "--input", corpus, "--vocab-size", "60", "--out", str(out))[0] == 0
        flags = ["--overwrite"]
    before = _snapshot(out)
    real, calls = tokenizer_module.atomic_write_text, []

    def full_after_one(path, text):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(path, text)

    monkeypatch.setattr(tokenizer_module, "atomic_write_text", full_after_one)
    rc, _, err = _train(capsys, "--input", corpus, "--vocab-size", "70", "--min-frequency", "1", "--out", str(out),
                        *flags)
    assert rc == 2 and "No space left on device" in err, err
    assert _snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["c.txt", "tok"]


def test_a_vocabulary_other_than_asked_says_why(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    rc, out, err = _train(capsys, "--input", corpus, "--vocab-size", "6", "--out", str(tmp_path / "small"))
    assert rc == 0, err
    assert "(asked for 6: the 5 special tokens and the corpus's 47 single-character pieces are always kept)" in out
    rc, out, err = _train(capsys, "--input", corpus, "--vocab-size", "200", "--out", str(tmp_path / "big"))
    assert rc == 0, err
    assert ("(asked for 200: the corpus has no more distinct pieces seen 2 or more times, --min-frequency 2)"
            in out)
    size = int(out.split("vocabulary ")[1].split(" ")[0])
    rc, out, err = _train(capsys, "--input", corpus, "--vocab-size", str(size), "--out", str(tmp_path / "exact"))
    assert rc == 0 and f"(vocabulary {size}, lowercase=True" in out and "asked for" not in out


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(tiny_dir, tmp_path, capsys):
    """A fine-tuned model whose tokenizer was replaced by a larger one: predict names the directory and sizes."""
    from twotower.encoder import Tokenizer
    from twotower.encoder.finetuning.task_model import TaskModel
    from twotower.encoder.finetuning.tasks import TaskInfo

    with task_fixtures.one_thread():
        clf = tmp_path / "clf"
        TaskModel.from_encoder(tiny_dir, TaskInfo(head="classify", labels=["0", "1"])).save(str(clf))
        table = json.loads((clf / "config.json").read_text())["vocab_size"]
        vocab = tmp_path / "vocab.txt"
        vocab.write_text("".join(t + "\n" for t in [*task_fixtures.tiny_vocab(), "extra1", "extra2"]))
        Tokenizer.from_vocab(str(vocab)).save_pretrained(str(clf))
        texts = tmp_path / "in.txt"
        texts.write_text("i love this movie\n")
        rc, _, err = run_cli(capsys, "predict", "classify", "--model", str(clf), "--input", str(texts),
                             "--no-progress")
    assert rc == 2, err
    assert f"{clf}: the tokenizer has {table + 2} tokens but the model's embedding table has {table}" in err


def test_characters_past_limit_alphabet_are_said_to_become_unk(tmp_path, capsys):
    """It said "the corpus's N single-character pieces are always kept" when --limit-alphabet had left out the
    rarer characters, which become [UNK]."""
    text = " ".join("abcdefghij"[i % 10] * 3 for i in range(300)) + " xq zv\\n"
    (tmp_path / "c.txt").write_text(text.replace("\\n", "\n"), encoding="utf-8")
    rc, out, err = _train(capsys, "--input", str(tmp_path / "c.txt"), "--vocab-size", "6", "--limit-alphabet",
                          "10", "--out", str(tmp_path / "t"))
    assert rc == 0, err
    assert "the corpus's 10 most frequent characters (--limit-alphabet)" in out
    assert "the 4 rarer characters past --limit-alphabet 10 have no piece and become [UNK]" in out


def test_out_is_checked_again_after_training(tmp_path, capsys, monkeypatch):
    """--out was checked before training only; a file saved there meanwhile was deleted by the swap."""
    from twotower.encoder.core.tokenizer import Tokenizer

    corpus, out = _corpus(tmp_path), tmp_path / "tok"
    assert _train(capsys, "--input", corpus, "--vocab-size", "60", "--out", str(out))[0] == 0
    train = Tokenizer.train

    def train_and_save_a_note(*a, **k):
        (out / "notes.md").write_text("mine\n")
        return train(*a, **k)

    monkeypatch.setattr(Tokenizer, "train", train_and_save_a_note)
    rc, _, err = _train(capsys, "--input", corpus, "--vocab-size", "70", "--out", str(out), "--overwrite")
    assert rc == 2 and "an earlier tokenizer and files of yours (notes.md), which --overwrite would remove" in err, err
    assert (out / "notes.md").read_text() == "mine\n"
