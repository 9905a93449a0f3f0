"""What the command line says when a request cannot be served: the flag, the path, and the command that fixes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import twotower
from tests.cli.cli_run import build_index, run_cli
from tests.retrieval.pipeline_fixtures import tiny_model_dir
from twotower.eval import write_beir_qrels, write_beir_queries

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = 30


@pytest.fixture(scope="module")
def plain_index(tmp_path_factory):
    """A 30-document index built without BM25."""
    return build_index(tmp_path_factory.mktemp("plain"), DOCS)


def test_hybrid_on_an_index_without_bm25_says_how_to_rebuild(plain_index, capsys):
    idx = str(plain_index / "idx")
    rc, out, err = run_cli(capsys, "search", "--index", idx, "--hybrid", "tea")
    assert rc == 2 and out == ""
    assert f"--hybrid: the index {idx} was built without BM25" in err
    assert "twotower index build --bm25" in err and "IndexStore.create" not in err
    beir = plain_index / "beir"
    write_beir_queries({"q1": "tea"}, beir / "queries.jsonl")
    write_beir_qrels({"q1": {"d1": 1}}, beir / "qrels" / "test.tsv")
    rc, _, err = run_cli(capsys, "eval", "--index", idx, "--dataset", str(beir), "--out", str(plain_index / "rep"),
                      "--hybrid", "--no-progress")
    assert rc == 2 and "twotower index build --bm25" in err and not (plain_index / "rep").exists()


def test_hybrid_through_the_python_api_names_the_python_call(plain_index):
    from twotower.retrieval.pipeline import SearchPipeline

    with SearchPipeline.load(plain_index / "idx") as pipe, pytest.raises(ValueError) as info:
        pipe.search("tea", hybrid=True)
    assert "created without BM25" in str(info.value) and "SearchPipeline.build(..., bm25=True)" in str(info.value)


def test_a_reranker_that_is_not_a_model_directory_is_named(plain_index, tmp_path, capsys):
    idx = str(plain_index / "idx")
    rc, _, err = run_cli(capsys, "search", "--index", idx, "--reranker", str(tmp_path), "tea")
    assert rc == 2
    assert f"--reranker {tmp_path}: not a model directory (it has no config.json)" in err
    assert "config file not found" not in err
    rc, _, err = run_cli(capsys, "search", "--index", idx, "--reranker", str(tmp_path / "nope"), "tea")
    assert rc == 2 and f"--reranker {tmp_path / 'nope'}: no such directory" in err
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", str(plain_index / "corpus.jsonl"), "--out",
                      str(tmp_path / "new"), "--model", tiny_model_dir(), "--reranker", str(tmp_path))
    assert rc == 2 and f"--reranker {tmp_path}: not a model directory" in err
    assert not (tmp_path / "new").exists()


def test_reranker_default_beside_a_directory_named_default_says_which_one_is_used(plain_index, tmp_path, capsys,
                                                                                   monkeypatch):
    idx = str(plain_index / "idx")
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(capsys, "search", "--index", idx, "--reranker", "default", "--hybrid", "tea")
    assert "note: --reranker default is the reranker twotower ships, not the directory default/ here" not in err
    os.mkdir(tmp_path / "default")
    # --hybrid on this BM25-less index stops the command right after the reranker is checked
    rc, _, err = run_cli(capsys, "search", "--index", idx, "--reranker", "default", "--hybrid", "tea")
    assert rc == 2 and "--hybrid: the index" in err
    assert "note: --reranker default is the reranker twotower ships, not the directory default/ here; give " \
           "--reranker ./default for that one" in err
    rc, _, err = run_cli(capsys, "search", "--index", idx, "--reranker", "./default", "tea")
    assert rc == 2 and "--reranker ./default: not a model directory" in err


def test_adding_to_a_read_only_pipeline_says_how_to_open_it(plain_index):
    from twotower.retrieval.pipeline import SearchPipeline

    with SearchPipeline.load(plain_index / "idx") as pipe, pytest.raises(ValueError) as info:
        pipe.add([{"_id": "new", "text": "green tea"}])
    assert "opened read-only" in str(info.value) and "readonly=False" in str(info.value)


def test_index_info_json_says_whether_there_is_bm25(plain_index, capsys):
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(plain_index / "idx"), "--json")
    info = json.loads(out)
    assert rc == 0 and info["bm25"] is False and info["bm25_params"] is None
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(plain_index / "idx"))
    assert "bm25        no" in out


def test_search_header_gives_the_recall_the_index_can_give(plain_index, capsys):
    idx = str(plain_index / "idx")
    rc, out, _ = run_cli(capsys, "search", "--index", idx, "-k", "2", "tea")
    assert rc == 0 and out.startswith(f"# dense recall of {DOCS}, ")  # --recall-k 100 on 30 documents
    rc, out, _ = run_cli(capsys, "search", "--index", idx, "-k", "2", "--recall-k", "7", "tea")
    assert rc == 0 and out.startswith("# dense recall of 7, ")


def test_version_flag_prints_the_package_version():
    out = subprocess.run([sys.executable, "-m", "twotower", "--version"], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == f"twotower {twotower.__version__}"


def test_output_into_a_closed_pipe_is_no_traceback(plain_index):
    """`twotower index info | head -4`: the reader went away; it was a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "twotower", "index", "info", "--index", str(plain_index / "idx")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command writes a line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


