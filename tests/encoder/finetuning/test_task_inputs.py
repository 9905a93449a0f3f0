"""How examples become model inputs and a label map: each example read by itself, labels in a usable order,
dev-only labels, and the notes a run gives about how its inputs were read."""

from __future__ import annotations

import numpy as np
import pytest

from twotower.encoder.finetuning.finetune import FinetuneConfig, finetune
from twotower.encoder.finetuning.task_examples import TagExample, TextExample, build_label_map, carve_dev
from twotower.encoder.finetuning.task_model import TaskModel
from twotower.encoder.finetuning.tasks import TaskInfo

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py

QUICK = FinetuneConfig(epochs=1, batch_size=4, max_steps=1, progress=False)


def test_a_lone_text_is_read_alike_beside_pairs(tiny_dir):
    """It became `[CLS] t [SEP] [SEP]` when another example of the batch had a pair, and its probabilities
    changed with the rest of the file."""
    tm = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["0", "1"], max_length=32))
    lone = TextExample("i hate this movie")
    pair = TextExample("the tea is hot", pair="the tea is cold")
    alone, mixed = tm.featurize([lone]), tm.featurize([lone, pair])
    assert mixed.input_ids[0] == alone.input_ids[0] and mixed.token_type_ids[0] == alone.token_type_ids[0]
    assert alone.input_ids[0].count(tm.tokenizer.sep_id) == 1
    assert mixed.input_ids[1].count(tm.tokenizer.sep_id) == 2 and 1 in mixed.token_type_ids[1]
    p_alone = tm.predict([lone])[0].probs
    p_mixed = tm.predict([pair, lone, pair])[1].probs
    assert p_alone == pytest.approx(p_mixed, abs=1e-6)


def test_integer_labels_are_ordered_by_value():
    """Sorted as strings, id 2 was class "10" and -1 / 0 / 1 gave id 0 to "-1" ... by accident."""
    assert build_label_map([str(k) for k in (3, 10, 0, 2, 11, 1)]) == ["0", "1", "2", "3", "10", "11"]
    assert build_label_map(["5", "-1", "10"]) == ["-1", "5", "10"]  # as strings: "-1", "10", "5"
    assert build_label_map(["pos", "neg", "10", "2"]) == ["10", "2", "neg", "pos"]  # not all integers: strings
    assert build_label_map(["B-x", "O", "I-x"]) == ["O", "B-x", "I-x"]


def test_the_carved_dev_split_keeps_every_label_in_train():
    """A rare class (2 examples) could land wholly in dev: a label the model never trained on."""
    examples = [TextExample(f"t{i}", "common") for i in range(40)] + [TextExample(f"r{i}", f"rare{i // 2}")
                                                                     for i in range(20)]
    for seed in range(5):
        train, dev = carve_dev("classify", examples, 0.5, seed)
        assert {ex.label for ex in train} == {ex.label for ex in examples}
        assert sum(ex.label == "common" for ex in dev) == 20 and len(train) + len(dev) == len(examples)
    train, dev = carve_dev("classify", examples[:3], 0.1)  # too few for a share of any label: still one in dev
    assert len(dev) == 1 and dev[0].label == "common"
    # the size asked for, whatever the rounding of each label's share (10 labels of 5 at 0.1 gave 1, of 3 at
    # 0.5 gave 20 of 30); labels of one example each: the rest drawn as an unstratified split would
    for labels, size, fraction in ((10, 5, 0.1), (10, 3, 0.5), (10, 2, 0.3), (7, 3, 0.25), (40, 1, 0.1)):
        examples = [TextExample(f"t{k}-{i}", str(k)) for k in range(labels) for i in range(size)]
        train, dev = carve_dev("classify", examples, fraction)
        assert len(dev) == round(labels * size * fraction), (labels, size, fraction)
        if size > 1:
            assert {ex.label for ex in train} == {str(k) for k in range(labels)}


