"""Pooling, bulk encoding, SentenceEncoder and `twotower embed`, against sentence-transformers where it applies."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from tests.encoder.task_fixtures import one_thread
from twotower.cli import main
from twotower.common.device import bf16_supported
from twotower.encoder.core.encode import SentenceEncoder, batch_spans, encode_texts, inference_copy
from twotower.encoder.core.pooling import cls_pool, max_pool, mean_pool, pool
from twotower.encoder.core.sentence_config import (
    SentenceConfig,
    module_kind,
    read_sentence_config,
    write_sentence_config,
)

TEXTS = ["the tea is cold", "hot", "", "paris is the capital of france and berlin is the capital of germany",
         "who wrote the book", "the quick brown fox jumps over the lazy dog " * 2, "cats", "the tower"]


# ---- pooling -------------------------------------------------------------------------------------------
def test_mean_pool_worked_example_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]],
                           [[5.0, 6.0], [-50.0, 9.0], [7.0, 8.0]]])  # (B=2, T=3, H=2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    torch.testing.assert_close(mean_pool(hidden, mask), torch.tensor([[2.0, 3.0], [-38 / 3, 23 / 3]]))
    assert cls_pool(hidden).tolist() == [[1.0, 2.0], [5.0, 6.0]]
    assert max_pool(hidden, mask).tolist() == [[3.0, 4.0], [7.0, 9.0]]
    with pytest.raises(ValueError, match="pooling='sum'"):
        pool(hidden, mask, "sum")


def test_pooling_matches_sentence_transformers():
    st_models = pytest.importorskip("sentence_transformers.models")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 9, 12, generator=g)  # (B, T, H)
    mask = (torch.arange(9)[None] < torch.tensor([9, 1, 4, 6, 2])[:, None]).long()
    for mode in ("mean", "cls", "max"):
        ref = st_models.Pooling(12, pooling_mode=mode)
        want = ref({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
        torch.testing.assert_close(pool(hidden, mask, mode), want, atol=1e-6, rtol=1e-6)


# ---- encode_texts --------------------------------------------------------------------------------------
def _one_by_one(model, tok, texts, poolings=("mean",), max_length=None):
    """The obvious reference: each text alone, no padding, no sorting, no bf16. -> {pooling: (N, H)}"""
    rows = {p: [] for p in poolings}
    with torch.no_grad(), one_thread():
        for t in texts:
            b = tok.encode([t], max_length=max_length)
            h, _ = model(b.input_ids, b.attention_mask, return_pooled=False)
            for p in poolings:
                rows[p].append(pool(h, b.attention_mask, p)[0].numpy())
    return {p: np.stack(r) for p, r in rows.items()}


def test_encode_texts_rows_in_input_order_and_batch_invariant(tiny_model):
    model, tok = tiny_model
    want = _one_by_one(model, tok, TEXTS, ("mean", "cls", "max"))
    threads = torch.get_num_threads()
    for pooling, bs, workers in (("mean", 1, 1), ("mean", 3, 2), ("mean", None, None), ("cls", 3, 3),
                                 ("cls", 64, 1), ("max", 2, None), ("max", None, 1)):
        got = encode_texts(model, tok, TEXTS, batch_size=bs, pooling=pooling, bf16=False, progress=False,
                           workers=workers)
        assert got.dtype == np.float32 and got.shape == (len(TEXTS), 36)
        np.testing.assert_allclose(got, want[pooling], atol=1e-5, rtol=1e-5,
                                   err_msg=f"{pooling} bs={bs} workers={workers}")
        assert torch.get_num_threads() == threads  # concurrent batches restore torch's thread count


def test_cls_pooling_runs_the_last_layer_at_cls_only(tiny_model, monkeypatch):
    """encode_texts with [CLS] pooling asks the encoder for the [CLS] state alone (the vectors themselves are
    checked against the whole forward above); other poolings need every state."""
    model, tok = tiny_model
    asked = []
    forward = type(model).forward

    def spy(self, *a, **kw):
        asked.append(kw.get("query_positions"))
        return forward(self, *a, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    encode_texts(model, tok, TEXTS[:3], batch_size=3, pooling="cls", bf16=False, progress=False, workers=1)
    assert len(asked) == 1 and torch.equal(asked[0], torch.zeros(3, 1, dtype=torch.long))
    encode_texts(model, tok, TEXTS[:3], batch_size=3, pooling="mean", bf16=False, progress=False, workers=1)
    assert asked[1] is None


def test_batch_spans_fixed_size_or_token_budget():
    lengths = np.array([600, 256, 256, 100, 30, 10])  # sorted longest first
    assert batch_spans(lengths, 4, None) == [(0, 4), (4, 6)]
    # 512 tokens: the 600-token text alone, then 2 x 256, then the rest (5 x 100 fits).
    assert batch_spans(lengths, None, 512) == [(0, 1), (1, 3), (3, 6)]
    assert batch_spans(np.array([], dtype=int), None, 512) == []


def test_encode_texts_keeps_and_trims_the_heap(tiny_model, monkeypatch):
    """Bulk encoding fixes the malloc thresholds before its forwards and offers the heap's free pages back after
    them (common/malloc.py), once a call, even when a forward fails."""
    import twotower.encoder.core.encode as module

    model, tok = tiny_model
    calls = []
    monkeypatch.setattr(module, "steady_thresholds_for", lambda device: calls.append(("steady", device.type)))
    monkeypatch.setattr(module, "trim_free_heap_for", lambda device: calls.append(("trim", device.type)))
    encode_texts(model, tok, TEXTS, bf16=False, progress=False, batch_size=2)
    assert calls == [("steady", "cpu"), ("trim", "cpu")]
    calls.clear()
    monkeypatch.setattr(module, "pool", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        encode_texts(model, tok, TEXTS, bf16=False, progress=False)
    assert calls == [("steady", "cpu"), ("trim", "cpu")]


def test_encode_texts_normalize_truncation_and_empty(tiny_model):
    model, tok = tiny_model
    v = encode_texts(model, tok, TEXTS, normalize=True, bf16=False, progress=False)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    long_text = TEXTS[5]
    capped = encode_texts(model, tok, [long_text], max_length=6, bf16=False, progress=False)
    np.testing.assert_allclose(capped, _one_by_one(model, tok, [long_text], max_length=6)["mean"], atol=1e-5)
    assert not np.allclose(capped, _one_by_one(model, tok, [long_text])["mean"], atol=1e-3)
    assert encode_texts(model, tok, [], progress=False).shape == (0, 36)
    # Texts longer than the position table are cut at it rather than crashing the forward pass.
    assert encode_texts(model, tok, ["the tea " * 100], bf16=False, progress=False).shape == (1, 36)


def test_encode_texts_bad_input(tiny_model):
    model, tok = tiny_model
    with pytest.raises(TypeError, match="list of strings"):
        encode_texts(model, tok, "one text", progress=False)
    with pytest.raises(TypeError, match=r"texts\[1\] is NoneType"):
        encode_texts(model, tok, ["a", None], progress=False)
    with pytest.raises(ValueError, match="pooling='sum'"):
        encode_texts(model, tok, ["a"], pooling="sum", progress=False)
    with pytest.raises(ValueError, match="out has shape"):
        encode_texts(model, tok, ["a"], out=np.zeros((2, 36), np.float32), progress=False)


def test_encode_texts_fills_out_and_keeps_training_mode(tiny_model, tmp_path):
    model, tok = tiny_model
    model.train()
    out = np.lib.format.open_memmap(str(tmp_path / "v.npy"), mode="w+", dtype=np.float32, shape=(len(TEXTS), 36))
    got = encode_texts(model, tok, TEXTS, bf16=False, progress=False, out=out)
    assert got is out and model.training  # dropout was off for encoding, and the caller's mode is restored
    model.eval()
    np.testing.assert_allclose(np.asarray(out), _one_by_one(model, tok, TEXTS)["mean"], atol=1e-5)


def test_inference_copy_is_cached_until_weights_change(tiny_model):
    model, _ = tiny_model
    a = inference_copy(model, torch.float64, torch.device("cpu"))
    assert a is inference_copy(model, torch.float64, torch.device("cpu"))
    assert inference_copy(model, torch.float32, torch.device("cpu")) is model
    with torch.no_grad():
        model.embeddings.word_embeddings.weight.mul_(2.0)  # an in-place update, as an optimizer step does
    b = inference_copy(model, torch.float64, torch.device("cpu"))
    assert b is not a
    torch.testing.assert_close(b.embeddings.word_embeddings.weight.float(), model.embeddings.word_embeddings.weight)


@pytest.mark.skipif(not bf16_supported("cpu"), reason="no native bf16 on this CPU")
@pytest.mark.parametrize("mode", ["weights", "autocast"])
def test_bf16_is_close_to_fp32(tiny_model, mode):
    model, tok = tiny_model
    ref = encode_texts(model, tok, TEXTS, normalize=True, bf16=False, progress=False)
    got = encode_texts(model, tok, TEXTS, normalize=True, bf16=True, bf16_mode=mode, progress=False)
    assert (got * ref).sum(1).min() > 0.999
    assert next(model.parameters()).dtype == torch.float32  # the caller's weights are never cast


# ---- sentence-transformers files and SentenceEncoder ---------------------------------------------------
def test_sentence_config_roundtrip_and_errors(tmp_path):
    write_sentence_config(str(tmp_path), SentenceConfig("cls", True, 48), dim=36, model_max_length=512)
    assert read_sentence_config(str(tmp_path)) == SentenceConfig("cls", True, 48)
    assert read_sentence_config(str(tmp_path / "none")) is None
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="modules.json: module 3 has type 'sentence_transformers.models.Dense'"):
        read_sentence_config(str(tmp_path))
    write_sentence_config(str(tmp_path), SentenceConfig("mean"), dim=36, model_max_length=512)
    pooling_path = tmp_path / "1_Pooling" / "config.json"
    cfg = json.loads(pooling_path.read_text())
    cfg["pooling_mode_cls_token"] = True
    pooling_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="1_Pooling/config.json: exactly one of"):
        read_sentence_config(str(tmp_path))
    with pytest.raises(ValueError, match="pooling='sum'"):
        SentenceConfig("sum")


def test_sentence_encoder_save_loads_in_sentence_transformers(tiny_model, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    model, tok = tiny_model
    enc = SentenceEncoder(model, tok, pooling="mean", normalize=True, max_length=20, bf16=False)
    enc.save_pretrained(str(tmp_path))
    again = SentenceEncoder.from_pretrained(str(tmp_path), bf16=False)
    assert (again.pooling, again.normalize, again.max_length) == ("mean", True, 20)
    ref = st.SentenceTransformer(str(tmp_path), device="cpu")
    assert ref.max_seq_length == 20
    want = ref.encode(TEXTS, normalize_embeddings=False)
    np.testing.assert_allclose(again.encode(TEXTS, progress=False), want, atol=1e-5)
    # forward (the training path) agrees with encode (the inference path)
    b = again.tokenize(TEXTS)
    with torch.no_grad():
        np.testing.assert_allclose(again(b.input_ids, b.attention_mask).numpy(), want, atol=1e-5)


def test_sentence_encoder_loads_older_layout_with_0_transformer_folder(tiny_model, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    model, tok = tiny_model
    SentenceEncoder(model, tok, pooling="max", max_length=24).save_pretrained(str(tmp_path / "flat"))
    root = tmp_path / "old"
    os.makedirs(root / "1_Pooling")
    os.rename(tmp_path / "flat" / "1_Pooling" / "config.json", root / "1_Pooling" / "config.json")
    modules = json.loads((tmp_path / "flat" / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (root / "modules.json").write_text(json.dumps(modules))
    os.remove(tmp_path / "flat" / "modules.json")
    os.rename(tmp_path / "flat", root / "0_Transformer")  # sentence_bert_config.json moves with the weights
    enc = SentenceEncoder.from_pretrained(str(root), bf16=False)
    assert (enc.pooling, enc.max_length) == ("max", 24)
    want = st.SentenceTransformer(str(root), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(enc.encode(TEXTS, progress=False), want, atol=1e-5)


@pytest.mark.parametrize(
    "type_name, kind",
    [
        ("sentence_transformers.models.Transformer", "Transformer"),  # 2.x-4.x, and what we write
        ("sentence_transformers.base.modules.transformer.Transformer", "Transformer"),  # 5.x and later
        ("sentence_transformers.sentence_transformer.modules.pooling.Pooling", "Pooling"),
        ("sentence_transformers.base.modules.normalize.Normalize", "Normalize"),
        ("sentence_transformers.models.Dense", None),
        ("my_package.Transformer", None),  # a class of that name outside sentence-transformers
    ],
)
def test_module_types_of_every_sentence_transformers_layout(type_name, kind):
    assert module_kind(type_name) == kind


def test_directory_saved_by_the_installed_sentence_transformers_embeds_the_same(tiny_model_dir, tmp_path):
    """A model saved by this sentence-transformers (whatever module paths it writes) gives its vectors in `embed`."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers import models

    hidden = json.loads(open(os.path.join(tiny_model_dir, "config.json")).read())["hidden_size"]
    bert = models.Transformer(tiny_model_dir, max_seq_length=12)
    ref = st.SentenceTransformer(modules=[bert, models.Pooling(hidden, "max"), models.Normalize()], device="cpu")
    saved = tmp_path / "st"
    ref.save(str(saved))
    types = [m["type"] for m in json.loads((saved / "modules.json").read_text())]
    assert [module_kind(t) for t in types] == ["Transformer", "Pooling", "Normalize"], types
    config = read_sentence_config(str(saved))
    assert (config.pooling, config.normalize) == ("max", True)
    texts = [t for t in TEXTS if t]  # long ones exceed the 12-token cap, so truncation is compared too
    inp, out = tmp_path / "in.txt", tmp_path / "out.npy"
    inp.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main(["embed", "--model", str(saved), "--input", str(inp), "--out", str(out), "--no-progress",
                 "--no-bf16"]) == 0
    want = st.SentenceTransformer(str(saved), device="cpu").encode(texts)
    np.testing.assert_allclose(np.load(out), want, atol=1e-5)
    assert SentenceEncoder.from_pretrained(str(saved)).max_length == ref.max_seq_length == 12


