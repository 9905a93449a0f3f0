"""Tokenizer: worked examples on a toy vocabulary, parity with transformers' BertTokenizerFast, training, CLI."""

from __future__ import annotations

import json
import pickle
import threading
import types
from collections.abc import Callable

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from twotower.cli import main
from twotower.encoder.core import tokenizer as tokenizer_module
from twotower.encoder.core.tokenizer import SPECIAL_TOKENS, Tokenizer

TOY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "tea", "is", "cold", "hot", "##s"]
PAD, UNK, CLS, SEP, MASK, THE, TEA, IS, COLD, HOT, S = range(11)


@pytest.fixture()
def toy(tmp_path) -> Tokenizer:
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(TOY_VOCAB) + "\n", encoding="utf-8")
    return Tokenizer.from_vocab(str(path))


def test_single_texts_pad_to_longest_with_offsets_and_word_ids(toy):
    b = toy.encode(["the tea", "The tea is COLD"])
    assert b.input_ids.tolist() == [[CLS, THE, TEA, SEP, PAD, PAD], [CLS, THE, TEA, IS, COLD, SEP]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert b.token_type_ids.tolist() == [[0] * 6, [0] * 6]
    assert b.offsets[0] == [(0, 0), (0, 3), (4, 7), (0, 0)]
    assert b.word_ids[1] == [None, 0, 1, 2, 3, None]
    assert len(b) == 2


def test_pair_segments_and_subword_word_ids(toy):
    b = toy.encode(["the teas"], pairs=["is cold"])
    # [CLS] the tea ##s [SEP] is cold [SEP]: segment 0 through the first [SEP], 1 after it.
    assert b.input_ids.tolist() == [[CLS, THE, TEA, S, SEP, IS, COLD, SEP]]
    assert b.token_type_ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]
    assert b.word_ids[0] == [None, 0, 1, 1, None, 0, 1, None]  # "teas" is one word of two pieces
    assert b.sequence_ids[0] == [None, 0, 0, 0, None, 1, 1, None]
    assert b.offsets[0][2:4] == [(4, 7), (7, 8)]


def test_unknown_word_becomes_unk(toy):
    assert toy.encode(["the xylophone"]).input_ids.tolist() == [[CLS, THE, UNK, SEP]]


@pytest.mark.parametrize("strategy, expected", [
    # 9 = [CLS] + [SEP] + [SEP] + 6 content tokens from A (4) and B (4).
    ("longest_first", [CLS, THE, TEA, IS, SEP, THE, TEA, IS, SEP]),
    ("only_second", [CLS, THE, TEA, IS, COLD, SEP, THE, TEA, SEP]),
    ("only_first", [CLS, THE, TEA, SEP, THE, TEA, IS, HOT, SEP]),
])
def test_pair_truncation_strategies(toy, strategy, expected):
    b = toy.encode(["the tea is cold"], pairs=["the tea is hot"], max_length=9, truncation=strategy)
    assert b.input_ids[0].tolist() == expected
    assert b.overflowing == [True]


def test_impossible_truncation_is_a_clear_error(toy):
    with pytest.raises(ValueError, match="max_length=5 with truncation='only_second'"):
        toy.encode(["the tea is cold the tea"], pairs=["hot"], max_length=5, truncation="only_second")
    with pytest.raises(ValueError, match="truncation='sideways'"):
        toy.encode(["the tea"], truncation="sideways")
    with pytest.raises(TypeError, match="list of texts"):
        toy.encode("the tea")
    with pytest.raises(ValueError, match="2 texts but 1 pairs"):
        toy.encode(["a", "b"], pairs=["c"])


