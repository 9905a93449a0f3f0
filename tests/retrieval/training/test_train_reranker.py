"""Reranker training: listwise and pointwise loops, the collapse guard, first-stage input, the demo reranker."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest

from tests.retrieval.training_fixtures import WORDS, tiny_beir_dir, tiny_model_dir
from twotower.retrieval.training.train_reranker import (
    CollapseGuard,
    RerankerTrainConfig,
    ScoreCollapse,
    load_reranker,
    train_reranker,
)


def _cfg(tmp_path, **kw):
    # A wider init than BERT's, so that a fresh head does not score every pair alike (see tiny_model_dir).
    base = dict(model=tiny_model_dir(0.2), pairs=tiny_beir_dir(), out=str(tmp_path / "rr"), group_size=4,
                batch_size=4, max_length=48, lr=2e-3, progress=False, dev_fraction=0.25, dev_rerank_k=10, bf16=False)
    return RerankerTrainConfig(**{**base, **kw})


def _log(out):
    return [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]


def test_listwise_training_writes_the_run(tmp_path):
    res = train_reranker(_cfg(tmp_path, max_steps=4, eval_every=2))
    out = str(tmp_path / "rr")
    assert len([r for r in _log(out) if r["event"] == "step"]) == 4
    assert [r["step"] for r in _log(out) if r["event"] == "eval"] == [0, 2, 4]
    for name in ("best/config.json", "best/training_args.json", "dev_ndcg.png", "summary.json", "negatives.jsonl"):
        assert os.path.exists(os.path.join(out, name)), name
    assert res.stopped_by == "steps" and 0 <= res.first_stage_score <= 1
    # the weight is filed under the first stage it was chosen over (BM25 without a teacher)
    from twotower.retrieval.interpolation import read_alpha, read_first_stage_alphas

    assert read_first_stage_alphas(res.best_dir) == {"bm25": read_alpha(res.best_dir)}
    # The best checkpoint is a reranker directory: training continues from it with its head.
    again = load_reranker(_cfg(tmp_path, model=res.best_dir), device="cpu")
    assert again.classifier.weight.abs().sum() > 0


def test_listwise_loss_falls_on_a_small_training_set(tmp_path):
    """6 training queries, every step sees all of them: the listwise loss must come down."""
    res = train_reranker(_cfg(tmp_path, pairs=tiny_beir_dir(n_docs=30, n_queries=8), dev_size=2, batch_size=6,
                              max_steps=30, eval_every=30, eval_at_start=False))
    losses = [r["loss"] for r in _log(str(tmp_path / "rr")) if r["event"] == "step"]
    assert res.steps == 30 and sum(losses[-5:]) < 0.9 * sum(losses[:5])


def test_pointwise_on_graded_pairs(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "pairs.tsv"
    with open(path, "w") as f:
        f.write("query\tpassage\tlabel\n")
        for _ in range(12):
            q = " ".join(rng.sample(WORDS, 3))
            f.write(f"{q}\t{q} {' '.join(rng.sample(WORDS, 5))}\t2\n")
            f.write(f"{q}\t{' '.join(rng.sample(WORDS, 4))} {q.split()[0]}\t1\n")
            f.write(f"{q}\t{' '.join(rng.sample(WORDS, 6))}\t0\n")
    res = train_reranker(_cfg(tmp_path, pairs=str(path), loss="pointwise", batch_size=6, max_steps=6,
                              eval_every=6, mine=None))
    data = [r for r in _log(str(tmp_path / "rr")) if r["event"] == "data"][0]
    assert data["train_pairs"] == 27 and data["dev_queries"] == 3
    assert res.steps == 6 and res.best_dir


def test_collapse_guard_stops_and_reports(tmp_path):
    res = train_reranker(_cfg(tmp_path, max_steps=50, eval_every=2, collapse_std=1e9))
    assert res.steps == 2 and res.stopped_by.startswith("collapse") and "dev scores collapsed" in res.stopped_by
    res = train_reranker(_cfg(tmp_path, max_steps=50, eval_every=40, collapse_std=1e9, collapse_window=3))
    assert res.steps == 3 and "training logits have been constant" in res.stopped_by
    assert [r for r in _log(str(tmp_path / "rr")) if r["event"] == "stop"]


def test_collapse_guard_reads_eval_and_step_records():
    guard = CollapseGuard(min_std=0.1, window=3)
    guard({"event": "eval", "step": 0, "score_std": 0.0})  # the untrained model may score everything alike
    guard({"event": "eval", "step": 2, "score_std": None})  # dev scored one pair: no spread to lose, no collapse
    with pytest.raises(ScoreCollapse, match="dev scores collapsed to a constant at step 4"):
        guard({"event": "eval", "step": 4, "score_std": 0.05})
    for step, spread in enumerate([0.05, 0.2, 0.05, 0.05], 1):  # the window holds one spread above 0.1
        guard({"event": "step", "step": step, "logit_std": spread})
    with pytest.raises(ScoreCollapse, match="constant for 3 steps .* at step 5") as exc:
        guard({"event": "step", "step": 5, "logit_std": 0.01})
    assert exc.value.kind == "collapse"


def test_same_seed_same_run(tmp_path):
    logs = []
    for name in ("a", "b"):
        train_reranker(_cfg(tmp_path, out=str(tmp_path / name), max_steps=2, eval_every=2))
        logs.append([{k: v for k, v in r.items() if k != "time"} for r in _log(str(tmp_path / name))
                     if r["event"] in ("step", "eval")])
    assert logs[0] == logs[1] and len(logs[0]) == 4  # eval 0, step 1, step 2, eval 2


@pytest.mark.parametrize("trainer", ["reranker", "dual"])
def test_dev_seed_carves_dev_apart_from_the_training_seed(tmp_path, monkeypatch, trainer):
    """dev_seed, not seed, carves dev when given; without it the seed does (runs before dev_seed are unchanged)."""
    from twotower.retrieval.training import training_data as module  # both trainers carve dev through it

    seeds, real = [], module.split_dev

    def spy(examples, fraction, seed, size, by):
        seeds.append(seed)
        return real(examples, fraction, seed, size, by=by)

    monkeypatch.setattr(module, "split_dev", spy)
    for name, kw in (("given", {"dev_seed": 0}), ("not", {})):
        if trainer == "reranker":
            train_reranker(_cfg(tmp_path, out=str(tmp_path / name), seed=3, max_steps=1, eval_every=1,
                                eval_at_start=False, **kw))
        else:
            from twotower.retrieval.training.train_dual import DualTrainConfig, train_dual

            train_dual(DualTrainConfig(model=tiny_model_dir(), data=tiny_beir_dir(), out=str(tmp_path / name),
                                       batch_size=4, doc_max_length=48, progress=False, dev_fraction=0.25,
                                       bf16=False, max_steps=1, eval_every=1, seed=3, **kw))
    assert seeds == [0, 3]


def test_first_stage_run_must_cover_the_dev_queries(tmp_path):
    run = tmp_path / "first.trec"
    run.write_text("q0 Q0 d1 1 3.0 x\n")
    with pytest.raises(ValueError, match="--first-stage .*first.trec: .* dev queries have no first-stage results"):
        train_reranker(_cfg(tmp_path, first_stage=str(run), max_steps=1))
    # labeled pairs name no query ids: the ids in the error were made here, which the message says
    rows = [f"query {i}\tdocument {i} about tea\t1\n" for i in range(12)]
    pairs = tmp_path / "p.tsv"
    pairs.write_text("".join(rows), encoding="utf-8")
    with pytest.raises(ValueError, match="those ids were made from the query texts, as the training data names no "
                                         "query ids"):
        train_reranker(_cfg(tmp_path, pairs=str(pairs), first_stage=str(run), max_steps=1, group_size=2,
                            batch_size=2, mine=None))


def test_mean_pooled_head_trains_and_is_kept(tmp_path):
    """head_pooling="mean": the checkpoint scores from the token mean, continues with that head, and the
    classifier (the whole head: there is no pooler) learns at head_lr_scale x lr."""
    from twotower.retrieval.training.train_reranker import make_head_optimizer

    res = train_reranker(_cfg(tmp_path, head_pooling="mean", max_steps=3, eval_every=3))
    assert res.stopped_by == "steps"
    cfg = json.load(open(os.path.join(res.best_dir, "config.json")))
    assert cfg["classifier_pooling"] == "mean"
    again = load_reranker(_cfg(tmp_path, model=res.best_dir), device="cpu")  # head_pooling "cls" is for fresh heads
    assert again.model.pooling == "mean" and again.bert.pooler is None
    opt = make_head_optimizer(again, 1e-4, 0.01, 10.0)
    head = {id(p) for p in again.classifier.parameters()}
    assert {g["lr"] for g in opt.param_groups if any(id(p) in head for p in g["params"])} == {1e-3}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(again.parameters()))


def test_trainable_layers_train_only_the_top_layers_and_the_head(tmp_path):
    """trainable_layers=1: the embeddings and every layer below the top one end as they started."""
    import torch
    from safetensors.torch import load_file

    start = tiny_model_dir(0.2)
    res = train_reranker(_cfg(tmp_path, trainable_layers=1, max_steps=3, eval_every=3, eval_at_start=False))
    before = load_file(os.path.join(start, "model.safetensors"))
    after = {k.removeprefix("bert."): v for k, v in load_file(os.path.join(res.best_dir, "model.safetensors")).items()}
    top = max(int(k.split(".")[2]) for k in after if k.startswith("encoder.layer."))
    changed = {k for k, v in before.items() if k in after and not torch.equal(v, after[k])}
    assert changed and all(k.startswith(f"encoder.layer.{top}.") or k.startswith("pooler.") for k in changed)
    assert any(k.startswith(f"encoder.layer.{top}.") for k in changed)
    with pytest.raises(ValueError, match="trainable_layers=9, but the model has"):
        train_reranker(_cfg(tmp_path, trainable_layers=9, max_steps=1))


def test_bad_config():
    with pytest.raises(ValueError, match="loss"):
        RerankerTrainConfig(model="m", pairs="p", out="o", loss="hinge")
    with pytest.raises(ValueError, match="head_pooling='max'"):
        RerankerTrainConfig(model="m", pairs="p", out="o", head_pooling="max")
    with pytest.raises(ValueError, match="group_size"):
        RerankerTrainConfig(model="m", pairs="p", out="o", group_size=1)
    # 0 was read as "the model's maximum" by the cross-encoder
    with pytest.raises(ValueError, match=re.escape("max_length=0: give 8 or more (--max-length)")):
        RerankerTrainConfig(model="m", pairs="p", out="o", max_length=0)
    # NaN passed `< 0` and turned distillation off without a word (and wrote NaN, not JSON, to the log)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=r"give a number, 0 or more \(--distill-weight\)"):
            RerankerTrainConfig(model="m", pairs="p", out="o", distill_weight=bad)


def _titled_corpus(tmp_path, n=60):
    rng = random.Random(1)
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            title = " ".join(rng.sample(WORDS, 4))
            f.write(json.dumps({"_id": f"d{i}", "title": title,
                                "text": title + " " + " ".join(rng.sample(WORDS, 10))}) + "\n")
    return str(path)


def test_title_pairs_count_and_report_titles_bm25_cannot_match(tmp_path, caplog):
    """A title of numbers matches no text: it gives no pair, the skip is counted in a warning, and a corpus
    where no title matches is refused naming the file."""
    from twotower.retrieval.training.demo_reranker import title_abstract_pairs

    docs = [json.loads(x) for x in open(_titled_corpus(tmp_path))]
    for d in docs[:10]:
        d["title"] = f"{1000 + int(d['_id'][1:])}"
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(d) + "\n" for d in docs))
    with caplog.at_level("WARNING", logger="twotower.retrieval.training.demo_reranker"):
        n = title_abstract_pairs(str(mixed), str(tmp_path / "pairs.jsonl"), queries=len(docs))
    assert n == 50 and len(open(tmp_path / "pairs.jsonl").readlines()) == 50
    assert f"{mixed}: 10 of 60 titles gave no title/text pair" in caplog.text
    for d in docs:
        d["title"] = f"{1000 + int(d['_id'][1:])}"
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("".join(json.dumps(d) + "\n" for d in docs))
    with pytest.raises(ValueError, match=f"{numbers}: none of 60 titles has a negative among BM25's ranks 2-30"):
        title_abstract_pairs(str(numbers), str(tmp_path / "none.jsonl"), queries=len(docs))
    assert not os.path.exists(tmp_path / "none.jsonl")  # nothing written


def test_demo_reranker_trains_once_then_is_cached(tmp_path, monkeypatch):
    from twotower.retrieval.training import demo_reranker

    corpus = _titled_corpus(tmp_path)
    out = str(tmp_path / "demo")
    path = demo_reranker.train_demo_reranker(out, model=tiny_model_dir(0.2), corpus=corpus, steps=2, layers=2,
                                             progress=False)
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    assert json.load(open(os.path.join(out, "start", "config.json")))["num_hidden_layers"] == 2
    pairs = [json.loads(x) for x in open(os.path.join(out, "title_abstract_pairs.jsonl"))]
    assert pairs and all(p["neg"] and p["pos"][0] not in p["neg"] for p in pairs)
    monkeypatch.setattr("twotower.retrieval.training.train_reranker.train_reranker", lambda cfg: pytest.fail("retrained"))
    assert demo_reranker.train_demo_reranker(out, model=tiny_model_dir(0.2), corpus=corpus, steps=2, layers=2,
                                             progress=False) == path


def test_demo_reranker_out_holding_a_soup_or_another_run_is_refused(tmp_path, capsys):
    """--out was trained into whatever it held: a finished `train soup` reranker became a mix of two models, and
    a `train reranker` run lost its best/ checkpoint."""
    from twotower.cli import main

    corpus = _titled_corpus(tmp_path)
    soup = tmp_path / "soup"
    soup.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (soup / name).write_text("{}")
    (soup / "training_args.json").write_text(json.dumps({"soup_of": ["a/best", "b/best"]}))
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    (run / "train_log.jsonl").write_text("")
    (tmp_path / "notes.txt").write_text("keep")
    flags = ["--model", tiny_model_dir(0.2), "--corpus", corpus, "--claims", "none", "--titles", "20", "--steps", "1",
             "--layers", "1", "--no-progress"]
    for out, shown in ((soup, "config.json, model.safetensors, tokenizer.json and 1 more"), (run, "best, train_log.jsonl")):
        before = sorted(os.listdir(out))
        rc = main(["train", "demo-reranker", "--out", str(out), *flags])
        assert rc == 2 and (f"--out {out}: a directory holding other files ({shown}), not a demo-reranker run; give "
                            "a new or empty directory") in capsys.readouterr().err
        assert sorted(os.listdir(out)) == before
    rc = main(["train", "demo-reranker", "--out", str(tmp_path / "notes.txt"), *flags])
    assert rc == 2 and "is a file; give a directory" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "keep"


def test_a_demo_run_that_keeps_no_checkpoint_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """A collapse that left no checkpoint was a RuntimeError traceback; `train reranker` ends such a run with
    status 1 and says so, and the demo command now does the same."""
    import types

    from twotower.cli import main
    from twotower.retrieval.training import train_reranker as trainer

    monkeypatch.setattr(trainer, "train_reranker", lambda cfg: types.SimpleNamespace(
        best_dir=None, stopped_by="collapse: dev scores constant"))
    out = tmp_path / "demo"
    rc = main(["train", "demo-reranker", "--out", str(out), "--model", tiny_model_dir(0.2), "--corpus",
               _titled_corpus(tmp_path), "--claims", "none", "--titles", "20", "--steps", "1", "--layers", "1",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "training kept no checkpoint (collapse: dev scores constant)" in err and "Traceback" not in err


def test_an_interrupted_demo_run_is_its_own_and_trained_again(tmp_path, monkeypatch):
    """The marker is written when a run starts, so an interrupted run's directory is known as the demo's own
    (not refused as foreign) and, unfinished, is trained again rather than reused."""
    from twotower.retrieval.training import demo_reranker
    from twotower.retrieval.training import train_reranker as trainer

    corpus = _titled_corpus(tmp_path)
    out = str(tmp_path / "demo")
    kw = dict(model=tiny_model_dir(0.2), corpus=corpus, claims=None, titles=20, steps=1, layers=1, progress=False)
    real = trainer.train_reranker

    def interrupted(cfg):
        os.makedirs(os.path.join(cfg.out, "best"))  # as far as a first evaluation gets
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train_reranker", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo_reranker.train_demo_reranker(out, **kw)
    assert json.load(open(os.path.join(out, demo_reranker.MARKER)))["finished"] is False
    calls = []
    monkeypatch.setattr(trainer, "train_reranker", lambda cfg: calls.append(cfg) or real(cfg))
    path = demo_reranker.train_demo_reranker(out, **kw)
    assert len(calls) == 1 and os.path.isfile(os.path.join(path, "model.safetensors"))
    assert json.load(open(os.path.join(out, demo_reranker.MARKER)))["finished"] is True
    assert demo_reranker.train_demo_reranker(out, **kw) == path and len(calls) == 1  # finished: reused


def test_demo_reranker_titles_sets_how_many_title_pairs_and_is_part_of_the_cache_key(tmp_path, monkeypatch):
    from twotower.retrieval.training import demo_reranker

    corpus = _titled_corpus(tmp_path)
    out = str(tmp_path / "demo")
    kw = dict(model=tiny_model_dir(0.2), corpus=corpus, claims=None, steps=1, layers=1, progress=False)
    demo_reranker.train_demo_reranker(out, titles=20, **kw)
    pairs = [json.loads(x) for x in open(os.path.join(out, "title_abstract_pairs.jsonl"))]
    assert len(pairs) == 20 and len({p["query_id"] for p in pairs}) == 20
    assert json.load(open(os.path.join(out, demo_reranker.MARKER)))["settings"]["titles"] == 20
    demo_reranker.train_demo_reranker(out, titles=30, **kw)  # another count: trained again, not the cache
    assert len(open(os.path.join(out, "title_abstract_pairs.jsonl")).readlines()) == 30
    demo_reranker.train_demo_reranker(out, titles=30, dev_seed=1, **kw)  # another dev split: trained again
    settings = json.load(open(os.path.join(out, demo_reranker.MARKER)))["settings"]
    assert settings["dev_seed"] == 1 and json.load(open(os.path.join(out, "best", "training_args.json")))["dev_seed"] == 1


def test_demo_reranker_with_a_teacher_chooses_on_its_ranking_and_keys_the_cache_by_it(tmp_path):
    """With a teacher and no first stage, dev reranks the teacher's ranking, and the cache key says so: an
    explicit BM25 first stage is another run, trained again, not a cached one chosen over something else."""
    from twotower.retrieval.training import demo_reranker

    corpus = _titled_corpus(tmp_path)
    out = str(tmp_path / "demo")
    kw = dict(model=tiny_model_dir(0.2), corpus=corpus, claims=None, titles=20, steps=1, layers=1, progress=False,
              teacher=tiny_model_dir(), distill_weight=0.0)
    for first_stage, want in ((None, "dense"), ("bm25", "bm25"), ("dense", "dense")):
        demo_reranker.train_demo_reranker(out, first_stage=first_stage, **kw)
        assert json.load(open(os.path.join(out, demo_reranker.MARKER)))["settings"]["first_stage"] == want
        assert [r["source"] for r in _log(out) if r["event"] == "first_stage"][-1] == want


def test_demo_reranker_trains_on_labeled_claims(tmp_path):
    """With a claims file the demo reranker learns from (claim, evidence id) pairs, negatives mined by BM25."""
    import gzip

    from twotower.retrieval.training import demo_reranker

    corpus = _titled_corpus(tmp_path)
    docs = [json.loads(x) for x in open(corpus)]
    claims = tmp_path / "claims.jsonl.gz"
    with gzip.open(claims, "wt", encoding="utf-8") as f:
        for d in docs[:40]:
            f.write(json.dumps({"query_id": f"q{d['_id']}", "query": d["title"], "pos": [d["_id"]]}) + "\n")
    out = str(tmp_path / "demo")
    path = demo_reranker.train_demo_reranker(out, model=tiny_model_dir(0.2), corpus=corpus, claims=str(claims),
                                             steps=5, layers=2, progress=False)
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    # The trainer stores the rerank/first-stage weight it chose on dev with the checkpoint, and loading uses it.
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.interpolation import read_alpha
    from twotower.retrieval.training.alpha import ALPHA_GRID

    alpha = read_alpha(path)
    assert alpha in ALPHA_GRID and CrossEncoder.from_pretrained(path, bf16=False).interpolation == alpha
    evals = [e for e in (json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))) if e["event"] == "eval"]
    assert all(e["interpolation_alpha"] in ALPHA_GRID for e in evals)
    assert [e["step"] for e in evals] == [3, 5]  # two dev passes, the last at the end (none at 4 and again at 5)
    marker = json.load(open(os.path.join(out, demo_reranker.MARKER)))
    assert marker["settings"]["claims"] == str(claims) and marker["settings"]["steps"] == 5
    assert not os.path.exists(os.path.join(out, "title_abstract_pairs.jsonl"))
    log = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]
    data = next(e for e in log if e["event"] == "data")
    assert data["train_queries"] + data["dev_queries"] == 40


def test_bundled_claims_point_into_the_bundled_sample():
    """Every evidence id of the shipped train claims is a document of the shipped sample (nothing skipped)."""
    from twotower.retrieval.training.demo_reranker import BUNDLED_CLAIMS, BUNDLED_CORPUS
    from twotower.retrieval.training.training_data import read_training

    data = read_training(BUNDLED_CLAIMS, corpus_path=BUNDLED_CORPUS)
    assert len(data.examples) == 809 and not data.skipped
    assert all(e.positives for e in data.examples)


def test_cli_reranker_and_pairs(tmp_path, capsys):
    from twotower.cli import main

    rc = main(["train", "reranker", "--model", tiny_model_dir(), "--pairs", str(tmp_path / "nope.tsv"),
               "--out", str(tmp_path / "o")])
    assert rc == 2 and "not found" in capsys.readouterr().err
    rc = main(["train", "pairs", "--corpus", os.path.join(tiny_beir_dir(), "corpus.jsonl"), "--method", "crop",
               "--out", str(tmp_path / "crops.jsonl")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["pairs"] + sum(out["skipped"].values()) == 60 and out["pairs"] > 0
    rc = main(["train", "mine", "--data", tiny_beir_dir(), "--out", str(tmp_path / "neg.jsonl"), "--ranks", "2-10",
               "--num-negatives", "3", "--no-progress"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["queries"] == 24
    # ranks past the corpus do not exist (a MemoryError allocating results of that depth); the same negatives
    runs = {}
    for ranks in ("2-60", "2-1000000000000"):  # the corpus holds 60 documents
        rc = main(["train", "mine", "--data", tiny_beir_dir(), "--out", str(tmp_path / f"{ranks}.jsonl"), "--ranks",
                   ranks, "--num-negatives", "3", "--no-progress"])
        assert rc == 0, capsys.readouterr().err
        runs[ranks] = (tmp_path / f"{ranks}.jsonl").read_text()
    assert runs["2-60"] == runs["2-1000000000000"]
    capsys.readouterr()
    rc = main(["train", "mine", "--data", tiny_beir_dir(), "--out", str(tmp_path / "n.jsonl"), "--ranks", "10"])
    assert rc == 2 and "START-END" in capsys.readouterr().err
    # an output that is an input: the corpus (or the queries) was replaced by what was made from it
    import shutil

    data = shutil.copytree(tiny_beir_dir(), tmp_path / "beir")
    before = {p.name: p.read_bytes() for p in data.rglob("*") if p.is_file()}
    for argv, named in ((["mine", "--data", str(data), "--out", str(data / "corpus.jsonl")], f"--data {data}"),
                        (["mine", "--data", str(data), "--out", str(data / "queries.jsonl")], f"--data {data}"),
                        (["pairs", "--corpus", str(data / "corpus.jsonl"), "--out", str(data / "corpus.jsonl")],
                         f"--corpus {data / 'corpus.jsonl'}")):
        assert main(["train", *argv, "--no-progress"] if argv[0] == "mine" else ["train", *argv]) == 2
        assert f"that is the input {named} reads; give another file" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in data.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("argv, message", [
    (["mine", "--ranks", "0-5"], "--ranks 0-5: ranks count from 1 and START must not exceed END"),
    (["mine", "--ranks", "9-3"], "--ranks 9-3: ranks count from 1"),
    (["mine", "--num-negatives", "-1"], "--num-negatives must be >= 0, got -1"),
    (["mine", "--random", "-2"], "--random must be >= 0, got -2"),
    (["mine", "--max-ratio", "0"], "--max-ratio must be a number > 0, got 0"),
    (["mine", "--margin", "nan"], "--margin must be a number, got nan"),
    (["reranker", "--mine-ranks", "x"], "--mine-ranks 'x': expected START-END"),  # it said --ranks
    (["reranker", "--mine-ranks", "0-9"], "--mine-ranks 0-9: ranks count from 1"),
    (["dual", "--mine-ranks", "5-1"], "--mine-ranks 5-1: ranks count from 1"),
    # flags that nothing would read were ignored silently
    (["reranker", "--mine", "none", "--mine-ranks", "2-20"], "but --mine none mines nothing: drop --mine-ranks"),
    (["dual", "--negatives", "n.jsonl", "--mine-ranks", "2-20"], "but --negatives FILE gives them: drop --mine-ranks"),
    (["reranker", "--loss", "pointwise", "--mine-ranks", "2-20"], "--loss pointwise trains on the labeled pairs alone"),
    (["reranker", "--split", "dev"], "--split dev picks a qrels split of a BEIR directory, but --pairs"),
    (["dual", "--split", "test"], "but --data"),
    (["mine", "--split", "test"], "is a file (a file of pairs has no splits): drop --split"),
    # wrote a file of queries without negatives; named a model in its settings that BM25 never used
    (["mine", "--num-negatives", "0"], "--num-negatives 0 and --random 0 leave nothing to mine"),
    (["mine", "--model", "m"], "--model is the dense retriever's: add --retriever dense, or leave --model out"),
    (["mine", "--retriever", "dense", "--model", "nowhere"], "--model nowhere: no such directory"),
    # named by the readers, without the flag ("training data not found", "mined negatives file not found")
    (["mine"], "--data {missing}: not found; give a BEIR directory or a .jsonl(.gz) file"),
    (["reranker", "--negatives", "{missing}.jsonl"], "--negatives {missing}.jsonl: file not found"),
    (["dual", "--corpus", "{missing}.jsonl"], "--corpus {missing}.jsonl: file not found"),
])
def test_cli_mining_flags_are_refused_in_their_own_words(tmp_path, capsys, argv, message):
    """Each bad mining flag is named as typed, before any data or model loads (the config's field names were
    shown: 'rank window 0-5', 'num_negatives and num_random', 'max_ratio')."""
    from twotower.cli import main

    data = {"mine": [], "reranker": ["--model", str(tmp_path / "none"), "--pairs"],
            "dual": ["--model", str(tmp_path / "none"), "--data"]}[argv[0]]
    source = str(tmp_path / "missing")
    if "--split" in argv:  # --split needs an existing file to be refused for
        source = str(tmp_path / "pairs.jsonl")
        (tmp_path / "pairs.jsonl").write_text('{"query": "q", "pos": ["a"]}\n')
    args = (["train", "mine", "--data", source, "--out", str(tmp_path / "n.jsonl")]
            if argv[0] == "mine" else ["train", argv[0], *data, source, "--out", str(tmp_path / "o")])
    if "--negatives" in argv or "--corpus" in argv:  # the model and the data are there; the other input is not
        source = str(tmp_path / "pairs.jsonl")
        (tmp_path / "pairs.jsonl").write_text('{"query": "q", "pos": ["a"]}\n')
        data = ["--model", tiny_model_dir(), "--pairs" if argv[0] == "reranker" else "--data"]
        args = ["train", argv[0], *data, source, "--out", str(tmp_path / "o")]
    missing = str(tmp_path / "missing")
    rc = main([*args, *[a.format(missing=missing) for a in argv[1:]]])
    assert rc == 2 and message.format(missing=missing) in capsys.readouterr().err


@pytest.mark.parametrize("command", ["reranker", "dual"])
def test_cli_an_out_holding_a_run_is_refused_unless_overwrite(tmp_path, capsys, command):
    """A second run into the same --out used to replace its best/ at the first evaluation."""
    from twotower.cli import main

    out = tmp_path / "o"
    args = ["train", command, "--model", tiny_model_dir(0.2), "--pairs" if command == "reranker" else "--data",
            tiny_beir_dir(), "--out", str(out), "--dry-run", "--no-progress", "--batch-size", "4", "--no-bf16",
            *(["--group-size", "4", "--max-length", "48", "--dev-rerank-k", "10"] if command == "reranker" else [])]
    assert main(args) == 0
    capsys.readouterr()
    best = {f: (out / "best" / f).read_bytes() for f in os.listdir(out / "best") if (out / "best" / f).is_file()}
    assert main([*args, "--seed", "7"]) == 2
    assert f"--out {out} already holds a trained checkpoint ({out / 'best'}); pass --overwrite" in \
        capsys.readouterr().err
    assert {f: (out / "best" / f).read_bytes() for f in best} == best  # untouched
    assert main([*args, "--seed", "7", "--overwrite"]) == 0


class Killed(BaseException):
    """Stands for a kill of the run at one point (nothing the CLI catches)."""


def _tree(out) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, n), out): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(out) for n in names}


@pytest.mark.parametrize("command", ["reranker", "dual"])
def test_cli_an_overwrite_run_is_swapped_in_only_once_complete(tmp_path, capsys, monkeypatch, command):
    """`--overwrite` wrote into the earlier run as it went: a kill left the new run's best/ beside the earlier
    run's summary.json and last/. Now a stopped run leaves the earlier one as it was; a complete one replaces it
    whole (no earlier last/), its summary naming OUT/best."""
    from twotower.cli import main
    from twotower.retrieval.training.training_run import TrainingRun

    out = tmp_path / "o"
    args = ["train", command, "--model", tiny_model_dir(0.2), "--pairs" if command == "reranker" else "--data",
            tiny_beir_dir(), "--out", str(out), "--dry-run", "--no-progress", "--batch-size", "4", "--no-bf16",
            *(["--group-size", "4", "--max-length", "48", "--dev-rerank-k", "10"] if command == "reranker" else [])]
    assert main([*args, "--save-last"]) == 0
    before = _tree(out)

    def killed(self, summary):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(TrainingRun, "finish", killed)
        with pytest.raises(Killed):
            main([*args, "--seed", "7", "--overwrite", "--save-last"])
    assert _tree(out) == before
    capsys.readouterr()
    assert main([*args, "--seed", "7", "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["best"] == str(out / "best")
    after = _tree(out)
    assert not any(name.startswith("last") for name in after) and "train_log.jsonl.previous" in after
    assert json.loads(after["summary.json"])["best_dir"] == str(out / "best")
    assert json.loads(after[os.path.join("best", "training_args.json")])["seed"] == 7
    assert sorted(os.listdir(tmp_path)) == ["o"]


@pytest.mark.parametrize("command, bad", [
    ("dual", "data"), ("dual", "negatives"), ("reranker", "data"), ("reranker", "negatives"),
    ("reranker", "first-stage"),
])
def test_cli_a_start_that_fails_on_bad_input_leaves_the_earlier_run_as_it_was(tmp_path, capsys, command, bad):
    """--overwrite with a malformed input failed after the earlier run's train_log.jsonl had been moved to
    train_log.jsonl.previous (and mining had replaced its negatives.jsonl): the inputs are now read and
    checked before anything in --out is touched."""
    from twotower.cli import main

    out = tmp_path / "o"
    args = ["train", command, "--model", tiny_model_dir(0.2), "--pairs" if command == "reranker" else "--data",
            tiny_beir_dir(), "--out", str(out), "--dry-run", "--no-progress", "--batch-size", "4", "--no-bf16",
            *(["--group-size", "4", "--max-length", "48", "--dev-rerank-k", "10"] if command == "reranker" else [])]
    assert main(args) == 0
    capsys.readouterr()
    before = {os.path.relpath(os.path.join(d, n), out): open(os.path.join(d, n), "rb").read()
              for d, _, names in os.walk(out) for n in names}
    assert "negatives.jsonl" in before  # mined by BM25: the file a second run's mining would replace
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"query": "tea", "pos": ["d1"]}\n{"query": \n', encoding="utf-8")
    if bad == "data":
        args[args.index("--pairs" if command == "reranker" else "--data") + 1] = str(malformed)
        args += ["--corpus", os.path.join(tiny_beir_dir(), "corpus.jsonl")]
        message = f"{malformed}:2: "
    elif bad == "negatives":
        malformed.write_text('{"query_id": "q1", "neg_ids": ["d2"]}\n{"query_id": \n', encoding="utf-8")
        args += ["--negatives", str(malformed)]
        message = f"{malformed}:2: "
    else:
        run = tmp_path / "first.trec"
        run.write_text("nobody Q0 d1 1 1.0 x\n", encoding="utf-8")
        args += ["--first-stage", str(run)]
        message = f"--first-stage {run}: "
    assert main([*args, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    after = {os.path.relpath(os.path.join(d, n), out): open(os.path.join(d, n), "rb").read()
             for d, _, names in os.walk(out) for n in names}
    assert after == before  # no train_log.jsonl.previous, no new negatives.jsonl


def test_cli_head_pooling_mean_reaches_the_checkpoint(tmp_path, capsys):
    from twotower.cli import main

    out = tmp_path / "rr"
    rc = main(["train", "reranker", "--model", tiny_model_dir(0.2), "--pairs", tiny_beir_dir(), "--out", str(out),
               "--group-size", "4", "--max-length", "48", "--lr", "2e-3", "--max-steps", "2", "--eval-every", "2",
               "--dev-fraction", "0.25", "--dev-rerank-k", "10", "--no-bf16", "--no-progress", "--head-pooling", "mean"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["steps"] == 2 and res["first_stage"] == "bm25"  # no --teacher: dev reranked BM25's
    assert json.load(open(os.path.join(res["best"], "config.json")))["classifier_pooling"] == "mean"


@pytest.mark.parametrize("flags, message", [
    (["--passage-stride", "3"], "--passage-stride sets the step between windows: add --passage-window"),
    (["--passage-window", "0"], "--passage-window 0: give a positive number"),
    (["--passage-window", "4", "--passage-stride", "5"], "--passage-stride 5: give 1 to --passage-window"),
    (["--passage-window", "46"], "--passage-window"),  # no room beside the query in --max-length 48
    (["--window-choice", "bm25"], "--window-choice bm25 picks a window of each document: add --passage-window"),
    (["--dev-rerank-k", "0"], "dev_rerank_k=0: give a positive number of first-stage candidates (--dev-rerank-k)"),
])
def test_cli_window_and_dev_flags_are_checked(tmp_path, capsys, flags, message):
    from twotower.cli import main

    rc = main(["train", "reranker", "--model", tiny_model_dir(0.2), "--pairs", tiny_beir_dir(), "--out",
               str(tmp_path / "rr"), "--max-length", "48", "--max-steps", "1", "--no-progress", *flags])
    assert rc == 2 and message in capsys.readouterr().err


def test_training_continues_the_shipped_reranker(tmp_path, capsys):
    """--model default starts from the shipped reranker (its weights and head), and its checkpoints stand alone."""
    from twotower.cli import main
    from twotower.retrieval import default_reranker
    from twotower.retrieval.cross_encoder import CrossEncoder

    pairs = [("a claim about cells", "cells divide by mitosis"), ("a claim about cells", "rivers flow to the sea")]
    shipped = default_reranker.load(device="cpu", bf16=False, max_length=128).predict(pairs)
    start = load_reranker(_cfg(tmp_path, model="default", max_length=128), device="cpu")
    np.testing.assert_allclose(start.predict(pairs), shipped, atol=1e-5)
    with pytest.raises(ValueError, match=r"config.json: this reranker reads documents as windows of 96 tokens "
                                         r"\(rerank_windows\), which needs a max_length \(--max-length\) of at least 99"):
        load_reranker(_cfg(tmp_path, model="default", max_length=64), device="cpu")  # too short for its windows
    res = train_reranker(_cfg(tmp_path, model="default", max_length=128, lr=1e-5, max_steps=2, eval_every=2))
    assert res.steps == 2 and res.best_dir and np.isfinite(res.initial_score)
    reloaded = CrossEncoder.from_pretrained(res.best_dir, bf16=False).predict(pairs)  # tokenizer and head saved
    assert reloaded.shape == (2,) and np.isfinite(reloaded).all()
    rc = main(["train", "reranker", "--model", str(tmp_path / "nope"), "--pairs", tiny_beir_dir(),
               "--out", str(tmp_path / "o")])
    assert rc == 2 and "--model" in capsys.readouterr().err


def test_cli_refuses_a_reranker_as_teacher_and_takes_an_encoder_as_model(tmp_path, capsys):
    """--teacher is a dual encoder: a cross-encoder directory is refused by name, before any work (it used to
    be read as a dual encoder, its head dropped, and rank at random); --model may be either."""
    from twotower.cli import main
    from twotower.retrieval.cross_encoder import CrossEncoder

    ce = str(tmp_path / "ce")
    CrossEncoder.from_encoder(tiny_model_dir(), bf16=False, device="cpu").save_pretrained(ce)
    for sub in ("reranker", "demo-reranker"):
        data = ["--pairs", tiny_beir_dir(), "--model", tiny_model_dir()] if sub == "reranker" else []
        rc = main(["train", sub, *data, "--teacher", ce, "--out", str(tmp_path / sub)])
        assert rc == 2 and f"--teacher {ce}: a reranker (cross-encoder), which scores" in capsys.readouterr().err
    rc = main(["train", "reranker", "--model", tiny_model_dir(0.2), "--pairs", tiny_beir_dir(), "--out",
               str(tmp_path / "o"), "--group-size", "4", "--max-length", "48", "--max-steps", "1", "--eval-every", "1",
               "--dev-fraction", "0.25", "--dev-rerank-k", "10", "--no-bf16", "--no-progress"])
    assert rc == 0


def test_dense_mining_and_first_stage_need_a_teacher(tmp_path):
    with pytest.raises(ValueError, match="rank with the teacher: give teacher"):
        _cfg(tmp_path, mine="dense")
    with pytest.raises(ValueError, match="rank with the teacher"):
        _cfg(tmp_path, first_stage="dense")


def test_dev_first_stage_defaults_to_the_teachers_ranking(tmp_path):
    """Without --first-stage, dev reranks the teacher's ranking when there is a teacher (what searches over a
    dense index rerank), else BM25's; an explicit choice stands; a run file that is not there is refused first."""
    assert _cfg(tmp_path).first_stage == "bm25"
    teacher = tiny_model_dir()
    assert _cfg(tmp_path, teacher=teacher).first_stage == "dense"
    assert _cfg(tmp_path, teacher=teacher, first_stage="bm25").first_stage == "bm25"
    missing = str(tmp_path / "dev.trec")
    with pytest.raises(ValueError, match=r"first_stage='.*dev.trec': no such file; .*\(--first-stage\)"):
        _cfg(tmp_path, first_stage=missing)


