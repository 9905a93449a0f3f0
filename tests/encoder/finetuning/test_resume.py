"""`finetune(..., resume=True)`: a run stopped mid-way (Ctrl-C, a crash) continues from its last saved state
to the very checkpoint and scores the uninterrupted run reaches; a resume of another run, of none, or of a
finished one is refused, saying why."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.encoder.task_fixtures import interrupted_at
from twotower.common.atomic import TMP_MARKER
from twotower.encoder.finetuning import finetune as ft
from twotower.encoder.finetuning.finetune import REPORT_NAME, FinetuneConfig, finetune
from twotower.encoder.finetuning.task_examples import QAExample, TagExample, TextExample

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py

STATE_DIR = "trainer_state"  # OUT/trainer_state/: what a resume continues from

POS = ["i love this movie", "a good film with a great cast", "great acting", "unbelievable performance"]
NEG = ["i hate this movie", "a bad film and a boring plot", "terrible", "the lazy dog"]
TRAIN = [TextExample(t, "pos") for t in POS] * 3 + [TextExample(t, "neg") for t in NEG] * 3  # 24: 5 batches of 5
DEV = [TextExample(t, "pos") for t in POS] + [TextExample(t, "neg") for t in NEG]
TAGS = [TagExample("john smith lives in new york".split(), ["B-per", "I-per", "O", "O", "B-loc", "I-loc"]),
        TagExample("mary works at google".split(), ["B-per", "O", "O", "B-corp"])] * 5
CTX = "the tower was built in 1889 . paris is the capital of france . the river flows north ."
QA = [QAExample("a", "when was the tower built", CTX, [("1889", CTX.index("1889"))]),
      QAExample("b", "what is the capital of france", CTX, [("paris", CTX.index("paris"))]),
      QAExample("c", "who wrote the book", "many people live in the city", [])] * 3


def gold_probability(preds, examples) -> dict[str, float]:
    """Accuracy, the mean probability of the gold label ("gold", which keeps rising as the head learns) and
    its complement ("doubt", best at the first evaluation): dev scores that put a seed's best checkpoint
    after the interruption, or before it, where the seed's best weights must come from the saved state."""
    gold = float(np.mean([p.probs[ex.label] for p, ex in zip(preds, examples)]))
    return {"accuracy": float(np.mean([p.label == ex.label for p, ex in zip(preds, examples)])), "gold": gold,
            "doubt": 1.0 - gold}


def _model_bytes(out: str) -> bytes:
    with open(os.path.join(out, "model.safetensors"), "rb") as f:
        return f.read()


def _interrupted(monkeypatch, step: int, *args, **kwargs) -> None:
    """finetune(*args, **kwargs) stopped before its optimizer step `step` (counted over all seeds)."""
    with monkeypatch.context() as m:
        m.setattr(ft, "set_lr", interrupted_at(step))
        with pytest.raises(KeyboardInterrupt):
            finetune(*args, **kwargs)


def _same_results(resumed, whole) -> None:
    """Every evaluation of every seed (its training loss, dev scores), the test scores, the best seed."""
    assert [(s.seed, s.history, s.dev, s.test, s.best_epoch, s.null_threshold) for s in resumed.seeds] == \
        [(s.seed, s.history, s.dev, s.test, s.best_epoch, s.null_threshold) for s in whole.seeds]
    assert resumed.best_seed == whole.best_seed and resumed.finished and whole.finished