@pytest.mark.parametrize("command", ["reranker", "demo-reranker"])
def test_dense_mining_without_a_teacher_names_the_flags(command, tmp_path, capsys):
    args = ["train", command, "--out", str(tmp_path / "rr"), "--mine", "dense"]
    if command == "reranker":
        args += ["--model", str(tmp_path), "--pairs", str(tmp_path / "pairs.tsv")]
    rc, out, err = run_cli(capsys, *args)
    assert rc == 2 and "--mine dense rank with the teacher: add --teacher DIR (or --teacher default)" in err
    rc, out, err = run_cli(capsys, *args, "--teacher", str(tmp_path / "nowhere"))
    assert rc == 2 and f"--teacher {tmp_path / 'nowhere'}: not a directory" in err
    assert not (tmp_path / "rr").exists()


@pytest.mark.parametrize("command", ["reranker", "demo-reranker"])
def test_teacher_bm25_names_its_flag(command, tmp_path, capsys):
    args = ["train", command, "--out", str(tmp_path / "rr")]
    if command == "reranker":
        args += ["--model", str(tmp_path), "--pairs", str(tmp_path / "pairs.tsv")]
    rc, out, err = run_cli(capsys, *args, "--teacher-bm25", "1")
    assert rc == 2 and "--teacher-bm25 adds BM25 to the teacher's scores: add --teacher DIR" in err
    for name in ("embedded", "default"):  # both name all-MiniLM-L6-v2; "default" as --model default does
        rc, out, err = run_cli(capsys, *args, "--teacher", name, "--teacher-bm25", "-1")
        assert rc == 2 and "--teacher-bm25 -1: give 0 or more" in err, err
    assert not (tmp_path / "rr").exists()


@pytest.mark.parametrize("command", ["reranker", "demo-reranker"])
def test_residual_names_its_flag(command, tmp_path, capsys):
    args = ["train", command, "--out", str(tmp_path / "rr"), "--residual"]
    if command == "reranker":
        args += ["--model", str(tmp_path), "--pairs", str(tmp_path / "pairs.tsv")]
    rc, _, err = run_cli(capsys, *args)
    assert rc == 2 and "--residual trains a correction to the teacher's scores: add --teacher DIR" in err
    if command == "reranker":
        rc, _, err = run_cli(capsys, *args, "--teacher", "embedded", "--loss", "pointwise")
        assert rc == 2 and "--residual corrects the teacher's listwise scores: use --loss listwise" in err
    assert not (tmp_path / "rr").exists()


def test_titles_without_claims_none_names_the_flags(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "train", "demo-reranker", "--out", str(tmp_path / "rr"), "--titles", "100")
    assert rc == 2 and "--titles sets how many title/text pairs --claims none makes; add --claims none" in err
    rc, _, err = run_cli(capsys, "train", "demo-reranker", "--out", str(tmp_path / "rr"), "--claims", "none",
                         "--titles", "0")
    assert rc == 2 and "--titles 0: give 1 or more" in err
    assert not (tmp_path / "rr").exists()


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "steps=0: give 1 or more (--steps)"),  # was named as train reranker's --max-steps
    (["--layers", "0"], "layers=0: give 1 or more (None: all) (--layers)"),
    (["--evals", "0"], "need at least one dev evaluation to choose a checkpoint (--evals)"),
])
def test_demo_reranker_flags_are_named_as_typed(tmp_path, capsys, flags, message):
    rc, _, err = run_cli(capsys, "train", "demo-reranker", "--out", str(tmp_path / "rr"), *flags)
    assert rc == 2 and message in err
    assert not (tmp_path / "rr").exists()


