"""Reranker soups: averaging runs' weights, the checks that the runs can be averaged, the soup's own dev weights."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
from twotower.retrieval.training.soup import average_weights, soup_rerankers
from twotower.retrieval.training.train_reranker import RerankerTrainConfig, train_reranker


def _save(tmp_path, name, tensors):
    path = str(tmp_path / f"{name}.safetensors")
    save_file(tensors, path)
    return path


def test_average_weights_is_the_mean_and_keeps_shared_tensors_bit_for_bit(tmp_path):
    frozen = torch.tensor([0.1, 1 / 3, 7.7])  # the float32 mean of three copies of 7.7 is 4.8e-7 off
    a = _save(tmp_path, "a", {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "emb": frozen, "ids": torch.arange(3)})
    b = _save(tmp_path, "b", {"w": torch.tensor([[3.0, 0.0], [3.0, -4.0]]), "emb": frozen.clone(),
                              "ids": torch.arange(3)})
    c = _save(tmp_path, "c", {"w": torch.tensor([[2.0, 1.0], [0.0, 3.0]]), "emb": frozen.clone(),
                              "ids": torch.arange(3)})
    out = average_weights([a, b, c])
    assert torch.equal(out["w"], torch.tensor([[2.0, 1.0], [2.0, 1.0]]))
    assert torch.equal(out["emb"], frozen) and torch.equal(out["ids"], torch.arange(3))
    half = average_weights([a, _save(tmp_path, "z", {"w": torch.zeros(2, 2), "emb": frozen, "ids": torch.arange(3)})])
    assert torch.equal(half["w"], torch.tensor([[0.5, 1.0], [1.5, 2.0]]))


@pytest.mark.parametrize("other, message", [
    ({"w": torch.zeros(2, 2)}, "hold different tensors"),
    ({"w": torch.zeros(2, 3), "n": torch.arange(3)}, r"tensor w is \(2, 3\)"),
    ({"w": torch.zeros(2, 2, dtype=torch.float16), "n": torch.arange(3)}, "float16"),
    ({"w": torch.zeros(2, 2), "n": torch.arange(1, 4)}, "n is torch.int64 and differs"),
])
def test_average_weights_refuses_files_that_do_not_match(tmp_path, other, message):
    a = _save(tmp_path, "a", {"w": torch.ones(2, 2), "n": torch.arange(3)})
    with pytest.raises(ValueError, match=message):
        average_weights([a, _save(tmp_path, "b", other)])


def _run(tmp_path, name, **kw):
    """A tiny reranker run with a dense first stage, so its best checkpoint stores dense and hybrid weights."""
    base = dict(model=tiny_model_dir(0.2), pairs=tiny_beir_dir(), out=str(tmp_path / name), group_size=4,
                batch_size=4, max_length=48, lr=2e-3, progress=False, dev_fraction=0.25, dev_rerank_k=10, bf16=False,
                max_steps=4, eval_every=4, eval_at_start=False, teacher=tiny_model_dir(), mine="dense",
                first_stage="dense")
    return train_reranker(RerankerTrainConfig(**{**base, **kw}))


def _alphas(directory):
    with open(os.path.join(directory, "rerank_interpolation.json")) as f:
        return json.load(f)


def test_a_soup_of_one_run_with_itself_is_that_run_scored_again(tmp_path, caplog):
    """Soup([A, A]) has A's weights bit for bit, and re-scoring it on the shared dev split gives back the
    dev scores, weights and curves training stored for A (so the soup's own numbers are dev numbers). It
    says that one run was given twice, which is rarely meant."""
    res = _run(tmp_path, "a")
    soup = soup_rerankers([str(tmp_path / "a"), res.best_dir], str(tmp_path / "soup"), progress=False)
    assert f"{res.best_dir} is given twice: its weights count twice in the soup" in caplog.text
    weights = load_file(os.path.join(soup.directory, "model.safetensors"))
    for name, t in load_file(os.path.join(res.best_dir, "model.safetensors")).items():
        assert torch.equal(weights[name], t), name
    assert soup.dev_ndcg10 == pytest.approx(res.best_score, abs=1e-9)
    mine, theirs = _alphas(soup.directory), _alphas(res.best_dir)
    assert mine["by_first_stage"] == theirs["by_first_stage"] == soup.alphas_by_first_stage
    for curve in ("dev_ndcg@10_by_alpha", "hybrid_dev_ndcg@10_by_alpha"):
        assert mine[curve] == pytest.approx(theirs[curve], abs=1e-9), curve
    assert soup.first_stage_ndcg10 == pytest.approx(res.first_stage_score, abs=1e-9)
    with open(os.path.join(soup.directory, "training_args.json")) as f:
        args = json.load(f)
    assert args["soup_of"] == [os.path.abspath(res.best_dir)] * 2 and args["dev_ndcg@10"] == soup.dev_ndcg10
    assert args["world_size"] == 1  # the runs'
    assert [i["dev_ndcg@10"] for i in soup.ingredients] == [res.best_score] * 2
    curve = max(theirs["dev_ndcg@10_by_alpha"].values())
    assert [i["interpolated_dev_ndcg@10"] for i in soup.ingredients] == [curve] * 2
    # a checkpoint from before the dense curve was kept beside the hybrid's: its run's log says it
    with open(os.path.join(res.best_dir, "rerank_interpolation.json"), "w") as f:
        json.dump({k: v for k, v in theirs.items() if k != "dev_ndcg@10_by_alpha"}, f)
    again = soup_rerankers([res.best_dir, res.best_dir], str(tmp_path / "soup2"), progress=False)
    assert [i["interpolated_dev_ndcg@10"] for i in again.ingredients] == pytest.approx([curve] * 2, abs=1e-12)


def test_runs_with_other_seeds_and_the_same_dev_seed_average(tmp_path, capsys):
    """Seeds 0 and 1 with --dev-seed 0 carve the same dev queries and train differently; the soup is their
    mean, loads as a reranker, and the CLI reports it. A run whose dev split differs is refused."""
    from twotower.cli import main
    from twotower.retrieval.cross_encoder import CrossEncoder

    a, b = _run(tmp_path, "s0"), _run(tmp_path, "s1", seed=1, dev_seed=0)
    wa, wb = (load_file(os.path.join(r.best_dir, "model.safetensors")) for r in (a, b))
    assert not torch.equal(wa["classifier.weight"], wb["classifier.weight"])
    rc = main(["train", "soup", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "soup"),
               "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["reranker"] == str(tmp_path / "soup") and len(out["ingredients"]) == 2
    assert set(out["alphas_by_first_stage"]) == {"dense", "hybrid"}
    assert out["first_stage_dev_ndcg@10"] == pytest.approx(a.first_stage_score, abs=1e-4)  # the same dev queries
    soup = load_file(os.path.join(out["reranker"], "model.safetensors"))
    for name in wa:
        torch.testing.assert_close(soup[name], (wa[name] + wb[name]) / 2, rtol=0, atol=1e-6)
    pairs = [("alpha beta", "alpha beta gamma"), ("alpha beta", "delta")]
    assert np.isfinite(CrossEncoder.from_pretrained(out["reranker"], bf16=False).predict(pairs)).all()

    _run(tmp_path, "other", seed=1)  # its own dev split
    rc = main(["train", "soup", str(tmp_path / "s0"), str(tmp_path / "other"), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "carved different dev splits (dev seed 0 vs 1)" in err and "--dev-seed" in err
    assert not os.path.exists(tmp_path / "x")


def test_soup_refuses_what_is_not_a_run_and_runs_of_other_data(tmp_path, capsys):
    from twotower.cli import main

    _run(tmp_path, "a")
    rc = main(["train", "soup", str(tmp_path / "a"), str(tmp_path / "nope"), "--out", str(tmp_path / "x")])
    assert rc == 2 and f"{tmp_path / 'nope'}: not a reranker run" in capsys.readouterr().err
    _run(tmp_path, "b", pairs=tiny_beir_dir(seed=1))
    rc = main(["train", "soup", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "x")])
    assert rc == 2 and "differ in pairs" in capsys.readouterr().err
    rc = main(["train", "soup", str(tmp_path / "a"), "--out", str(tmp_path / "x")])
    assert rc == 2 and "at least two runs" in capsys.readouterr().err


def test_soup_out_never_replaces_what_is_there(tmp_path, capsys, monkeypatch):
    """--out was replaced whatever it was, with exit 0: the user's files, an input run (its log and negatives),
    an input run's best/ checkpoint."""
    from twotower.cli import main

    _run(tmp_path, "a")
    _run(tmp_path, "b", seed=1, dev_seed=0)
    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    before = sorted(os.listdir(tmp_path / "a")), sorted(os.listdir(tmp_path / "a" / "best"))
    for out in (runs[0], os.path.join(runs[1], "best"), str(tmp_path)):
        rc = main(["train", "soup", *runs, "--out", out, "--no-progress"])
        assert rc == 2 and f"--out {out}: it holds " in capsys.readouterr().err, out
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    rc = main(["train", "soup", *runs, "--out", str(tmp_path / "mine"), "--no-progress"])
    assert rc == 2 and "a directory holding other files (notes.txt), not a soup" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert (sorted(os.listdir(tmp_path / "a")), sorted(os.listdir(tmp_path / "a" / "best"))) == before
    out = str(tmp_path / "soup")
    assert main(["train", "soup", *runs, "--out", out, "--no-progress"]) == 0
    capsys.readouterr()
    rc = main(["train", "soup", *runs, "--out", out, "--no-progress"])
    assert rc == 2 and "holds an earlier soup; pass --overwrite" in capsys.readouterr().err
    assert main(["train", "soup", *runs, "--out", out, "--no-progress", "--overwrite"]) == 0
    capsys.readouterr()
    # an earlier soup beside the user's own files was replaced with them, exit 0
    (tmp_path / "soup" / "README.md").write_text("my notes")
    rc = main(["train", "soup", *runs, "--out", out, "--no-progress", "--overwrite"])
    assert rc == 2 and "an earlier soup and files of yours (README.md)" in capsys.readouterr().err
    assert (tmp_path / "soup" / "README.md").read_text() == "my notes"
    (tmp_path / "soup" / "README.md").unlink()
    # a file saved into --out while the soup is scored: checked again before the swap, nothing replaced
    from twotower.retrieval.training import alpha

    choose = alpha.choose_alpha

    def choose_and_save(*a, **k):
        (tmp_path / "soup" / "eval.txt").write_text("mine")
        return choose(*a, **k)

    monkeypatch.setattr(alpha, "choose_alpha", choose_and_save)
    rc = main(["train", "soup", *runs, "--out", out, "--no-progress", "--overwrite"])
    assert rc == 2 and "files of yours appeared while the soup was made (eval.txt)" in capsys.readouterr().err
    assert (tmp_path / "soup" / "eval.txt").read_text() == "mine"
    monkeypatch.undo()
    monkeypatch.chdir(out)
    rc = main(["train", "soup", *runs, "--out", ".", "--no-progress", "--overwrite"])
    assert rc == 2 and "--out .: the current directory; the soup replaces its directory whole" in \
        capsys.readouterr().err


def test_a_soup_that_fails_while_scoring_leaves_out_as_it_was(tmp_path, monkeypatch):
    """The soup is written beside --out and swapped in only when whole: a crash after the weights are averaged
    (here, in reading the training data again) keeps the previous soup and leaves no half-written folder."""
    import twotower.retrieval.training.train_reranker as trainer

    _run(tmp_path, "a")
    _run(tmp_path, "b", seed=1, dev_seed=0)
    runs, out = [str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "soup")
    soup_rerankers(runs, out, progress=False)
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}

    def crash(cfg):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(trainer, "load_reranker_data", crash)
    with pytest.raises(RuntimeError, match="disk gone"):
        soup_rerankers([runs[0], runs[0]], out, progress=False, overwrite=True)  # other weights, had they been written
    assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "soup"]