@pytest.mark.parametrize("metric", ["gold", "doubt"])
def test_a_run_stopped_in_its_second_seed_mid_epoch_resumes_to_the_uninterrupted_runs_checkpoint(
        tiny_dir, tmp_path, monkeypatch, metric):
    # 5 steps an epoch, 15 a seed; evaluated at batches 2 and 5 of each epoch, saved every 3 steps too
    cfg = FinetuneConfig(epochs=3, batch_size=5, lr=3e-3, seeds=(1, 0), evals_per_epoch=2, save_every=3,
                         metric=metric, progress=False, bf16=False)
    args = ("classify", tiny_dir, TRAIN, DEV)
    whole = finetune(*args, str(tmp_path / "whole"), cfg, test=DEV, metric_fn=gold_probability)
    out = str(tmp_path / "run")
    _interrupted(monkeypatch, 15 + 9, *args, out, cfg, test=DEV, metric_fn=gold_probability)  # seed 0, step 9
    with open(os.path.join(out, STATE_DIR, "state.json")) as f:
        user = json.load(f)["user"]
    # saved at seed 0's evaluation after step 7: epoch 2 of 3, two of its five batches done
    assert (user["seed_index"], user["step"], user["epoch"], user["batch"]) == (1, 7, 1, 2)
    assert ft.saved_position(out) == "step 7 of seed 0 (2 of 2 seeds)"
    # "gold" rises: step 7's evaluation set the seed's best, so the state holds those weights once, as the
    # weights trained ("doubt": its best is an earlier step's, saved beside them)
    best_saved = os.path.getsize(os.path.join(out, STATE_DIR, "best.safetensors"))
    assert user["best_is_current"] is (metric == "gold")
    assert (best_saved < 1024) is (metric == "gold")

    resumed = finetune(*args, out, cfg, test=DEV, metric_fn=gold_probability, resume=True)
    _same_results(resumed, whole)
    if metric == "gold":  # the checkpoint is one saved after the resume (the second seed's last epoch)
        assert whole.best_seed == 0 and whole.seeds[1].best_epoch == 3.0
    else:  # the second seed's test scores are those of its best weights, saved before the interruption
        assert whole.seeds[1].best_epoch < 1.4
    assert _model_bytes(out) == _model_bytes(str(tmp_path / "whole"))
    assert not os.path.exists(os.path.join(out, STATE_DIR))  # removed when the run finished
    with open(os.path.join(out, REPORT_NAME)) as f:
        assert json.load(f)["finished"] is True


def test_a_state_saved_at_the_seeds_best_evaluation_gives_back_those_weights_as_the_best(
        tiny_dir, tmp_path, monkeypatch):
    """Saved at the evaluation that set the seed's best, the state holds those weights once (the weights
    trained, `best_is_current`); a resume must take them as the best, which "doubt" never beats again."""
    cfg = FinetuneConfig(epochs=2, batch_size=5, lr=3e-3, seeds=(0,), evals_per_epoch=2, metric="doubt",
                         progress=False, bf16=False)
    args = ("classify", tiny_dir, TRAIN, DEV)
    whole = finetune(*args, str(tmp_path / "whole"), cfg, test=DEV, metric_fn=gold_probability)
    out = str(tmp_path / "run")
    _interrupted(monkeypatch, 3, *args, out, cfg, test=DEV, metric_fn=gold_probability)  # saved after step 2
    with open(os.path.join(out, STATE_DIR, "state.json")) as f:
        user = json.load(f)["user"]
    assert (user["step"], user["best_is_current"]) == (2, True)
    assert os.path.getsize(os.path.join(out, STATE_DIR, "best.safetensors")) < 1024  # no second copy
    resumed = finetune(*args, out, cfg, test=DEV, metric_fn=gold_probability, resume=True)
    _same_results(resumed, whole)
    assert whole.seeds[0].best_epoch == 0.4  # the checkpoint and the test scores are step 2's weights
    assert _model_bytes(out) == _model_bytes(str(tmp_path / "whole"))


@pytest.mark.parametrize("head", ["tag", "qa"])
def test_a_frozen_tagger_and_a_qa_head_resume_exactly(tiny_dir, tmp_path, monkeypatch, head):
    """Tagging on a frozen encoder (cached features: only the head is saved) and QA on the whole model."""
    if head == "tag":
        args, step = ("tag", tiny_dir, TAGS, TAGS[:2]), 8
        cfg = FinetuneConfig(epochs=3, batch_size=3, lr=5e-2, freeze_encoder=True, save_every=2, progress=False,
                             bf16=False)
    else:
        args, step = ("qa", tiny_dir, QA, QA[:3]), 8
        cfg = FinetuneConfig(epochs=3, batch_size=4, lr=3e-3, max_length=24, doc_stride=6, evals_per_epoch=2,
                             progress=False, bf16=False)
    whole = finetune(*args, str(tmp_path / "whole"), cfg, test=args[3])
    out = str(tmp_path / "run")
    _interrupted(monkeypatch, step, *args, out, cfg, test=args[3])
    with open(os.path.join(out, STATE_DIR, "state.json")) as f:
        user = json.load(f)["user"]
    assert user["epoch"] == 1 and 0 < user["batch"]  # mid-epoch, in the second epoch
    resumed = finetune(*args, out, cfg, test=args[3], resume=True)
    _same_results(resumed, whole)
    assert whole.seeds[0].best_epoch > 2  # the checkpoint is one saved after the resume
    assert _model_bytes(out) == _model_bytes(str(tmp_path / "whole"))
    assert not os.path.exists(os.path.join(out, STATE_DIR))