def test_sentence_encoder_defaults_without_st_files(tiny_model_dir):
    enc = SentenceEncoder.from_pretrained(tiny_model_dir, bf16=False)
    assert (enc.pooling, enc.normalize, enc.max_length, enc.dim) == ("mean", False, 64, 36)
    assert SentenceEncoder.from_pretrained(tiny_model_dir, pooling="cls").pooling == "cls"


# ---- all-MiniLM-L6-v2 parity ---------------------------------------------------------------------------
def _varied_texts() -> list[str]:
    long_para = ("Retrieval models map queries and documents into a shared vector space, where cosine "
                 "similarity ranks candidates; truncation decides what the encoder actually sees. ") * 12
    return ["hi", "What is the capital of France?", "naïve café — 東京 ünïcödé", "a " * 5,
            "The quick brown fox jumps over the lazy dog. " * 8, long_para, long_para[:700], "x"]


@pytest.fixture(scope="module")
def minilm_reference(minilm_path):
    st = pytest.importorskip("sentence_transformers")
    texts = _varied_texts()
    ref = st.SentenceTransformer(minilm_path, device="cpu").encode(texts, normalize_embeddings=True)
    return texts, ref


def test_minilm_reads_sentence_transformers_defaults(minilm_path):
    enc = SentenceEncoder.from_pretrained(minilm_path)
    assert (enc.pooling, enc.normalize, enc.max_length, enc.dim) == ("mean", True, 256, 384)
    assert len(enc.tokenizer.encode_unpadded([_varied_texts()[5]])[0][0]) > 256  # the sample does get truncated