def test_a_soup_refuses_a_runs_last_weights_and_records_no_world_size_the_runs_differ_in(tmp_path, capsys):
    """`last/` holds training_args.json since the runs record their world_size there, so `train soup RUN/last`
    was taken for a checkpoint, although last/ was never scored on dev (no weights file, dev_ndcg@10 null). The
    soup copied the first run's world_size, whatever the others' were."""
    import shutil

    from twotower.cli import main

    res = _run(tmp_path, "a", save_last=True)
    rc = main(["train", "soup", str(tmp_path / "a" / "last"), str(tmp_path / "a"), "--out", str(tmp_path / "x"),
               "--no-progress"])
    assert rc == 2 and "a/last: the final weights of a run (--save-last's last/), never scored on dev" in \
        capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")
    shutil.copytree(res.best_dir, tmp_path / "b")  # as if trained on two ranks
    with open(tmp_path / "b" / "training_args.json") as f:
        args = json.load(f)
    with open(tmp_path / "b" / "training_args.json", "w") as f:
        json.dump({**args, "world_size": 2}, f)
    soup = soup_rerankers([res.best_dir, str(tmp_path / "b")], str(tmp_path / "soup"), progress=False)
    with open(os.path.join(soup.directory, "training_args.json")) as f:
        assert json.load(f)["world_size"] is None
