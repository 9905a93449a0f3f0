"""`twotower finetune|predict`: what --out may replace, compressed inputs, refused label sets and records, QA
window defaults, and errors in the user's words (probe findings, each checked here)."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from twotower.cli import main
from twotower.encoder.finetuning.finetune import REPORT_NAME
from twotower.eval.tasks import read_qa_examples, read_tag_examples, read_text_examples

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py


SST = "sentence\tlabel\n" + "i love this movie\t1\ngreat acting\t1\ni hate this movie\t0\nterrible\t0\n" * 2


def _write(path, text: str) -> str:
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def _classify(tiny_dir: str, train: str, out: str, *flags: str) -> list[str]:
    return ["finetune", "classify", "--model", tiny_dir, "--train", train, "--dev", train, "--out", out,
            "--max-steps", "1", "--no-progress", *flags]


def _report(out) -> dict:
    with open(os.path.join(out, REPORT_NAME), encoding="utf-8") as f:
        return json.load(f)


# ---- --out: nothing the user had is replaced --------------------------------------------------------------


def test_an_out_that_is_not_a_run_is_refused_and_left_alone(tiny_dir, tmp_path, capsys):
    train = _write(tmp_path / "train.tsv", SST)
    afile = _write(tmp_path / "afile", "keep me\n")
    assert f"--out {afile}: a file; give a directory" in _error(capsys, _classify(tiny_dir, train, afile))
    assert (tmp_path / "afile").read_text() == "keep me\n" and not list(tmp_path.glob("afile.old-*"))

    mine = tmp_path / "mine"
    mine.mkdir()
    _write(mine / "notes.txt", "my notes\n")
    err = _error(capsys, _classify(tiny_dir, train, str(mine)))
    assert f"--out {mine}: a directory holding other files (notes.txt), not a fine-tuning run" in err
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "my notes\n"

    before = sorted(os.listdir(tiny_dir))
    err = _error(capsys, _classify(tiny_dir, train, tiny_dir))
    assert f"--out {tiny_dir}: the --model directory itself" in err
    assert sorted(os.listdir(tiny_dir)) == before

    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is as good as a new one
    assert main(_classify(tiny_dir, train, str(empty))) == 0
    assert _report(empty)["finished"] is True


def test_an_earlier_run_needs_overwrite_and_is_replaced_only_when_the_new_one_is_done(tiny_dir, tmp_path, capsys):
    train = _write(tmp_path / "train.tsv", SST)
    out = str(tmp_path / "run")
    assert main(_classify(tiny_dir, train, out)) == 0
    first = _report(out)
    assert first["finished"] is True and first["config"]["seeds"] == [0]
    err = _error(capsys, _classify(tiny_dir, train, out, "--seeds", "1"))
    assert f"--out {out}: holds an earlier fine-tuning run ({REPORT_NAME}); pass --overwrite" in err
    assert _report(out) == first
    assert main(_classify(tiny_dir, train, out, "--seeds", "1", "--overwrite")) == 0
    assert _report(out)["config"]["seeds"] == [1] and _report(out)["finished"] is True
    assert not os.path.exists(out + ".unfinished")


def test_a_killed_run_keeps_the_earlier_run_and_says_it_did_not_finish(tiny_dir, tmp_path, capsys, monkeypatch):
    from twotower.common.atomic import STAGING_SUFFIX
    from twotower.encoder.finetuning.finetune import FinetuneConfig, finetune, run_finished
    from twotower.encoder.finetuning.task_examples import TextExample
    from twotower.encoder.finetuning.task_model import TaskModel

    data = [TextExample("i love this movie", "1"), TextExample("terrible", "0")] * 4
    cfg = FinetuneConfig(max_steps=1, batch_size=4, progress=False)
    out = str(tmp_path / "run")
    finetune("classify", tiny_dir, data, data, out, cfg)
    earlier = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    with pytest.raises(ValueError, match="holds an earlier fine-tuning run; pass overwrite=True"):
        finetune("classify", tiny_dir, data, data, out, cfg)

    real_save = TaskModel.save

    def save_then_die(self, directory, extra_files=None, also=None):  # killed right after the first checkpoint
        real_save(self, directory, extra_files, also)
        raise KeyboardInterrupt

    monkeypatch.setattr(TaskModel, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        finetune("classify", tiny_dir, data, data, out, cfg, overwrite=True)
    assert {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)} == earlier
    assert run_finished(out) is True and run_finished(out + STAGING_SUFFIX) is False
    fresh = str(tmp_path / "fresh")
    with pytest.raises(KeyboardInterrupt):
        finetune("classify", tiny_dir, data, data, fresh, cfg)
    assert run_finished(fresh) is False and os.path.isfile(os.path.join(fresh, "config.json"))
    monkeypatch.undo()

    txt = _write(tmp_path / "in.txt", "terrible\n")
    assert main(["predict", "classify", "--model", fresh, "--input", txt, "--no-progress"]) == 0
    assert "did not finish" in capsys.readouterr().err
    train = _write(tmp_path / "train.tsv", SST)
    assert f"--out {fresh}: holds an unfinished fine-tuning run" in _error(capsys, _classify(tiny_dir, train, fresh))
    # the next replacing run reuses what the killed one left, and completes
    finetune("classify", tiny_dir, data, data, out, FinetuneConfig(max_steps=1, batch_size=4, progress=False,
                                                                  seeds=(3,)), overwrite=True)
    assert _report(out)["config"]["seeds"] == [3] and run_finished(out) is True
    assert not os.path.exists(out + STAGING_SUFFIX)


# ---- compressed inputs ----------------------------------------------------------------------------------


def test_gzip_inputs_are_read_in_the_format_their_name_gives(tmp_path):
    tag = _write(tmp_path / "tag.jsonl.gz", '{"tokens": ["paris", "is"], "tags": ["B-LOC", "O"]}\n')
    (ex,) = read_tag_examples(tag)
    assert ex.words == ["paris", "is"] and ex.tags == ["B-LOC", "O"]  # was CoNLL: tags like '"B-LOC"]}'
    clf = _write(tmp_path / "c.jsonl.gz", '{"text": "tea", "label": "hot"}\n')
    assert [(e.text, e.label) for e in read_text_examples(clf)] == [("tea", "hot")]
    txt = _write(tmp_path / "c.txt.gz", "tea\ncoffee\n")
    assert [e.text for e in read_text_examples(txt, need_labels=False)] == ["tea", "coffee"]
    words = _write(tmp_path / "s.txt.gz", "mary lives in paris\n")
    assert read_tag_examples(words, need_tags=False)[0].words == ["mary", "lives", "in", "paris"]
    qa = {"id": "q1", "question": "where", "context": "in paris", "answers": [{"text": "paris", "answer_start": 3}]}
    (q,) = read_qa_examples(_write(tmp_path / "q.jsonl.gz", json.dumps(qa) + "\n"))
    assert q.answers == [("paris", 3)]
    squad = {"data": [{"title": "t", "paragraphs": [{"context": "in paris", "qas": [
        {"id": "q1", "question": "where", "answers": [{"text": "paris", "answer_start": 3}]}]}]}]}
    (s,) = read_qa_examples(_write(tmp_path / "q.json.gz", json.dumps(squad)))
    assert s.answers == [("paris", 3)]


# ---- records refused, naming file and line --------------------------------------------------------------


@pytest.mark.parametrize("reader, line, message", [
    ("tag", '{"tokens": ["a", "b"], "tags": [null, "O"]}', "tag 1 must be a string, got null"),
    ("tag", '{"tokens": ["a", "b"], "tags": ["O", true]}', "tag 2 must be a string, got true"),
    ("tag", '{"tokens": [null, "x"], "tags": ["O", "O"]}', "token 1 must be a string, got null"),
    ("classify", '{"text": "a", "label": true}', "field 'label' must be a string or an integer"),
    ("classify", '{"text": "a", "label": "x", "pair": 5}', "field 'pair' must be a string"),
    ("classify", '{"text": "a", "label": "x", "text_pair": ["b"]}', "field 'text_pair' must be a string"),
    ("qa", '{"id": "a", "question": "q", "context": "xy", "answers": [{"text": "x", "answer_start": -2}]}',
     "answer 1: 'answer_start' must be a character offset (an integer >= 0), got -2"),
    ("qa", '{"id": "a", "question": "q", "context": "xy", "answers": [{"text": "y", "answer_start": true}]}',
     "answer 1: 'answer_start' must be a character offset (an integer >= 0), got true"),
])
def test_a_wrong_json_type_is_refused_with_file_and_line(tmp_path, reader, line, message):
    path = _write(tmp_path / "f.jsonl", '\n' + line + "\n")
    read = {"tag": read_tag_examples, "classify": read_text_examples, "qa": read_qa_examples}[reader]
    with pytest.raises(ValueError) as exc:
        read(path)
    assert str(exc.value) == f"{path}:2: {message}"


def test_a_repeated_qa_id_is_refused(tmp_path):
    row = '{"id": "%s", "question": "q", "context": "xy", "answers": [{"text": "x", "answer_start": 0}]}\n'
    path = _write(tmp_path / "q.jsonl", row % "a" + row % "b" + row % "a")
    with pytest.raises(ValueError, match=r"q\.jsonl:3: id 'a' appears twice \(first on line 1\)"):
        read_qa_examples(path)


def test_a_tag_set_that_is_not_bio_is_refused_before_training(tiny_dir, tmp_path, capsys):
    pos = _write(tmp_path / "pos.conll", "the\tDT\ntea\tNN\n\nboil\tVB\nthe\tDT\ntea\tNN\n\n")
    out = tmp_path / "pos"
    err = _error(capsys, ["finetune", "tag", "--model", tiny_dir, "--train", pos, "--dev", pos, "--out", str(out),
                          "--no-progress"])
    assert f"{pos}:1: the tags 'DT', 'NN', 'VB' are not BIO tags (O, B-TYPE, I-TYPE)" in err
    assert not out.exists()


def test_blank_lines_in_a_txt_to_predict_on_are_refused_not_dropped(tmp_path):
    """Output line k answers input line k: a blank line in the middle was dropped silently, shifting the rest."""
    ok = _write(tmp_path / "ok.txt", "tea\ncoffee\n\n\n")  # blank lines at the end shift nothing
    assert [e.source for e in read_text_examples(ok, need_labels=False)] == [f"{ok}:1", f"{ok}:2"]
    gap = _write(tmp_path / "gap.txt", "tea\n\ncoffee\n \nwater\n")
    with pytest.raises(ValueError, match=r"gap\.txt:2: blank line \(2 in all\): each line is one text"):
        read_text_examples(gap, need_labels=False)
    with pytest.raises(ValueError, match=r"gap\.txt:2: blank line \(2 in all\): each line is one sentence"):
        read_tag_examples(gap, need_tags=False)


def test_predict_tags_long_sentences_in_windows_and_warns_of_lone_texts_for_a_pair_model(tiny_dir, tmp_path,
                                                                                           capsys):
    conll = _write(tmp_path / "t.conll", "john\tB-per\nlives\tO\nin\tO\nparis\tB-loc\n\n" * 4)
    out = str(tmp_path / "tag")
    assert main(["finetune", "tag", "--model", tiny_dir, "--train", conll, "--dev", conll, "--out", out,
                 "--max-length", "6", "--max-steps", "1", "--no-progress"]) == 0
    assert json.load(open(tmp_path / "tag" / "config.json"))["twotower_task"]["doc_stride"] == 2  # half of 4
    capsys.readouterr()
    txt = _write(tmp_path / "s.txt", "john lives in paris\njohn lives in paris and john lives in paris\n")
    assert main(["predict", "tag", "--model", out, "--input", txt, "--no-progress"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(x)["tags"] for x in captured.out.splitlines()]
    assert [len(tags) for tags in rows] == [4, 9]
    # 6 tokens: [CLS], 4 words, [SEP]: the first sentence fits exactly, the second (9 words, one token each) is
    # read in windows of 4 words starting every 2 (the old code tagged its last 5 words O unread, with a warning)
    assert "warning" not in captured.err
    assert ("note: 1 sentence longer than the model's 6 tokens was read in 4 overlapping windows; each word is "
            "tagged from the window where it has the most context") in captured.err
    assert main(["predict", "tag", "--model", out, "--input", _write(tmp_path / "one.txt", "paris\n"),
                 "--no-progress"]) == 0
    assert capsys.readouterr().err == ""

    pairs = _write(tmp_path / "p.jsonl", '{"text": "the tea", "pair": "is hot", "label": "y"}\n'
                                         '{"text": "the tea", "pair": "a film", "label": "n"}\n' * 2)
    clf = str(tmp_path / "clf")
    assert main(_classify(tiny_dir, pairs, clf)) == 0
    capsys.readouterr()
    assert main(["predict", "classify", "--model", clf, "--input", _write(tmp_path / "one.txt", "the tea\n"),
                 "--no-progress"]) == 0
    assert "was trained on text pairs, but 1 of the 1 inputs have no second text" in capsys.readouterr().err
    assert main(["predict", "classify", "--model", clf, "--input", pairs, "--no-progress"]) == 0
    assert "warning" not in capsys.readouterr().err


# ---- QA windows -----------------------------------------------------------------------------------------


def test_qa_window_defaults_always_leave_room_to_advance():
    from twotower.encoder.finetuning.finetune import qa_window

    assert qa_window(384, None, None) == (128, 64, 317)  # HF run_qa's 128 and 64
    assert qa_window(128, None, None) == (46, 32, 93)
    for max_length in range(8, 1025):
        stride, query, room = qa_window(max_length, None, None)
        assert 1 <= stride < room and 1 <= query <= 64 and stride <= 128


def test_finetune_qa_runs_with_default_flags_and_bad_windows_are_named_by_flag(tiny_dir, tmp_path, capsys):
    ctx = "the tower was built in 1889 . paris is the capital of france ."
    rows = [{"id": f"q{i}", "question": "when was the tower built", "context": ctx,
             "answers": [{"text": "1889", "answer_start": 23}]} for i in range(4)]
    train = _write(tmp_path / "qa.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    base = ["finetune", "qa", "--model", tiny_dir, "--train", train, "--dev", train, "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "qa"), "--max-steps", "1"]) == 0
    info = json.load(open(tmp_path / "qa" / "config.json"))["twotower_task"]
    assert (info["max_length"], info["doc_stride"], info["max_query_length"]) == (96, 34, 24)  # the 96 positions
    capsys.readouterr()
    err = _error(capsys, [*base, "--out", str(tmp_path / "o"), "--max-length", "32", "--doc-stride", "40"])
    assert "--doc-stride 40: a window of --max-length 32 holds 21 context tokens after a question of up to " \
           "--max-query-length 8 tokens" in err
    err = _error(capsys, [*base, "--out", str(tmp_path / "o"), "--max-query-length", "94"])
    assert "--max-length 96 (the default for this model) leaves 0 context tokens" in err


def test_finetune_tag_takes_doc_stride_and_refuses_one_as_wide_as_a_window(tiny_dir, tmp_path, capsys):
    conll = _write(tmp_path / "t.conll", "john\tB-per\nlives\tO\nin\tO\nparis\tB-loc\n\n" * 4)
    base = ["finetune", "tag", "--model", tiny_dir, "--train", conll, "--dev", conll, "--no-progress",
            "--max-steps", "1"]
    assert main([*base, "--out", str(tmp_path / "tag"), "--max-length", "8", "--doc-stride", "5"]) == 0
    assert json.load(open(tmp_path / "tag" / "config.json"))["twotower_task"]["doc_stride"] == 5
    assert _report(tmp_path / "tag")["config"]["doc_stride"] == 5
    assert main([*base, "--out", str(tmp_path / "d")]) == 0  # the default: half of 96 - 2, the model's positions
    assert json.load(open(tmp_path / "d" / "config.json"))["twotower_task"]["doc_stride"] == 47
    capsys.readouterr()
    err = _error(capsys, [*base, "--out", str(tmp_path / "o"), "--max-length", "8", "--doc-stride", "6"])
    assert ("--doc-stride 6: a window of --max-length 8 holds 6 tokens of a sentence besides [CLS] and [SEP]; the "
            "overlap must be smaller: give --doc-stride 3, or a larger --max-length") in err
    err = _error(capsys, [*base, "--out", str(tmp_path / "o"), "--doc-stride", "94"])
    assert "--doc-stride 94: a window of --max-length 96 (the default for this model) holds 94 tokens" in err
    assert not os.path.exists(tmp_path / "o")


# ---- errors in the user's words -------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["finetune", "classify", "--model", "{model}", "--train", "{tmp}", "--dev", "{train}", "--out", "{out}"],
     "--train {tmp}: a directory, not a file"),
    (["finetune", "classify", "--model", "{model}", "--train", "{train}", "--test", "{tmp}/nope", "--dev", "{train}",
      "--out", "{out}"], "--test {tmp}/nope: file not found"),
    # default = the embedded all-MiniLM-L6-v2 (512 positions), as for the other commands
    (["finetune", "classify", "--model", "default", "--train", "{train}", "--dev", "{train}", "--out", "{out}",
      "--max-length", "600"], "reads at most 512 tokens"),
    (["finetune", "classify", "--model", "{tmp}/nope", "--train", "{train}", "--dev", "{train}", "--out", "{out}"],
     "--model {tmp}/nope: no such directory"),
    (["predict", "classify", "--model", "{tmp}/nope", "--input", "{train}"], "--model {tmp}/nope: no such directory"),
    (["finetune", "classify", "--model", "{model}", "--train", "{train}", "--dev", "{train}", "--out", "{out}",
      "--seeds=-1"], "--seeds -1: seed -1 is out of range; give seeds from 0 to 4294967295"),
    (["finetune", "classify", "--model", "{model}", "--train", "{two}", "--dev", "{two}", "--out", "{out}"],
     "cannot choose the label column among ['label_a', 'label_b']; choose one with --label-column"),
])
def test_errors_name_the_flag(tiny_dir, tmp_path, capsys, monkeypatch, argv, message):
    from twotower.encoder.finetuning.task_model import TaskModel

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(TaskModel, "from_encoder", no_loading)
    fill = {"model": tiny_dir, "tmp": str(tmp_path), "out": str(tmp_path / "o"),
            "train": _write(tmp_path / "train.tsv", SST),
            "two": _write(tmp_path / "two.tsv", "text\tlabel_a\tlabel_b\nx\t1\t2\n")}
    assert message.format(**fill) in _error(capsys, [a.format(**fill) for a in argv])
    assert not (tmp_path / "o").exists()