def _embed(tmp_path, texts, extra) -> np.ndarray:
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    assert main(["embed", "--input", str(inp), "--out", str(out), "--no-progress", *extra]) == 0
    return np.load(out)


def test_cli_embed_matches_sentence_transformers_fp32(minilm_path, minilm_reference, tmp_path):
    texts, ref = minilm_reference
    got = _embed(tmp_path, texts, ["--model", minilm_path, "--pooling", "mean", "--normalize", "--no-bf16"])
    cos = (got * ref).sum(1)
    assert got.shape == (len(texts), 384) and cos.min() >= 0.9999, cos


def test_cli_embed_default_model_and_bf16_close(minilm_reference, tmp_path):
    texts, ref = minilm_reference
    got = _embed(tmp_path, texts, ["--pooling", "mean", "--normalize"])  # default model, bf16 where native
    cos = (got * ref).sum(1)
    assert cos.min() >= 0.9995 and cos.mean() >= 0.9999, cos


# ---- CLI input handling --------------------------------------------------------------------------------
def test_cli_embed_names_the_towers_of_a_separate_dual_encoder(tiny_model_dir, tmp_path, capsys):
    """A `train dual --separate-towers` directory has no config.json of its own: embed says which towers
    there are (it said "config file not found"), and a training run's directory names its best/."""
    import copy

    from twotower.retrieval.dual_encoder import DualEncoder

    shared = DualEncoder.from_pretrained(tiny_model_dir, bf16=False)
    DualEncoder(shared.query_tower, copy.deepcopy(shared.query_tower)).save_pretrained(str(tmp_path / "dual"))
    inp = tmp_path / "in.txt"
    inp.write_text("tea\n", encoding="utf-8")
    args = ["embed", "--input", str(inp), "--out", str(tmp_path / "v.npy"), "--no-progress", "--model"]
    assert main([*args, str(tmp_path / "dual")]) == 2
    assert (f"a dual encoder with separate query and document towers; embed with one of them: "
            f"{tmp_path / 'dual' / 'query'} or {tmp_path / 'dual' / 'document'}") in capsys.readouterr().err
    assert main([*args, str(tmp_path / "dual" / "document")]) == 0
    (tmp_path / "run").mkdir()
    (tmp_path / "dual").rename(tmp_path / "run" / "best")
    assert main([*args, str(tmp_path / "run")]) == 2
    assert f"its best checkpoint is {tmp_path / 'run' / 'best'}" in capsys.readouterr().err