def test_teacher_logits_are_scaled_inner_products(tmp_path):
    from twotower.retrieval.dual_encoder import DualEncoder
    from twotower.retrieval.training.train_reranker import Teacher
    from twotower.retrieval.training.training_data import TrainExample

    model = tiny_model_dir()
    corpus = {"a": "alpha beta gamma", "b": "delta epsilon", "c": "gamma delta alpha beta"}
    teacher = Teacher(_cfg(tmp_path, teacher=model, teacher_scale=5.0), corpus, device="cpu")
    train = [TrainExample("q0", "alpha gamma", ("a",)), TrainExample("q1", "epsilon", ("b",))]
    teacher.embed_queries(train)
    got = teacher.logits([(1, ["b", "c", "a"]), (0, ["a", "b", "c"])])  # (2, 3)
    dual = DualEncoder.from_pretrained(model, bf16=False)  # the teacher runs in the run's precision (fp32)
    q = dual.encode_queries(["epsilon", "alpha gamma"])  # (2, H)
    d = dual.encode_documents([corpus["b"], corpus["c"], corpus["a"]])  # (3, H) in group 0's order
    order = [[0, 1, 2], [2, 0, 1]]  # group 1's documents a, b, c as rows of d
    want = np.stack([5.0 * d[order[g]] @ q[g] for g in range(2)])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_teacher_bm25_adds_calibrated_bm25_scores(tmp_path):
    from twotower.indexing.bm25 import BM25
    from twotower.retrieval.training.train_reranker import Teacher
    from twotower.retrieval.training.training_data import TrainExample

    model = tiny_model_dir()
    corpus = {"a": "alpha beta gamma", "b": "delta epsilon", "c": "gamma delta alpha beta", "d": "epsilon zeta"}
    train = [TrainExample("q0", "alpha gamma", ("a",), ("b", "c")), TrainExample("q1", "epsilon", ("b",), ("c", "d"))]
    dense = Teacher(_cfg(tmp_path, teacher=model), corpus, device="cpu")
    dense.embed_queries(train)
    mixed = Teacher(_cfg(tmp_path, teacher=model, teacher_bm25=0.5), corpus, device="cpu")
    mixed.embed_queries(train)
    bm = BM25()
    bm.add(list(corpus), list(corpus.values()))
    # calibration: the scaled BM25 scores spread over the training candidates as much as the dense logits do
    cands = [["a", "b", "c"], ["b", "c", "d"]]
    dense_std = np.mean([np.std(dense.logits([(i, c)]).numpy()) for i, c in enumerate(cands)])
    bm25_std = np.mean([np.std(bm.score(e.query, c)) for e, c in zip(train, cands)])
    assert mixed.bm25_scale == pytest.approx(dense_std / bm25_std, rel=1e-5)
    groups = [(1, ["d", "a", "b"]), (0, ["c", "a", "d"])]
    want = dense.logits(groups).numpy() + 0.5 * mixed.bm25_scale * np.stack(
        [bm.score(train[i].query, docs) for i, docs in groups])
    np.testing.assert_allclose(mixed.logits(groups).numpy(), want, rtol=1e-5, atol=1e-5)
    assert (want != dense.logits(groups).numpy()).any()
    with pytest.raises(ValueError, match="teacher_bm25 adds BM25"):
        _cfg(tmp_path, teacher_bm25=1.0)