def test_encode_unpadded_then_pad_equals_encode(toy):
    texts, pairs = ["the tea", "the tea is cold", "hot"], ["is hot", "the", "the teas"]
    ids, types = toy.encode_unpadded(texts, pairs, max_length=6)
    assert [len(x) for x in ids] == [6, 6, 6]  # truncated with specials counted
    got, want = toy.pad(ids, types), toy.encode(texts, pairs, max_length=6)
    for name in ("input_ids", "token_type_ids", "attention_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_from_vocab_rejects_missing_file_and_missing_specials(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        Tokenizer.from_vocab(str(tmp_path / "nope.txt"))
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\nthe\n", encoding="utf-8")
    with pytest.raises(ValueError, match="special tokens"):
        Tokenizer.from_vocab(str(path))
    with pytest.raises(FileNotFoundError, match="tokenizer.json or vocab.txt"):
        Tokenizer.from_pretrained(str(tmp_path / "empty_dir_that_is_missing"))


def test_train_from_iterator_lowercase_switch():
    texts = ["Tea Time is Tea Time", "tea time is tea time"] * 20
    lower = Tokenizer.train(iterator=texts, vocab_size=60, min_frequency=1, progress=False)
    cased = Tokenizer.train(iterator=texts, vocab_size=60, min_frequency=1, progress=False, lowercase=False)
    assert [lower.id_to_token(i) for i in range(5)] == list(SPECIAL_TOKENS)
    assert lower.tokenize("Tea TIME") == ["tea", "time"]
    assert cased.tokenize("Tea") == ["Tea"] and cased.tokenize("tea") == ["tea"]
    assert cased.token_to_id("Tea") != cased.token_to_id("tea")
    assert lower.fingerprint() != cased.fingerprint()
    with pytest.raises(ValueError, match="exactly one"):
        Tokenizer.train(vocab_size=60)


def test_train_from_files_and_roundtrip(tmp_path, tiny_tokenizer):
    txt = tmp_path / "a.txt"
    txt.write_text("the tea is cold\n\nthe tea is hot\n", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": "cold tea is cold"}) + "\n", encoding="utf-8")
    tok = Tokenizer.train(files=[str(txt), str(jsonl)], vocab_size=50, min_frequency=1, progress=False)
    assert tok.tokenize("cold tea") == ["cold", "tea"]
    tok.save_pretrained(str(tmp_path / "tok"))
    again = Tokenizer.from_pretrained(str(tmp_path / "tok"))
    assert again.fingerprint() == tok.fingerprint()
    # vocab.txt alone gives the same tokenizer as tokenizer.json.
    from_txt = Tokenizer.from_vocab(str(tmp_path / "tok" / "vocab.txt"))
    texts = ["the tea is cold, hot tea!", "tea"]
    assert torch.equal(from_txt.encode(texts).input_ids, again.encode(texts).input_ids)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        Tokenizer.train(files=[str(bad)], vocab_size=50, progress=False)


def test_matches_transformers_fast_tokenizer_on_our_files(tmp_path, tiny_tokenizer):
    transformers = pytest.importorskip("transformers")
    tiny_tokenizer.save_pretrained(str(tmp_path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    texts = ["the tea is cold", "Paris is the capital of FRANCE!", "cats"]  # 6, 12 and 3 word pieces
    pairs = ["who wrote the book about the quick brown fox", "a", "the river flows north"]  # 24, 1, 10
    for kw in ({}, {"max_length": 9, "truncation": "longest_first"}, {"max_length": 16, "truncation": "only_second"}):
        ours = tiny_tokenizer.encode(texts, pairs, **kw)
        want = ref(texts, pairs, padding="longest", return_tensors="pt",
                   **({"max_length": kw["max_length"], "truncation": kw["truncation"]} if kw else {}))
        for name in ("input_ids", "token_type_ids", "attention_mask"):
            assert torch.equal(getattr(ours, name), want[name]), (kw, name)


def test_minilm_matches_transformers_and_never_pads_to_128(minilm_path):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_pretrained(minilm_path)
    ref = transformers.AutoTokenizer.from_pretrained(minilm_path)
    texts = ["Hello, World!", "Transformers' tokenizers are fast — naïve café.", "x"]
    pairs = ["What is it?", "a " * 300, "y"]
    b = ours.encode(texts)
    assert b.input_ids.shape[1] < 128  # the file's Fixed(128) padding is overridden
    want = ref(texts, padding="longest", return_tensors="pt")
    assert torch.equal(b.input_ids, want["input_ids"])
    pb = ours.encode(texts, pairs, max_length=64)
    pw = ref(texts, pairs, padding="longest", truncation="longest_first", max_length=64, return_tensors="pt")
    for name in ("input_ids", "token_type_ids", "attention_mask"):
        assert torch.equal(getattr(pb, name), pw[name]), name
    # vocab.txt and tokenizer.json load to the same tokenizer.
    from_txt = Tokenizer.from_vocab(f"{minilm_path}/vocab.txt")
    assert torch.equal(from_txt.encode(texts).input_ids, b.input_ids)


# ---- threads ------------------------------------------------------------------------------------------
class _Gate:
    """An HF tokenizer whose encode_batch of `long` or more inputs stops inside until `release` is set."""

    def __init__(self, hf: HFTokenizer, long: int, inside: threading.Event, release: threading.Event) -> None:
        self.hf, self.long, self.inside, self.release = hf, long, inside, release

    def encode_batch(self, inputs, *args, **kwargs):
        if len(inputs) >= self.long:
            self.inside.set()
            assert self.release.wait(30)
        return self.hf.encode_batch(inputs, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.hf, name)


WRITER_CALLS: dict[str, Callable[[Tokenizer, list[str]], object]] = {
    "lengths": lambda tok, texts: tok.lengths(texts, max_length=1 << 30),  # an index add's length check
    "token_spans": lambda tok, texts: tok.token_spans(texts),  # splitting passages
    "encode_ids": lambda tok, texts: tok.encode_ids(texts),
    "encode_unpadded": lambda tok, texts: tok.encode_unpadded(texts, max_length=8),  # encoding the documents
}


@pytest.mark.parametrize("writer_call", list(WRITER_CALLS))
def test_a_query_is_tokenized_while_another_thread_tokenizes_a_long_batch(toy, monkeypatch, writer_call):
    """A writer tokenizing a whole request used to hold a module-wide lock throughout, so a serving thread's
    query waited for all of it (1.4 s for a 1,000-document add). The writer's batch here stops half-way
    inside the HF tokenizer; the query must still be tokenized, with and without truncation."""
    inside, release = threading.Event(), threading.Event()
    gate = _Gate(toy._tok, 50, inside, release)
    toy._tok = gate  # the untruncated tokenizer, and every truncated copy made from it, stop on a long batch
    real_from_str = HFTokenizer.from_str
    monkeypatch.setattr(tokenizer_module, "HFTokenizer", types.SimpleNamespace(
        from_str=lambda text: _Gate(real_from_str(text), 50, inside, release)))
    writer = threading.Thread(target=WRITER_CALLS[writer_call], args=(toy, ["the tea is cold"] * 100))
    got: list = []
    query = threading.Thread(target=lambda: got.extend([toy.encode(["the tea"], max_length=4).input_ids.tolist(),
                                                        toy.lengths(["the hot tea"]).tolist()]))
    writer.start()
    try:
        assert inside.wait(10)
        query.start()
        query.join(5)
        assert got == [[[CLS, THE, TEA, SEP]], [5]], "the query waited for the writer's batch"
    finally:
        release.set()
        writer.join()
        if query.ident is not None:
            query.join()


def _old_path(hf: HFTokenizer, inputs: list, max_length: int | None, strategy: str = "longest_first", **kw):
    """What the tokenizer did before: set the one HF tokenizer's truncation, then encode with it."""
    if max_length:
        hf.enable_truncation(max_length=max_length, strategy=strategy)
    else:
        hf.no_truncation()
    return hf.encode_batch(inputs, **kw)


def _fields(encs) -> list:
    return [(e.ids, e.type_ids, e.offsets, e.word_ids, e.sequence_ids, bool(e.overflowing)) for e in encs]


@pytest.mark.parametrize("which", ["tiny", "minilm"])
def test_outputs_equal_the_single_mutated_tokenizer(request, tmp_path, which):
    """Truncated copies tokenize exactly as the one tokenizer whose truncation was switched before each call,
    whatever the order of calls and settings (20 lengths in a row: more than the copies a Tokenizer keeps)."""
    if which == "tiny":
        request.getfixturevalue("tiny_tokenizer").save_pretrained(str(tmp_path))
        directory = str(tmp_path)
    else:
        directory = request.getfixturevalue("minilm_path")
    tok, ref = Tokenizer.from_pretrained(directory), Tokenizer.from_pretrained(directory)._tok
    texts = ["the tea is cold", "Paris is the capital of FRANCE!", "cats", "naïve café — who wrote the book? " * 9]
    pairs = ["who wrote the book about the quick brown fox", "a", "the river flows north", "the tower " * 40]
    settings = [(9, "longest_first"), (16, "only_second"), (12, "only_first"), (64, "longest_first"), (None, "")]
    settings += [(n, "longest_first") for n in range(20, 40)] + settings
    for max_length, strategy in settings:
        if max_length is None:
            assert tok.lengths(texts, max_length=1 << 30).tolist() == [len(e.ids) for e in _old_path(ref, texts, None)]
            assert tok.encode_ids(texts) == [e.ids for e in _old_path(ref, texts, None, add_special_tokens=False)]
            assert tok.token_spans(texts) == [(e.offsets, e.word_ids)
                                             for e in _old_path(ref, texts, None, add_special_tokens=False)]
            continue
        for two in (None, pairs):
            try:
                want = _fields(_old_path(ref, list(zip(texts, two)) if two else texts, max_length, strategy))
            except Exception:  # an impossible truncation (only_second of a single text, ...) stays an error
                with pytest.raises(ValueError, match="cannot truncate"):
                    tok.encode(texts, two, max_length=max_length, truncation=strategy)
                continue
            b = tok.encode(texts, two, max_length=max_length, truncation=strategy)
            assert [row[:len(w[0])].tolist() for row, w in zip(b.input_ids, want)] == [w[0] for w in want]
            assert [row[:len(w[1])].tolist() for row, w in zip(b.token_type_ids, want)] == [w[1] for w in want]
            assert [b.offsets, b.word_ids, b.sequence_ids, b.overflowing] == [[w[k] for w in want] for k in (2, 3, 4, 5)]
            assert tok.encode_unpadded(texts, two, max_length=max_length, truncation=strategy) == (
                [w[0] for w in want], [w[1] for w in want])
    again = pickle.loads(pickle.dumps(tok))
    assert torch.equal(again.encode(texts, pairs, max_length=9).input_ids, tok.encode(texts, pairs, max_length=9).input_ids)


def test_tokenize_never_truncates_after_a_truncating_encode(toy):
    """`tokenize` (and the callers that read the HF tokenizer directly) used whatever truncation the last
    encode had left set; the untruncated tokenizer is now never changed."""
    toy.encode(["the tea is cold"], max_length=3)
    assert toy.tokenize("the tea is cold the tea is hot") == ["the", "tea", "is", "cold", "the", "tea", "is", "hot"]


# ---- CLI ----------------------------------------------------------------------------------------------
def test_cli_tokenizer_train(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The Tea is Cold\nthe tea is hot\n" * 10, encoding="utf-8")
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "60", "--out", str(out),
                 "--no-progress"]) == 0
    tok = Tokenizer.from_pretrained(str(out))
    assert tok.lowercase and tok.tokenize("TEA") == ["tea"]
    assert "vocabulary" in capsys.readouterr().out
    cased_out = tmp_path / "cased"
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "60", "--out", str(cased_out),
                 "--no-lowercase", "--no-progress"]) == 0
    cased = Tokenizer.from_pretrained(str(cased_out))
    assert not cased.lowercase and "Tea" in cased.tokenize("Tea")


def test_cli_tokenizer_bad_input(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert main(["tokenizer", "train", "--input", str(missing), "--vocab-size", "60", "--out", str(tmp_path)]) == 2
    assert "missing.txt" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    # --out a new directory: tmp_path holds the input files, which --out now refuses to mix a tokenizer into
    assert main(["tokenizer", "train", "--input", str(empty), "--vocab-size", "60", "--out",
                 str(tmp_path / "tok")]) == 2
    assert "no text" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--input", str(empty), "--vocab-size", "3", "--out", str(tmp_path)]) == 2
    assert "--vocab-size" in capsys.readouterr().err
    text = tmp_path / "t.txt"
    text.write_text("tea and cake\n", encoding="utf-8")
    for value in ("0", "-3"):  # 0 was reported as "saw no text (empty corpus?)", -3 as an OverflowError
        assert main(["tokenizer", "train", "--input", str(text), "--vocab-size", "60", "--out", str(tmp_path / "t"),
                     "--limit-alphabet", value]) == 2
        assert f"--limit-alphabet must be >= 1, got {value}" in capsys.readouterr().err


def test_a_tokenizer_from_vocab_txt_treats_special_tokens_as_transformers_does(tmp_path):
    """Built from vocab.txt, [CLS] [SEP] [MASK] were plain vocabulary: decode kept them and a literal "[MASK]"
    in text became '[', 'mask', ']' (and pretrain saved the tokenizer that way)."""
    transformers = pytest.importorskip("transformers")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[", "]", "hello", "world", "mask", "x"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    ours = Tokenizer.from_pretrained(str(tmp_path))
    ours.save_pretrained(str(tmp_path / "saved"))
    theirs = transformers.BertTokenizerFast.from_pretrained(str(tmp_path))
    text = "Hello [MASK] world [SEP] x"
    ids = theirs("hello world")["input_ids"]
    for tok in (ours, Tokenizer.from_pretrained(str(tmp_path / "saved"))):
        assert tok.tokenize(text) == theirs.tokenize(text) == ["hello", "[MASK]", "world", "[SEP]", "x"]
        assert tok.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "hello world"
        assert tok.encode([text]).input_ids.tolist() == [theirs(text)["input_ids"]]
    # a tokenizer.json whose special token has flags of its own keeps them (adding it again reset them)
    saved = json.loads((tmp_path / "saved" / "tokenizer.json").read_text(encoding="utf-8"))
    for token in saved["added_tokens"]:
        token["lstrip"] = token["content"] == "[MASK]"
    (tmp_path / "saved" / "tokenizer.json").write_text(json.dumps(saved), encoding="utf-8")
    again = Tokenizer.from_pretrained(str(tmp_path / "saved"))
    flags = {t.content: t.lstrip for t in again._tok.get_added_tokens_decoder().values()}
    assert flags["[MASK]"] is True and flags["[SEP]"] is False