def test_a_resume_of_another_run_of_none_or_of_a_finished_one_is_refused(tiny_dir, tmp_path, monkeypatch):
    cfg = FinetuneConfig(epochs=2, batch_size=8, lr=3e-3, progress=False, bf16=False)
    out = str(tmp_path / "run")
    with pytest.raises(ValueError, match=r"no training state in .*run \(trainer_state/ missing\).*start the run "
                                         r"again without --resume"):
        finetune("classify", tiny_dir, TRAIN, DEV, out, cfg, resume=True)
    _interrupted(monkeypatch, 5, "classify", tiny_dir, TRAIN, DEV, out, cfg)  # saved after epoch 1 (step 3)
    other = FinetuneConfig(epochs=2, batch_size=8, lr=2e-3, warmup=0.2, progress=False, bf16=False)
    with pytest.raises(ValueError, match=r"cannot resume .*: this command differs from the run it continues: "
                                         r"--lr 0.002 \(the run: 0.003\); --warmup 0.2 \(the run: 0.1\)"):
        finetune("classify", tiny_dir, TRAIN, DEV, out, other, resume=True)
    with pytest.raises(ValueError, match=r"--train data has changed since the run read it"):
        finetune("classify", tiny_dir, TRAIN[:-1], DEV, out, cfg, resume=True)
    # a run an earlier twotower started read its examples into other rows: refused, saying so
    state = os.path.join(out, STATE_DIR, "state.json")
    with open(state) as f:
        saved = json.load(f)
    reading = saved["user"]["run"]["settings"].pop("reading")
    with open(state, "w") as f:
        json.dump(saved, f)
    with pytest.raises(ValueError, match=r"the run was started by an earlier twotower, which read the examples "
                                         r"into other rows .*start the run again without --resume"):
        finetune("classify", tiny_dir, TRAIN, DEV, out, cfg, resume=True)
    saved["user"]["run"]["settings"]["reading"] = reading
    with open(state, "w") as f:
        json.dump(saved, f)
    # a fresh start into the stopped run is refused, and says that it can be resumed
    with pytest.raises(ValueError, match=r"holds an earlier fine-tuning run; .*or resume=True to continue the run "
                                         r"stopped in .*run: --resume"):
        finetune("classify", tiny_dir, TRAIN, DEV, out, cfg)
    # where the examples were read is not what they are
    moved = [TextExample(ex.text, ex.label, source=f"elsewhere.tsv:{i}") for i, ex in enumerate(TRAIN)]
    # what kills mid-save left (a checkpoint's copy beside the run, a state's in it) goes; another's stays
    for left in (f".run{TMP_MARKER}99999", f"run/.{STATE_DIR}{TMP_MARKER}ab12", f".other{TMP_MARKER}1"):
        os.makedirs(tmp_path / left)
    finetune("classify", tiny_dir, moved, DEV, out, cfg, resume=True)
    assert [n for n in os.listdir(tmp_path) if TMP_MARKER in n] == [f".other{TMP_MARKER}1"]
    assert not [n for n in os.listdir(out) if TMP_MARKER in n]
    with pytest.raises(ValueError, match=r"the run in .*run finished \(finetune_report.json says so\); nothing is "
                                         r"left to continue.*--model .*run"):
        finetune("classify", tiny_dir, TRAIN, DEV, out, cfg, resume=True)


def test_a_replacing_run_resumes_in_its_staging_directory_and_leaves_the_earlier_run_whole(
        tiny_dir, tmp_path, monkeypatch):
    out, whole = str(tmp_path / "run"), str(tmp_path / "whole")
    earlier = FinetuneConfig(epochs=1, batch_size=8, lr=1e-3, progress=False, bf16=False)
    finetune("classify", tiny_dir, TRAIN, DEV, out, earlier)
    kept = {name: (tmp_path / "run" / name).read_bytes() for name in os.listdir(out)}
    cfg = FinetuneConfig(epochs=2, batch_size=5, lr=3e-3, metric="gold", progress=False, bf16=False)
    finetune("classify", tiny_dir, TRAIN, DEV, whole, cfg, metric_fn=gold_probability)
    _interrupted(monkeypatch, 8, "classify", tiny_dir, TRAIN, DEV, out, cfg, metric_fn=gold_probability,
                 overwrite=True)
    assert os.path.isdir(os.path.join(out + ".unfinished", STATE_DIR))
    assert {name: (tmp_path / "run" / name).read_bytes() for name in os.listdir(out)} == kept
    # found in OUT.unfinished without --overwrite
    finetune("classify", tiny_dir, TRAIN, DEV, out, cfg, metric_fn=gold_probability, resume=True)
    assert not os.path.exists(out + ".unfinished") and not os.path.exists(os.path.join(out, STATE_DIR))
    assert _model_bytes(out) == _model_bytes(whole)