def test_teacher_from_an_index_uses_its_vectors_and_names_what_does_not_match(tmp_path):
    from twotower.retrieval.pipeline import SearchPipeline
    from twotower.retrieval.training.train_reranker import Teacher
    from twotower.retrieval.training.training_data import TrainExample

    model = tiny_model_dir()
    corpus = {"a": "alpha beta gamma", "b": "delta epsilon", "c": "gamma delta alpha beta"}
    index = str(tmp_path / "index")
    SearchPipeline.build([{"id": k, "title": "", "text": v} for k, v in corpus.items()], index, model,
                         progress=False, bf16=False).close()
    train = [TrainExample("q0", "alpha gamma", ("a",)), TrainExample("q1", "epsilon", ("b",))]
    groups = [(1, ["b", "c", "a"]), (0, ["a", "b", "c"])]
    got = {}
    for name, source in (("index", index), ("model", model)):
        teacher = Teacher(_cfg(tmp_path, teacher=source), corpus, device="cpu")
        teacher.embed_queries(train)
        got[name] = teacher.logits(groups).numpy()
        assert [d for d, _ in teacher.dense(["epsilon"], 3)[0]][0] == "b"
    np.testing.assert_allclose(got["index"], got["model"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"--teacher .*index: document 'd' of the training corpus is not in the index"):
        Teacher(_cfg(tmp_path, teacher=index), {**corpus, "d": "zeta"}, device="cpu")
    with pytest.raises(ValueError, match="document 'b' differs from the index's copy"):
        Teacher(_cfg(tmp_path, teacher=index), {**corpus, "b": "delta epsilon zeta"}, device="cpu")
    from twotower.retrieval.training.training_data import text_id  # labeled pairs given as text get such ids

    with pytest.raises(ValueError, match=r"--teacher .*index: the training documents are given as text, without "
                                         r"the ids of the index's corpus.*give the dual encoder's directory"):
        Teacher(_cfg(tmp_path, teacher=index), {text_id("zeta eta"): "zeta eta"}, device="cpu")


def test_distillation_run_mines_densely_and_ends_nearer_the_teacher(tmp_path):
    """The same run with and without the distillation term: the distilled reranker's softmax over each
    training query's teacher top 4 is nearer the teacher's (lower KL) than the labels-only reranker's."""
    import torch

    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.training.losses import listwise_kl
    from twotower.retrieval.training.train_reranker import Teacher, load_reranker_data

    teacher_dir, beir = tiny_model_dir(), tiny_beir_dir(n_docs=30, n_queries=8)
    kls = {}
    for weight in (0.0, 100.0):  # 100: the labels hardly count
        cfg = _cfg(tmp_path, out=str(tmp_path / f"w{weight}"), pairs=beir, dev_size=2, batch_size=6, max_steps=60,
                   eval_every=60, eval_at_start=False, teacher=teacher_dir, mine="dense",
                   distill_weight=weight)  # no first_stage: the teacher's ranking by default
        res = train_reranker(cfg)
        log = _log(cfg.out)
        assert [r["retriever"] for r in log if r["event"] == "mining"] == ["dense"]
        assert [r["source"] for r in log if r["event"] == "first_stage"] == ["dense"]
        with open(os.path.join(cfg.out, "negatives.jsonl.meta.json")) as f:
            assert json.load(f)["retriever"] == "dense"
        # the best checkpoint also carries the weight chosen over the hybrid (teacher + BM25) dev top-k
        from twotower.retrieval.interpolation import read_alpha, read_first_stage_alphas

        stages = read_first_stage_alphas(res.best_dir)
        assert set(stages) == {"dense", "hybrid"} and stages["dense"] == read_alpha(res.best_dir)
        assert [r["alpha"] for r in log if r["event"] == "hybrid_alpha"] == [stages["hybrid"]]
        steps = [r for r in log if r["event"] == "step"]
        if weight:  # the step's loss is label loss + weight x KL
            assert all(r["loss"] == pytest.approx(r["label_loss"] + weight * r["distill_kl"], rel=1e-5) for r in steps)
        else:
            assert "distill_kl" not in steps[0]
        data, _ = load_reranker_data(cfg)
        teacher = Teacher(cfg, data.corpus, device="cpu")
        teacher.embed_queries(data.examples)
        groups = [(i, [d for d, _ in hits]) for i, hits in enumerate(teacher.dense([e.query for e in data.examples], 4))]
        model = CrossEncoder.from_pretrained(res.best_dir, bf16=False)
        student = torch.tensor(np.stack([model.predict([(data.examples[i].query, data.corpus[d]) for d in docs])
                                         for i, docs in groups]))  # (Q, 4)
        kls[weight] = float(listwise_kl(student, teacher.logits(groups)))
    # The ratio is 0.28 with the fixed tiny vocabulary (it spanned 0.23-0.91 while the fixture's
    # vocabulary was trained, and so differed from process to process; see tiny_model_dir).
    assert kls[100.0] < 0.75 * kls[0.0], kls


def test_residual_training_learns_only_where_the_teacher_ranks_wrong(tmp_path, monkeypatch):
    """residual=True: the label loss reads reranker + teacher logits. A teacher that puts every group's
    positive first by a margin of 200 leaves no gradient (in fp32, exp(-200) is 0), so the encoder ends
    exactly as it began; an uninformative teacher (all zeros) leaves the labels' whole gradient, and
    the same run moves it. Dev then chooses checkpoints on the interpolated nDCG@10."""
    import torch

    from twotower.encoder import load_encoder
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.training.train_reranker import Teacher

    def teacher_logits(margin):
        def logits(self, groups):  # (G, n): the positive is each group's first document
            out = torch.zeros(len(groups), len(groups[0][1]))
            out[:, 0] = margin
            return out
        return logits

    base, _ = load_encoder(tiny_model_dir(0.2))
    start = {k: v.clone() for k, v in base.state_dict().items()}
    moved = {}
    for margin in (200.0, 0.0):
        monkeypatch.setattr(Teacher, "logits", teacher_logits(margin))
        cfg = _cfg(tmp_path, out=str(tmp_path / f"m{margin}"), teacher=tiny_model_dir(), residual=True,
                   weight_decay=0.0, max_steps=3, eval_every=3, eval_at_start=False, save_last=True)
        res = train_reranker(cfg)
        steps = [r for r in _log(cfg.out) if r["event"] == "step"]
        evals = [r for r in _log(cfg.out) if r["event"] == "eval"]
        assert res.best_score == pytest.approx(evals[-1]["interpolated_ndcg10"])  # the metric that chose it
        assert "distill_kl" not in steps[0]
        if margin:
            assert all(r["loss"] == 0.0 for r in steps)
        body = CrossEncoder.from_pretrained(os.path.join(cfg.out, "last"), bf16=False).bert.state_dict()
        moved[margin] = max(float((body[k].float() - v.float()).abs().max()) for k, v in start.items() if k in body)
    assert moved[200.0] == 0.0 and moved[0.0] > 1e-4, moved
    with pytest.raises(ValueError, match="residual trains the reranker as a correction"):
        _cfg(tmp_path, residual=True)


def _titled_beir(tmp_path) -> str:
    """tiny_beir_dir with a two-word title on every document (the texts stay as they were)."""
    import shutil

    root = str(tmp_path / "titled")
    shutil.copytree(tiny_beir_dir(), root)
    docs = [json.loads(x) for x in open(os.path.join(root, "corpus.jsonl"))]
    with open(os.path.join(root, "corpus.jsonl"), "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({**d, "title": f"{WORDS[i % 7]} {WORDS[7 + i % 5]}"}) + "\n")
    return root


def test_windowed_training_trains_on_each_documents_best_window(tmp_path, monkeypatch):
    """With passage_window, each step trains on the window `best_windows` picks for each (query, document),
    the title in front of it; dev reranks by the best window; the checkpoint keeps the setting."""
    from twotower.retrieval.cross_encoder import CrossEncoder

    data = _titled_beir(tmp_path)
    corpus = {d["_id"]: d for d in map(json.loads, open(os.path.join(data, "corpus.jsonl")))}
    picked, trained = [], []
    best_windows, encode_pairs = CrossEncoder.best_windows, CrossEncoder.encode_pairs

    def spy_best(self, pairs, batch_size=32, by="model"):
        assert by == "model"  # the default
        out = best_windows(self, pairs, batch_size, by)
        picked.append((list(pairs), out))
        return out

    def spy_encode(self, queries, texts):
        if self.training:
            trained.append(list(texts))
        return encode_pairs(self, queries, texts)

    monkeypatch.setattr(CrossEncoder, "best_windows", spy_best)
    monkeypatch.setattr(CrossEncoder, "encode_pairs", spy_encode)
    res = train_reranker(_cfg(tmp_path, pairs=data, passage_window=4, passage_stride=3, max_steps=2, eval_every=2))
    assert len(trained) == 2 and [out for _, out in picked] == trained  # trained on what best_windows chose
    long_docs = 0
    for pairs, out in picked:
        for (_, doc), text in zip(pairs, out):
            title, body = doc
            d = next(v for v in corpus.values() if v["title"] == title and v["text"] == body)
            assert text.startswith(title + " ") and text[len(title) + 1:] in d["text"]
            long_docs += len(d["text"].split()) > 4
            assert len(text.split()) <= 2 + 4 and (len(d["text"].split()) <= 4 or text != f"{title} {body}")
    assert long_docs > 0, "test needs documents longer than a window"
    assert json.load(open(os.path.join(res.best_dir, "config.json")))["rerank_windows"] == {"window": 4, "stride": 3,
                                                                                       "keep": 3}
    assert CrossEncoder.from_pretrained(res.best_dir, bf16=False).windows.window == 4
    with pytest.raises(ValueError, match="passage_window"):
        _cfg(tmp_path, pairs=data, passage_stride=3)


def test_window_choice_bm25_trains_on_bm25s_best_window_of_each_document(tmp_path, monkeypatch):
    """window_choice="bm25": a step trains on each document's window BM25 ranks best for its query, and scores
    no windows with the model first (the only forwards are the training steps' and dev's)."""
    from twotower.indexing.bm25 import BM25
    from twotower.retrieval.cross_encoder import CrossEncoder

    data = _titled_beir(tmp_path)
    events, picks = [], []
    encode_pairs, score, best_windows = CrossEncoder.encode_pairs, CrossEncoder._score, CrossEncoder.best_windows

    def spy_best(self, pairs, batch_size=32, by="model"):
        events.append("pick")  # before the call: a model scoring windows would show as "pick score"
        out = best_windows(self, pairs, batch_size, by)
        picks.append((by, out, [self.document_windows([doc])[0] for _, doc in pairs], [q for q, _ in pairs]))
        return out

    def spy_score(self, pairs, batch_size, progress):
        events.append("score")
        return score(self, pairs, batch_size, progress)

    def spy_encode(self, queries, texts):
        if self.training:
            events.append("train")
        return encode_pairs(self, queries, texts)

    monkeypatch.setattr(CrossEncoder, "best_windows", spy_best)
    monkeypatch.setattr(CrossEncoder, "_score", spy_score)
    monkeypatch.setattr(CrossEncoder, "encode_pairs", spy_encode)
    train_reranker(_cfg(tmp_path, pairs=data, passage_window=4, passage_stride=3, max_steps=2, eval_every=2,
                        window_choice="bm25"))
    assert events.count("pick") == 2 and "pick score" not in " ".join(events)  # each pick goes straight to training
    assert [e for e in events if e != "score"] == ["pick", "train"] * 2  # dev's scoring comes before or after
    long_docs = 0
    for by, out, windows_of, queries in picks:
        assert by == "bm25"
        for query, windows, text in zip(queries, windows_of, out):
            ids = [str(i) for i in range(len(windows))]
            bm25 = BM25()
            bm25.add(ids, windows)
            assert text == windows[int(np.argsort(-bm25.score(query, ids), kind="stable")[0])]
            long_docs += len(windows) > 1
    assert long_docs > 0, "test needs documents longer than a window"
    with pytest.raises(ValueError, match="window_choice"):
        _cfg(tmp_path, pairs=data, window_choice="bm25")  # no windows to choose from
    with pytest.raises(ValueError, match="window_choice='best'"):
        _cfg(tmp_path, pairs=data, passage_window=4, window_choice="best")


def test_dev_depth_defaults_to_the_search_depth(tmp_path, capsys, monkeypatch):
    """The interpolation weight is chosen at the dev depth and used at search's rerank_k: by default they agree,
    from Python and from `twotower train reranker` without --dev-rerank-k (which once chose it at 100)."""
    from twotower.cli import main
    from twotower.retrieval.rerank import DEFAULT_RERANK_K
    from twotower.retrieval.training import train_reranker as module

    assert RerankerTrainConfig(model="m", pairs="p", out="o").dev_rerank_k == DEFAULT_RERANK_K
    with pytest.raises(ValueError, match="dev_rerank_k=0: give a positive number"):
        RerankerTrainConfig(model="m", pairs="p", out="o", dev_rerank_k=0)
    seen = []

    def capture(cfg):
        seen.append(cfg.dev_rerank_k)
        raise SystemExit(0)

    monkeypatch.setattr(module, "train_reranker", capture)
    for extra in ([], ["--dev-rerank-k", "7"]):
        with pytest.raises(SystemExit):
            main(["train", "reranker", "--model", tiny_model_dir(0.2), "--pairs", tiny_beir_dir(), "--out",
                  str(tmp_path / f"rr{len(extra)}"), "--no-progress", *extra])
    assert seen == [DEFAULT_RERANK_K, 7]


def test_labeled_pairs_jsonl_with_a_byte_order_mark_is_read_as_pairs(tmp_path):
    """A BOM before the first object hid its "label" from the sniffing, so the file was read as
    {query, pos, neg} lines and refused as having no positives."""
    from twotower.retrieval.training.train_reranker import load_reranker_data

    rows = [{"query": "tea", "passage": "Tea is a drink", "label": 1}, {"query": "tea", "passage": "Cars", "label": 0},
            {"query": "cars", "passage": "Cars go fast", "label": 1}]
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8"))
    data, labeled = load_reranker_data(_cfg(tmp_path, pairs=str(path)))
    assert labeled is not None and [p.label for p in labeled.pairs] == [1, 0, 1]
    assert [e.query for e in data.examples] == ["tea", "cars"]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"query": "caf\xe9", "passage": "x", "label": 1}\n')
    with pytest.raises(ValueError, match=re.escape(f"{bad}:1: not valid UTF-8")):
        load_reranker_data(_cfg(tmp_path, pairs=str(bad)))


def test_a_fresh_heads_run_draws_its_dropout_from_where_it_always_did(tmp_path):
    """`from_encoder` no longer reseeds the caller's random stream; the trainer's dropout must still start where
    that left it (seed 0, after the head's draw), or every seeded run, the shipped reranker's too, would change."""
    import torch

    from twotower.encoder.core.config import EncoderConfig
    from twotower.encoder.core.heads import BertForSequenceClassification

    cfg = _cfg(tmp_path)
    torch.manual_seed(cfg.seed + 5)
    load_reranker(cfg, torch.device("cpu"))
    after = torch.get_rng_state()
    torch.manual_seed(0)  # what the old from_encoder did to the run's stream: reseed, then draw the model
    BertForSequenceClassification(EncoderConfig.load(os.path.join(cfg.model, "config.json")), num_labels=1,
                                  pooling=cfg.head_pooling)
    assert torch.equal(after, torch.get_rng_state())


def _pairs(n_queries: int, per_query: int, long_queries: bool = False) -> list[tuple[str, str, int]]:
    """(query, passage, label) as real pairs files hold them: short queries, each judged against several
    long passages (the first relevant); `long_queries` makes queries as long as the passages (ArguAna-like)."""
    rng = random.Random(n_queries)
    rows = []
    for q in range(n_queries):
        query = " ".join(rng.choices(WORDS, k=40 if long_queries else 4)) + f" q{q}"
        rows += [(query, " ".join(rng.choices(WORDS, k=rng.randint(30, 50))) + f" p{q}.{j}", int(j == 0))
                 for j in range(per_query)]
    return rows


@pytest.mark.parametrize("suffix", [".tsv", ".jsonl"])
def test_a_pairs_file_with_query_and_passage_swapped_is_named_in_a_warning(tmp_path, caplog, suffix):
    """A pairs file holding passage<TAB>query<TAB>label trained silently on reversed pairs: only the label column
    was checked. It is a warning: texts matched to short labels are legitimate and look the same."""
    from twotower.retrieval.training.train_reranker import load_reranker_data

    def write(name, rows):
        path = tmp_path / (name + suffix)
        if suffix == ".tsv":
            path.write_text("".join(f"{q}\t{p}\t{label}\n" for q, p, label in rows), encoding="utf-8")
        else:
            path.write_text("".join(json.dumps({"query": q, "passage": p, "label": label}) + "\n"
                                    for q, p, label in rows), encoding="utf-8")
        return str(path)

    rows = _pairs(8, 4)
    normal, swapped = write("normal", rows), write("swapped", [(p, q, label) for q, p, label in rows])
    with caplog.at_level("WARNING"):
        load_reranker_data(_cfg(tmp_path, pairs=normal))
        assert not caplog.records
        data, labeled = load_reranker_data(_cfg(tmp_path, pairs=swapped))
    assert labeled is not None and len(labeled.pairs) == 32  # read as given: a warning, not an error
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    message = caplog.records[0].getMessage()
    assert message.startswith(f"--pairs {swapped}: the query is longer than the passage in 32 of 32 pairs (median ")
    assert "are the query and passage swapped?" in message and "ignore this if your queries are meant" in message
    fix = ("the values of 'query' and 'passage'" if suffix == ".jsonl" else
           f"awk -F'\\t' -v OFS='\\t' '{{print $2, $1, $3}}' {swapped} > swapped.tsv")
    assert f"swap them ({fix})" in message
    caplog.clear()
    with caplog.at_level("WARNING"):  # queries as long as the passages, or too few pairs to tell: no warning
        load_reranker_data(_cfg(tmp_path, pairs=write("long", _pairs(8, 4, long_queries=True))))
        load_reranker_data(_cfg(tmp_path, pairs=write("few", [(p, q, label) for q, p, label in _pairs(3, 3)])))
    assert not caplog.records


def test_a_model_with_one_segment_embedding_is_refused_naming_it_before_anything_is_written(tmp_path, capsys):
    """Pair input on type_vocab_size 1 was an IndexError traceback from inside the embeddings."""
    import shutil

    from twotower.cli import main

    model = str(tmp_path / "one")
    shutil.copytree(tiny_model_dir(0.2), model)
    cfg = json.load(open(os.path.join(model, "config.json")))
    cfg["type_vocab_size"] = 1
    json.dump(cfg, open(os.path.join(model, "config.json"), "w"))
    shapes = os.path.join(model, "model.safetensors")
    from safetensors.torch import load_file, save_file

    weights = load_file(shapes)
    weights = {k: v[:1] if "token_type_embeddings" in k else v for k, v in weights.items()}
    save_file(weights, shapes)
    rc = main(["train", "reranker", "--model", model, "--pairs", tiny_beir_dir(), "--out", str(tmp_path / "o"),
               "--no-progress"])
    assert rc == 2
    assert f"--model {model} has one segment embedding (type_vocab_size 1)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")