@pytest.mark.parametrize("argv", [
    ["embed", "--input", "{text}", "--out", "{out}"],
    ["train", "reranker", "--model", "{model}", "--pairs", "{missing}", "--out", "{out}"],
    ["finetune", "classify", "--model", "{model}", "--train", "{missing}", "--dev-fraction", "0.1", "--out", "{out}"],
])
def test_a_device_this_machine_lacks_is_refused_by_flag(tmp_path, capsys, argv):
    """--device gpu was a torch RuntimeError listing 25 device types, and --device cuda on a CPU build an
    AssertionError from deep in torch; both now name the flag before anything loads."""
    import torch

    (tmp_path / "t.txt").write_text("tea\n", encoding="utf-8")
    fill = {"text": str(tmp_path / "t.txt"), "out": str(tmp_path / "o"), "model": str(tmp_path),
            "missing": str(tmp_path / "missing")}
    args = [a.format(**fill) for a in argv]
    rc, _, err = run_cli(capsys, *args, "--device", "gpu")
    assert rc == 2 and "--device gpu: not a device torch knows; give cpu, cuda or cuda:N" in err
    if not torch.cuda.is_available():
        rc, _, err = run_cli(capsys, *args, "--device", "cuda")
        assert rc == 2 and "--device cuda: this machine's torch" in err and "sees no CUDA GPU" in err


@pytest.mark.parametrize("command", ["reranker", "demo-reranker"])
@pytest.mark.parametrize("flags, message", [
    (["--max-windows", "5"], "--max-windows sets how many windows of a document are scored: add --passage-window N"),
    (["--distill-weight", "2"], "--distill-weight weighs the distillation from the teacher: add --teacher DIR"),
    (["--teacher", "embedded", "--residual", "--distill-weight", "2"],
     "--distill-weight weighs the distillation term, which --residual training does not have"),
])
def test_a_flag_that_would_be_ignored_is_refused(tmp_path, capsys, command, flags, message):
    """Without --passage-window or --teacher these flags did nothing, silently."""
    args = ["train", command, "--out", str(tmp_path / "rr"), *flags]
    if command == "reranker":
        args += ["--model", str(tmp_path), "--pairs", str(tmp_path / "missing.tsv")]
    rc, _, err = run_cli(capsys, *args)
    assert rc == 2 and message in err
    assert not (tmp_path / "rr").exists()


def test_an_index_whose_build_was_interrupted_says_how_to_finish_it(tmp_path, capsys):
    """A killed `index build --out idx` leaves idx.build/ (its shards) and no idx: searching idx says so."""
    (tmp_path / "idx.build").mkdir()
    rc, _, err = run_cli(capsys, "search", "--index", str(tmp_path / "idx"), "tea")
    assert rc == 2
    assert err == (f"twotower search: error: --index {tmp_path}/idx: no such directory; {tmp_path}/idx.build holds "
                   "an unfinished build: rerun the same `twotower index build` to finish it\n")


def test_index_check_of_a_file_says_it_is_a_file(tmp_path, capsys):
    (tmp_path / "corpus.jsonl").write_text("{}\n")
    rc, _, err = run_cli(capsys, "index", "check", str(tmp_path / "corpus.jsonl"))
    assert rc == 2 and err == f"twotower index check: {tmp_path}/corpus.jsonl: a file, not an index directory\n"


@pytest.mark.parametrize("command, flag", [
    (["train", "reranker", "--pairs", "{tmp}/pairs.tsv"], "--max-length"), (["train", "demo-reranker"], "--max-length"),
    (["embed", "--input", "{tmp}/texts.txt"], "--max-length"), (["train", "dual", "--data", "{tmp}/p"], "--doc-max-length"),
    (["train", "dual", "--data", "{tmp}/p"], "--query-max-length"),
])
def test_a_max_length_beyond_the_models_positions_is_refused(tmp_path, capsys, command, flag):
    """It was capped at the model's positions without a word: `--max-length 1000` trained at 512."""
    from tests.retrieval.pipeline_fixtures import MAX_POSITIONS

    (tmp_path / "texts.txt").write_text("tea\n")
    model = tiny_model_dir()
    argv = [a.format(tmp=tmp_path) for a in command] + ["--model", model, "--out", str(tmp_path / "out")]
    rc, _, err = run_cli(capsys, *argv, flag, str(MAX_POSITIONS + 1))
    assert rc == 2
    assert f"{flag} {MAX_POSITIONS + 1}: the model in {model} reads at most {MAX_POSITIONS} tokens" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, flag, example", [
    (["embed", "--input", "{tmp}/texts.txt", "--out", "{tmp}/outdir"], "--out", "vectors.npy"),
    (["predict", "classify", "--model", "{tmp}", "--input", "{tmp}/texts.txt", "--out", "{tmp}/outdir"], "--out",
     "predictions.jsonl"),
    (["train", "mine", "--data", "{tmp}/missing", "--out", "{tmp}/outdir"], "--out", "negatives.jsonl"),
    (["train", "pairs", "--corpus", "{tmp}/texts.txt", "--out", "{tmp}/outdir"], "--out", "pairs.jsonl"),
    (["search", "--index", "{tmp}/missing", "--run", "{tmp}/outdir", "tea"], "--run", "run.trec"),
])
def test_an_output_file_that_is_a_directory_is_refused_before_the_work(tmp_path, capsys, argv, flag, example):
    """It was an IsADirectoryError traceback once the work was done (embed: after encoding the whole input)."""
    (tmp_path / "texts.txt").write_text("tea\n")
    (tmp_path / "outdir").mkdir()
    rc, _, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert rc == 2
    assert err.endswith(f"error: {flag} {tmp_path}/outdir: a directory; give a file name, such as {flag} "
                        f"{tmp_path}/outdir/{example}\n")
    assert os.listdir(tmp_path / "outdir") == []