def test_a_dev_only_label_is_in_the_map_and_noted(tiny_dir, tmp_path):
    """It stopped the run ("label ... is not in the label map"), naming a line of the train file when the
    dev split was carved from it."""
    train = [TextExample("i love this movie", "1"), TextExample("i hate this movie", "0")] * 4
    dev = [TextExample("great acting", "1"), TextExample("terrible", "10", source="dev.tsv:3")]
    report = finetune("classify", tiny_dir, train, dev, str(tmp_path / "run"), QUICK)
    assert TaskModel.from_pretrained(str(tmp_path / "run")).info.labels == ["0", "1", "10"]
    assert any("1 label of the label map has no training example" in n and "'10'" in n for n in report.notes)


def test_a_given_label_map_is_kept_in_its_order(tiny_dir, tmp_path):
    train = [TextExample("i love this movie", "pos"), TextExample("i hate this movie", "neg")] * 4
    report = finetune("classify", tiny_dir, train, train[:2], str(tmp_path / "run"), QUICK,
                      labels=["pos", "neg", "meh"])
    assert TaskModel.from_pretrained(str(tmp_path / "run")).info.labels == ["pos", "neg", "meh"]
    assert any("'meh'" in n for n in report.notes)
    with pytest.raises(ValueError, match=r"repeated: \['pos'\]"):
        finetune("classify", tiny_dir, train, train, str(tmp_path / "x"), QUICK, labels=["pos", "neg", "pos"])


def test_truncation_and_a_mean_pooled_head_are_noted(tiny_dir, tmp_path):
    """Classification cut long inputs at max_length without a word; transformers reads a mean-pooled head
    through [CLS] and a random pooler, which only the reranker docs said."""
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
    train = [TextExample(long, "1"), TextExample("terrible", "0")] * 4
    cfg = FinetuneConfig(epochs=1, batch_size=4, max_steps=1, progress=False, max_length=16, pooling="mean")
    report = finetune("classify", tiny_dir, train, train[:2], str(tmp_path / "run"), cfg)
    assert "train: 4 of 8 texts are longer than 16 tokens (the model's --max-length) and were truncated at it" in report.notes
    assert "dev: 1 of 2 texts is longer than 16 tokens (the model's --max-length) and was truncated at it" in report.notes
    assert any(n.startswith("a mean-pooled classifier (--pooling mean) predicts correctly only when loaded by "
                            "twotower") for n in report.notes)
    notes: list[str] = []
    TaskModel.from_pretrained(str(tmp_path / "run")).predict([TextExample(long)], notes=notes)
    assert notes == ["1 of 1 text is longer than 16 tokens (the model's --max-length) and was truncated at it"]


def test_a_word_without_tokens_is_read_as_unk_and_noted(tiny_dir, tmp_path):
    """A word normalisation deletes (zero-width space, BOM, \\x07) was always "O", never trained on, and
    nothing said so."""
    tm = TaskModel.from_encoder(tiny_dir, TaskInfo("tag", ["O", "B-x"], max_length=32))
    words = ["john", "\u200b", "lives", "\x07"]
    ex = TagExample(words, ["O", "B-x", "O", "B-x"], source="s.conll:4")
    feats = tm.featurize([ex], with_targets=True)
    ids = feats.input_ids[0]
    assert ids.count(tm.tokenizer.unk_id) == 2 and ids[-2] == tm.tokenizer.unk_id
    assert [r for r, _ in feats.aux[0].words] == [0, 0, 0, 0]
    positions = [p for _, p in feats.aux[0].words]
    assert ids[positions[1]] == tm.tokenizer.unk_id and feats.targets[0][positions[1]] == 1
    assert feats.tokenless == ["s.conll:4: word 2 '\\u200b'", "s.conll:4: word 4 '\\x07'"]
    notes: list[str] = []
    preds = tm.predict([TagExample(words)], notes=notes)
    assert len(preds[0].tags) == 4
    assert notes == ["2 words have no token after normalisation (zero-width or control characters, a lone accent) "
                     "and were read as [UNK]: sentence 1: word 2 '\\u200b'; sentence 1: word 4 '\\x07'"]
    train = [ex, TagExample(["john", "lives"], ["B-x", "O"])] * 4
    report = finetune("tag", tiny_dir, train, train[:1], str(tmp_path / "tag"), QUICK)
    assert any(n.startswith("train: 8 words have no token") for n in report.notes)
    assert np.isfinite(report.seeds[0].history[0]["train_loss"])
