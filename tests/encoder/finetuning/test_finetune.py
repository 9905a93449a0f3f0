"""The shared fine-tuning loop: learns, keeps the best checkpoint, frozen encoder, seeds, bad input."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from twotower.encoder.core.checkpoint import read_weights, split_prefix
from twotower.encoder.core.heads import BertForSequenceClassification
from twotower.encoder.finetuning.finetune import REPORT_NAME, FinetuneConfig, finetune
from twotower.encoder.finetuning.task_examples import QAExample, TagExample, TextExample
from twotower.encoder.finetuning.task_model import TaskModel

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py


POS = ["i love this movie", "a good film with a great cast", "great acting", "unbelievable performance"]
NEG = ["i hate this movie", "a bad film and a boring plot", "terrible", "the lazy dog"]
TRAIN = [TextExample(t, "pos", source=f"train.tsv:{i + 2}") for i, t in enumerate(POS)] * 6 + \
        [TextExample(t, "neg", source=f"train.tsv:{i + 6}") for i, t in enumerate(NEG)] * 6
DEV = [TextExample(t, "pos") for t in POS] + [TextExample(t, "neg") for t in NEG]


def test_full_finetuning_learns_and_keeps_the_best_checkpoint(tiny_dir, tmp_path):
    out = str(tmp_path / "clf")
    cfg = FinetuneConfig(epochs=8, batch_size=8, lr=3e-3, warmup=0.1, progress=False, bf16=False)
    report = finetune("classify", tiny_dir, TRAIN, DEV, out, cfg, test=DEV)
    (seed,) = report.seeds
    accs = [h["accuracy"] for h in seed.history]
    assert len(accs) == 8 and max(accs) == 1.0 == seed.dev["accuracy"]
    assert seed.best_epoch == [h["epoch"] for h in seed.history][accs.index(1.0)]
    assert seed.history[-1]["train_loss"] < seed.history[0]["train_loss"]
    # the directory alone restores a model that predicts as well as the best epoch did
    tm = TaskModel.from_pretrained(out)
    assert tm.info.labels == ["neg", "pos"] and tm.info.max_length == 96  # the default, 128, capped by the model
    preds = tm.predict(DEV)
    assert [p.label for p in preds] == [ex.label for ex in DEV]
    assert seed.test == {"accuracy": 1.0}
    with open(os.path.join(out, REPORT_NAME)) as f:
        saved = json.load(f)
    assert saved["best_seed"] == 0 and saved["dev_summary"]["accuracy"]["mean"] == 1.0


def test_frozen_encoder_caches_features_once_and_trains_only_the_head(tiny_dir, tmp_path, monkeypatch):
    calls = {"rows": 0}
    real_encode = BertForSequenceClassification.encode

    def counting_encode(self, input_ids, *args, **kwargs):
        calls["rows"] += input_ids.shape[0]
        return real_encode(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(BertForSequenceClassification, "encode", counting_encode)
    out = str(tmp_path / "frozen")
    cfg = FinetuneConfig(epochs=4, batch_size=8, freeze_encoder=True, lr=5e-2, seeds=(0, 1, 2), progress=False)
    report = finetune("classify", tiny_dir, TRAIN, DEV, out, cfg, test=DEV)
    # the encoder ran exactly once per row of train, dev and test, for all three seeds together
    assert calls["rows"] == len(TRAIN) + 2 * len(DEV)
    # the saved encoder equals the base encoder; only the head learned
    base, _ = split_prefix(read_weights(tiny_dir))
    tuned, head = split_prefix(read_weights(out))
    for k, v in base.items():
        assert torch.equal(v, tuned[k]), k
    assert set(head) == {"classifier.weight", "classifier.bias"}
    # mean and sample std over seeds
    accs = np.array([s.dev["accuracy"] for s in report.seeds])
    mean, std = report.summary("dev")["accuracy"]
    assert mean == pytest.approx(accs.mean()) and std == pytest.approx(accs.std(ddof=1))
    assert len(report.summary("test")) == 1 and [s.seed for s in report.seeds] == [0, 1, 2]
    assert report.best_seed == int(np.argmax(accs))  # first seed reaching the best dev score


def test_seeds_give_different_heads_but_the_same_seed_repeats(tiny_dir, tmp_path):
    cfg = FinetuneConfig(epochs=1, batch_size=8, freeze_encoder=True, lr=1e-2, seeds=(3,), progress=False)
    a = finetune("classify", tiny_dir, TRAIN, DEV, str(tmp_path / "a"), cfg)
    b = finetune("classify", tiny_dir, TRAIN, DEV, str(tmp_path / "b"), cfg)
    assert a.seeds[0].history[0]["train_loss"] == b.seeds[0].history[0]["train_loss"]
    wa = read_weights(str(tmp_path / "a"))["classifier.weight"]
    assert torch.equal(wa, read_weights(str(tmp_path / "b"))["classifier.weight"])


def test_tagging_and_qa_run_through_the_same_loop(tiny_dir, tmp_path):
    tags = [TagExample("john smith lives in new york".split(), ["B-per", "I-per", "O", "O", "B-loc", "I-loc"]),
            TagExample("mary works at google".split(), ["B-per", "O", "O", "B-corp"])] * 6
    rep = finetune("tag", tiny_dir, tags, tags[:2], str(tmp_path / "tag"),
                   FinetuneConfig(epochs=10, batch_size=4, lr=3e-3, progress=False))
    assert rep.seeds[0].dev["f1"] == 1.0
    tm = TaskModel.from_pretrained(str(tmp_path / "tag"))
    assert tm.info.labels[0] == "O"
    assert tm.predict(tags[:1])[0].entities == [("per", 0, 2, "john smith"), ("loc", 4, 6, "new york")]

    ctx = "the tower was built in 1889 . paris is the capital of france . the river flows north ."
    qa = [QAExample("a", "when was the tower built", ctx, [("1889", ctx.index("1889"))]),
          QAExample("b", "what is the capital of france", ctx, [("paris", ctx.index("paris"))]),
          QAExample("c", "who wrote the book", "many people live in the city", [])] * 4
    cfg = FinetuneConfig(epochs=8, batch_size=4, lr=3e-3, max_length=24, doc_stride=6, progress=False)
    rep = finetune("qa", tiny_dir, qa, qa[:3], str(tmp_path / "qa"), cfg)
    seed = rep.seeds[0]
    assert rep.counts["train_rows"] > len(qa)  # long contexts became several windows
    assert seed.dev["span_f1"] > 0.6
    tm = TaskModel.from_pretrained(str(tmp_path / "qa"))
    assert tm.info.null_threshold == seed.null_threshold and tm.info.doc_stride == 6
    preds = tm.predict(qa[:3])
    assert [p.id for p in preds] == ["a", "b", "c"]
    assert all(p.no_answer or ctx[p.start:p.end] == p.text for p in preds[:2])


def test_dry_run_stops_after_max_steps(tiny_dir, tmp_path):
    rep = finetune("classify", tiny_dir, TRAIN, DEV, str(tmp_path / "dry"),
                   FinetuneConfig(epochs=5, batch_size=4, max_steps=3, progress=False))
    assert [h["step"] for h in rep.seeds[0].history] == [3]


def test_bad_input_names_the_example(tiny_dir, tmp_path):
    dev = [TextExample("fine", "pos"), TextExample("so so", "meh", source="dev.tsv:3")]
    with pytest.raises(ValueError, match=r"dev.tsv:3: label 'meh' of the dev examples is not in the label map "
                                         r"given \(labels=, --labels\): \['neg', 'pos'\]"):
        finetune("classify", tiny_dir, TRAIN, dev, str(tmp_path / "x"), FinetuneConfig(progress=False),
                 labels=["neg", "pos"])
    train = [*TRAIN, TextExample("  ", "pos", source="train.tsv:99")]
    with pytest.raises(ValueError, match=r"train.tsv:99: empty text"):
        finetune("classify", tiny_dir, train, DEV, str(tmp_path / "x"), FinetuneConfig(progress=False))
    with pytest.raises(ValueError, match="needs training and dev examples"):
        finetune("classify", tiny_dir, TRAIN, [], str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")


def test_an_encoder_without_pooler_gets_a_seeded_one(tiny_dir, tmp_path):
    """An MLM checkpoint has no pooler: the classification pooler is part of the fresh head, drawn from the seed,
    so a run repeats exactly whatever the global RNG holds, and different seeds draw different poolers."""
    from twotower.encoder import BertModel, Tokenizer
    from twotower.encoder.core.checkpoint import save_encoder
    from twotower.encoder.finetuning.task_model import read_config

    config, _, _ = read_config(tiny_dir)
    bare = str(tmp_path / "mlm-like")
    save_encoder(BertModel(config, add_pooling_layer=False), Tokenizer.from_pretrained(tiny_dir), bare)
    assert not any(k.startswith("pooler.") for k in split_prefix(read_weights(bare))[0])
    cfg = FinetuneConfig(epochs=1, batch_size=8, lr=1e-3, seeds=(3,), progress=False)
    runs = []
    for name, global_seed in (("a", 1), ("b", 2)):
        torch.manual_seed(global_seed)  # must not matter
        rep = finetune("classify", bare, TRAIN, DEV, str(tmp_path / name), cfg)
        runs.append((rep.seeds[0].history, read_weights(str(tmp_path / name))))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    from twotower.encoder.finetuning.tasks import TaskInfo

    m3 = TaskModel.from_encoder(bare, TaskInfo("classify", ["neg", "pos"]), seed=3).model
    m4 = TaskModel.from_encoder(bare, TaskInfo("classify", ["neg", "pos"]), seed=4).model
    assert m3.fresh_pooler and not torch.equal(m3.bert.pooler.dense.weight, m4.bert.pooler.dense.weight)
    m4.reset_head(3)
    assert torch.equal(m3.bert.pooler.dense.weight, m4.bert.pooler.dense.weight)
    # an encoder that has a pooler keeps it: reset_head touches only the classifier
    with_pooler = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["neg", "pos"]), seed=3).model
    saved = split_prefix(read_weights(tiny_dir))[0]["pooler.dense.weight"]
    with_pooler.reset_head(4)
    assert not with_pooler.fresh_pooler and torch.equal(with_pooler.bert.pooler.dense.weight, saved)


@pytest.mark.parametrize("freeze", [False, True])
def test_mean_pooled_head_trains_full_and_frozen(tiny_dir, tmp_path, freeze):
    out = str(tmp_path / "mean")
    cfg = FinetuneConfig(epochs=8, batch_size=8, lr=3e-2 if freeze else 3e-3, progress=False, bf16=False,
                         pooling="mean", freeze_encoder=freeze)
    report = finetune("classify", tiny_dir, TRAIN, DEV, out, cfg)
    accs = [h["accuracy"] for h in report.seeds[0].history]
    assert report.seeds[0].history[-1]["train_loss"] < report.seeds[0].history[0]["train_loss"]
    tm = TaskModel.from_pretrained(out)
    assert tm.model.pooling == "mean" and tm.model.bert.pooler is None
    assert np.mean([p.label == ex.label for p, ex in zip(tm.predict(DEV), DEV)]) == max(accs)


@pytest.mark.parametrize("field, value, message", [
    ("epochs", 0, "epochs=0: give 1 or more (--epochs)"),  # a StopIteration traceback
    ("batch_size", 0, "batch_size=0: give 1 or more (--batch-size)"),  # a ZeroDivisionError
    ("max_train_examples", 0, "max_train_examples=0: give 1 or more (--max-train)"),  # meant no cap
    ("max_steps", 0, "max_steps=0: give 1 or more (--max-steps)"),
    ("evals_per_epoch", 0, "evals_per_epoch=0: give 1 or more (--evals-per-epoch)"),
    ("lr", -1.0, "lr=-1.0: give a learning rate >= 0 (--lr)"),
    ("warmup", 1.0, "warmup=1.0: give a fraction of the run in [0, 1) (--warmup)"),
    ("weight_decay", float("nan"), "weight_decay=nan: give 0 or more (--weight-decay)"),
    ("max_length", 0, "max_length=0: give 3 or more (--max-length)"),  # trained on empty inputs, at chance
])
def test_settings_that_crash_late_or_train_something_else_are_refused(field, value, message):
    FinetuneConfig()  # the defaults pass
    with pytest.raises(ValueError, match=re.escape(message)):
        FinetuneConfig(**{field: value})


def test_a_max_length_beyond_the_models_positions_is_refused_before_training(tiny_dir, tmp_path):
    """It failed at the first input longer than the model's positions, after the data was featurized."""
    from twotower.encoder.finetuning.task_model import read_config

    positions = read_config(tiny_dir)[0].max_position_embeddings
    cfg = FinetuneConfig(epochs=1, batch_size=8, seeds=(0,), progress=False, max_length=positions + 1)
    with pytest.raises(ValueError, match=re.escape(f"max_length={positions + 1}: the model in {tiny_dir} reads at "
                                                   f"most {positions} tokens (--max-length)")):
        finetune("classify", tiny_dir, TRAIN, DEV, str(tmp_path / "ft"), cfg)
    assert not (tmp_path / "ft").exists()