def test_predict_names_a_missing_input_by_its_flag(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "predict", "classify", "--model", str(tmp_path), "--input", str(tmp_path / "nope"))
    assert rc == 2 and err.endswith(f"error: --input {tmp_path}/nope: file not found\n")  # was "X: no such file"


@pytest.mark.parametrize("argv", [
    ["embed", "--input", "{corpus}", "--out", "{tmp}/e.npy"],
    ["index", "build", "--corpus", "{corpus}", "--out", "{tmp}/idx"],
    ["train", "dual", "--data", "{tmp}", "--out", "{tmp}/dual"],
])
def test_a_reranker_given_as_the_embedding_model_is_refused(tmp_path, capsys, argv):
    """A cross-encoder loads as an encoder and embeds into vectors its training never shaped (an index built
    with it ranks by noise); the shipped reranker's data directory said only "no tokenizer"."""
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.default_reranker import DIRECTORY

    ce = str(tmp_path / "ce")
    CrossEncoder.from_encoder(tiny_model_dir(), bf16=False, device="cpu").save_pretrained(ce)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"_id": "d1", "text": "tea"}\n')
    args = [a.format(corpus=corpus, tmp=tmp_path) for a in argv]
    for model, what in [(ce, "a reranker (cross-encoder)"),
                        (DIRECTORY, "the reranker twotower ships (--reranker default)")]:
        rc, out, err = run_cli(capsys, *args, "--model", model)
        assert rc == 2 and out == "", err
        assert err.strip().endswith(f"--model {model}: {what}, which scores query-document pairs; --model takes a "
                                    "model that embeds text: a dual-encoder or encoder directory, or --model default")
        assert sorted(os.listdir(tmp_path)) == ["ce", "corpus.jsonl"]
    if argv[0] == "embed":  # the control: an encoder is taken
        rc, _, err = run_cli(capsys, *args, "--model", tiny_model_dir())
        assert rc == 0, err


def test_library_messages_name_the_flag_without_the_python_keyword(tmp_path, capsys, caplog):
    """On the command line "--passage-window (passage_window)" and "build with --passages (passages=True)" quoted
    keywords the user never typed: the error and the log warning (as the command's formatter writes it) name
    the flag alone."""
    from twotower.cli import _FlagsOnlyFormatter

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"_id": "long", "text": "tea coffee " * 400}) + "\n")
    argv = ["index", "build", "--corpus", str(corpus), "--model", tiny_model_dir(), "--no-progress"]
    rc, _, err = run_cli(capsys, *argv, "--out", str(tmp_path / "p"), "--passages", "--passage-window", "0")
    assert rc == 2 and "--passage-window must be a positive number of tokens, got 0" in err, err
    with caplog.at_level("WARNING"):
        rc, _, err = run_cli(capsys, *argv, "--out", str(tmp_path / "idx"))
    assert rc == 0, err
    [line] = [_FlagsOnlyFormatter("%(message)s").format(r) for r in caplog.records
              if "are longer than the model's maximum" in r.getMessage()]
    assert "build with --passages to split" in line, line


def test_a_parenthesised_part_of_a_users_path_is_kept(tmp_path, capsys):
    """Every message passed through `flags_only`, which took "(y)" in "--qrels nope--x (y).tsv" for a Python
    keyword and printed a path the user never typed (nope--x.tsv)."""
    run = tmp_path / "r.trec"
    run.write_text("q1 Q0 d1 1 1.0 x\n")
    qrels = str(tmp_path / "nope--x (y).tsv")
    rc, _, err = run_cli(capsys, "eval", "--run", str(run), "--qrels", qrels)
    assert rc == 2 and f"--qrels {qrels}: " in err, err