def test_cli_embed_text_lines_are_the_rows_wc_counts(tmp_path):
    """One vector per line as `wc -l` counts lines: a form feed inside a line used to split it in two (str.splitlines)
    and shift every later row; a byte-order mark is not embedded; a bad byte is an error naming its line, where it
    was silently replaced."""
    from twotower.cli.embed_cmd import read_texts
    from twotower.common.errors import DataError

    path = tmp_path / "in.txt"
    path.write_bytes("\ufefffirst\nsecond\x0cpage two\n\nlast\u2028".encode("utf-8"))
    assert read_texts(str(path)) == ["first", "second\x0cpage two", "", "last\u2028"]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(DataError, match=re.escape(f"{bad}:2: not valid UTF-8")):
        read_texts(str(bad))


def test_cli_embed_jsonl_and_bad_input(tiny_model_dir, tmp_path, capsys):
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"_id": "1", "title": "Tea", "text": "is cold"}) + "\n\n"
                    + json.dumps({"text": "hot"}) + "\n", encoding="utf-8")
    out = tmp_path / "v.npy"
    args = ["embed", "--model", tiny_model_dir, "--out", str(out), "--no-progress", "--no-bf16"]
    assert main([*args, "--input", str(good), "--pooling", "cls"]) == 0
    enc = SentenceEncoder.from_pretrained(tiny_model_dir, pooling="cls", bf16=False)
    np.testing.assert_allclose(np.load(out), enc.encode(["Tea is cold", "hot"], progress=False), atol=1e-6)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n', encoding="utf-8")
    assert main([*args, "--input", str(bad)]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    no_text = tmp_path / "nt.jsonl"
    no_text.write_text('{"title": "only a title"}\n', encoding="utf-8")
    assert main([*args, "--input", str(no_text)]) == 2
    assert f"{no_text}:1: expected an object with a string field 'text'" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    assert main([*args, "--input", str(empty)]) == 2
    assert "empty input" in capsys.readouterr().err
    assert main([*args, "--input", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert main([*args, "--input", str(good), "--batch-size", "8", "--batch-tokens", "512"]) == 2  # one was ignored
    assert "give one of them" in capsys.readouterr().err
    assert main(["embed", "--model", str(tmp_path / "no_model"), "--input", str(good), "--out", str(out)]) == 2
    assert "no_model" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "never.npy")
    upper = tmp_path / "C.JSONL"  # read as JSON lines by the shared rule; it embedded the raw JSON text
    upper.write_bytes(good.read_bytes())
    assert main([*args, "--input", str(upper), "--pooling", "cls"]) == 0
    np.testing.assert_allclose(np.load(out), enc.encode(["Tea is cold", "hot"], progress=False), atol=1e-6)
    same = tmp_path / "same.npy"  # an --out that is the input replaced it
    same.write_text("green tea\n", encoding="utf-8")
    assert main(["embed", "--model", tiny_model_dir, "--input", str(same), "--out", str(same), "--no-progress"]) == 2
    assert "that is the input --input" in capsys.readouterr().err and same.read_text() == "green tea\n"
    assert main([*args, "--input", str(good), "--out", str(tmp_path / "nodir" / "v.npy")]) == 2
    assert "--out " in capsys.readouterr().err
    long = tmp_path / "long.txt"  # truncated without a word; `index build` says so
    long.write_text("tea\n" + "word " * 100 + "\n", encoding="utf-8")
    assert main([*args, "--input", str(long), "--max-length", "16"]) == 0
    assert "1 of 2 texts are longer than 16 tokens (--max-length) and were truncated" in capsys.readouterr().err
    gaps = tmp_path / "gaps.txt"  # a blank line keeps its row (row i is line i) and is said to be blank
    gaps.write_text("tea\n\ncoffee\n", encoding="utf-8")
    assert main([*args, "--input", str(gaps)]) == 0 and np.load(out).shape[0] == 3
    assert "1 of 3 texts are blank" in capsys.readouterr().err
