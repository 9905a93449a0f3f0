"""The command line under torchrun: only the commands that spread their work run, and rank 0 alone speaks.

Every rank runs the same command on the same input, so a refusal, an input error or a result printed by every
rank said the same thing once per rank; commands that do not split their work ran it whole on every rank,
racing on the same --out (`index add` committed on one rank and failed on the other).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.cli.cli_run import run_cli
from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus
from tests.retrieval.training_fixtures import tiny_beir_dir
from tests.retrieval.training_fixtures import tiny_model_dir as tiny_trainable_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _torchrun(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TWOTOWER_BF16": "0", "PYTHONPATH": REPO}
    return subprocess.run([*TORCHRUN, "-m", "twotower", *argv], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_command_that_does_not_split_its_work_is_refused_by_rank_0_alone(tmp_path, capsys, monkeypatch, rank):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(3))
    rc, out, err = run_cli(capsys, "embed", "--model", tiny_model_dir(), "--input", corpus, "--out",
                           str(tmp_path / "e.npy"))
    assert rc == 2 and out == ""
    if rank == "0":
        assert err == ("twotower embed: error: runs in one process; run it without torchrun (index build, train "
                       "dual, train reranker, pretrain spread their work over torchrun's processes)\n")
    else:
        assert err == ""
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_an_input_error_is_said_once_and_a_peer_stopped_by_rank_0_exits_quietly(tmp_path, capsys, monkeypatch):
    """Rank 1 printed the same error line as rank 0, and a traceback ("rank 0 stopped the build") where only
    rank 0 had checked something."""
    from twotower.common.distributed import PeerStopped

    bad = tmp_path / "missing.jsonl"
    for rank, says in (("0", f"twotower index build: error: --corpus {bad}: file not found"), ("1", None)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        rc, out, err = run_cli(capsys, "index", "build", "--corpus", str(bad), "--out", str(tmp_path / "idx"),
                               "--model", tiny_model_dir(), "--no-progress")
        assert rc == 2 and out == ""
        assert err.startswith(says) if says else err == ""

    def stopped(args):
        raise PeerStopped("rank 0 stopped the build; its error message says why")

    import twotower.cli.index_cmd as index_cmd
    from twotower.cli import main

    monkeypatch.setattr(index_cmd, "run_build", stopped)  # the parser is built in main: it takes this one
    monkeypatch.setenv("RANK", "1")
    rc = main(["index", "build", "--corpus", str(bad), "--out", str(tmp_path / "idx")])
    assert rc == 1 and capsys.readouterr() == ("", "")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_bad_flag_is_said_by_rank_0_alone_and_every_rank_exits_as_argparse_does(capsys, monkeypatch, rank):
    """argparse printed its usage error once per rank."""
    from twotower.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as stop:
        main(["train", "dual", "--model", "m", "--data", "d", "--out", "o", "--bogus"])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    if rank == "0":
        assert "error: unrecognized arguments: --bogus" in err
    else:
        assert err == ""


@pytest.mark.parametrize("marked", [True, False])
def test_an_error_only_one_rank_met_is_said_by_that_rank_naming_it(tmp_path, capsys, monkeypatch, marked):
    """An error raised on rank 1 alone (its own share, its own saved generator) was never printed: rank 0, which
    speaks for all, had not met it. Marked `this_rank_only`, rank 1 says it; unmarked (every rank met it), only
    rank 0 does."""
    import twotower.cli.index_cmd as index_cmd
    from twotower.cli import main
    from twotower.common.distributed import this_rank_only

    def failed(args):
        error = ValueError("rank1/torch_cpu: missing")
        raise this_rank_only(error) if marked else error

    monkeypatch.setattr(index_cmd, "run_build", failed)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    rc = main(["index", "build", "--corpus", "c.jsonl", "--out", str(tmp_path / "idx")])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err == ("twotower index build: error: rank 1: rank1/torch_cpu: missing\n" if marked else "")


def test_under_torchrun_train_dual_prints_one_result_and_embed_is_refused_once(tmp_path):
    """Also said once, not once per rank: the judgments skipped in the training data. And the checkpoint records the number of processes: --batch-size is per rank."""
    data = str(tmp_path / "data")
    shutil.copytree(tiny_beir_dir(), data)
    with open(os.path.join(data, "qrels", "train.tsv"), "a", encoding="utf-8") as f:
        f.write("q0\tnot-in-the-corpus\t1\n")  # a judged document the corpus lacks: skipped, with a warning
    res = _torchrun("train", "dual", "--model", tiny_trainable_dir(), "--data", data, "--out",
                    str(tmp_path / "dual"), "--max-steps", "1", "--batch-size", "2", "--doc-max-length", "48",
                    "--dev-fraction", "0.25", "--no-progress", "--no-bf16", "--save-last")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 1, res.stdout  # rank 1 printed {"best": null, ..., "initial_dev_ndcg@10": NaN} too
    assert json.loads(lines[0])["best"] == str(tmp_path / "dual" / "best")
    assert res.stderr.count("training data: skipped") == 1, res.stderr
    for name in ("best", "last"):
        with open(tmp_path / "dual" / name / "training_args.json") as f:
            assert json.load(f)["world_size"] == 2
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(3))
    res = _torchrun("embed", "--model", tiny_model_dir(), "--input", corpus, "--out", str(tmp_path / "e.npy"))
    assert res.returncode != 0 and res.stdout == ""
    assert res.stderr.count("twotower embed: error: runs in one process; run it without torchrun") == 1, res.stderr
    assert not os.path.exists(tmp_path / "e.npy")


def test_under_torchrun_train_reranker_runs_one_training_that_rank_0_alone_writes(tmp_path):
    """It was refused; before that, each rank ran the whole training, both writing the same --out."""
    out = tmp_path / "rr"
    res = _torchrun("train", "reranker", "--model", tiny_trainable_dir(0.2), "--pairs", tiny_beir_dir(), "--out",
                    str(out), "--max-steps", "2", "--eval-every", "1", "--batch-size", "2", "--group-size", "4",
                    "--max-length", "48", "--passage-window", "8", "--dev-fraction", "0.25", "--dev-rerank-k", "10",
                    "--no-progress", "--no-bf16", "--save-last")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 1, res.stdout
    for name in ("best", "last"):  # --batch-size is per rank: the global batch is world_size x batch_size
        with open(out / name / "training_args.json") as f:
            assert {k: v for k, v in json.load(f).items() if k in ("world_size", "batch_size")} == {
                "world_size": 2, "batch_size": 2}
    result = json.loads(lines[0])
    assert result["best"] == str(out / "best") and result["steps"] == 2
    with open(out / "train_log.jsonl") as f:
        log = [json.loads(line) for line in f]
    assert [r["world_size"] for r in log if r["event"] == "config"] == [2]
    assert [r["step"] for r in log if r["event"] == "step"] == [1, 2]  # each step once: rank 0's record
    assert [r["step"] for r in log if r["event"] == "eval"] == [0, 1, 2]
    assert os.path.isfile(out / "best" / "model.safetensors") and os.path.isfile(out / "negatives.jsonl")
    assert not [name for name in os.listdir(out) if name.startswith(".")]  # no checkpoint left half-swapped