def test_the_default_max_length_fits_the_model(tiny_dir, tmp_path):
    """Not given, max_length is 128 or the model's positions if fewer (the tiny encoder has fewer)."""
    from twotower.encoder.finetuning.task_model import read_config

    positions = read_config(tiny_dir)[0].max_position_embeddings
    assert positions < 128
    cfg = FinetuneConfig(epochs=1, batch_size=8, seeds=(0,), progress=False)
    finetune("classify", tiny_dir, TRAIN, DEV, str(tmp_path / "ft"), cfg)
    assert TaskModel.from_pretrained(str(tmp_path / "ft")).info.max_length == positions


def test_paths_may_be_pathlib_paths(tiny_dir, tmp_path):
    """``get_model_path()`` returns a pathlib.Path: given as the model, it reached the run's JSON state and the
    first save failed with "Object of type PosixPath is not JSON serializable" (benchmarks/tasks_trec.py)."""
    from pathlib import Path

    cfg = FinetuneConfig(epochs=1, batch_size=8, progress=False, bf16=False)
    report = finetune("classify", Path(tiny_dir), TRAIN[:8], DEV, tmp_path / "clf", cfg)
    assert report.seeds and TaskModel.from_pretrained(str(tmp_path / "clf")).info.labels == ["neg", "pos"]
