"""CrossEncoder: parity with transformers and sentence-transformers, ordering, truncation, bad directories."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from tests.retrieval.training_fixtures import tiny_model_dir
from twotower.retrieval.cross_encoder import CrossEncoder

PAIRS = [
    ("tea cold", "cold tea is a drink of green leaf"),
    ("gene expression", "gene expression in cancer cell " * 6),
    ("virus", "mouse virus"),
    ("heart risk", ""),
    ("drug dose trial", "a trial of drug dose in patient with high risk of lung tumor"),
]


def _spread(ce: CrossEncoder, seed: int = 1) -> CrossEncoder:
    """Random init gives near-constant logits; perturb weights so that rankings are meaningful."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ce.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return ce


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ce = _spread(CrossEncoder.from_encoder(tiny_model_dir(), device="cpu", bf16=False, max_length=48))
    out = str(tmp_path_factory.mktemp("ce") / "reranker")
    ce.save_pretrained(out)
    return ce, out


def test_saved_directory_is_hf_seq_classification(saved):
    _, out = saved
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["BertForSequenceClassification"]
    assert cfg["num_labels"] == 1 and cfg["id2label"] == {"0": "LABEL_0"}
    for name in ("model.safetensors", "tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out, name))


def test_transformers_logits_match(saved):
    transformers = pytest.importorskip("transformers")
    ce, out = saved
    hf = transformers.BertForSequenceClassification.from_pretrained(out).eval()
    assert hf.config.num_labels == 1
    enc = ce.encode_pairs([q for q, _ in PAIRS], [d for _, d in PAIRS])
    with torch.no_grad():
        ref = hf(**enc.model_inputs()).logits.squeeze(-1).numpy()
    np.testing.assert_allclose(ce.predict(PAIRS), ref, atol=1e-5)


def test_sentence_transformers_scores_and_ranking_match(saved):
    st = pytest.importorskip("sentence_transformers")
    ce, out = saved
    ours = ce.predict(PAIRS)
    assert np.ptp(ours) > 1e-2, "test needs distinct scores to compare rankings"
    # Our directory names Identity as the activation, so ST's default predict gives raw logits ...
    theirs = st.CrossEncoder(out, device="cpu").predict(PAIRS)
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    assert list(np.argsort(-theirs)) == list(np.argsort(-ours))
    # ... and forcing the activation explicitly agrees too; sigmoid (ST's num_labels=1 default) is monotone.
    explicit = st.CrossEncoder(out, device="cpu", activation_fn=torch.nn.Identity()).predict(PAIRS)
    np.testing.assert_allclose(explicit, ours, atol=1e-4)
    sig = st.CrossEncoder(out, device="cpu", activation_fn=torch.nn.Sigmoid()).predict(PAIRS)
    np.testing.assert_allclose(sig, 1 / (1 + np.exp(-ours)), atol=1e-5)


def test_round_trip_and_sentence_transformers_saved_dir(saved, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    ce, out = saved
    again = CrossEncoder.from_pretrained(out, device="cpu", bf16=False)
    np.testing.assert_allclose(again.predict(PAIRS), ce.predict(PAIRS), atol=1e-6)
    assert again.max_length == 48
    # A directory written by sentence-transformers' own save() loads too.
    st_dir = str(tmp_path / "st")
    st.CrossEncoder(out, device="cpu").save(st_dir)
    theirs = CrossEncoder.from_pretrained(st_dir, device="cpu", bf16=False)
    np.testing.assert_allclose(theirs.predict(PAIRS), ce.predict(PAIRS), atol=1e-5)


def test_order_preserved_across_batch_sizes(saved):
    ce, _ = saved
    ref = ce.predict(PAIRS, batch_size=1)
    many = PAIRS * 5
    perm = np.random.default_rng(0).permutation(len(many))
    shuffled = [many[i] for i in perm]
    got = ce.predict(shuffled, batch_size=3)
    np.testing.assert_allclose(got, np.tile(ref, 5)[perm], atol=1e-5)
    assert ce.predict([], batch_size=4).shape == (0,)


def _forward_shapes(ce: CrossEncoder, monkeypatch) -> list[tuple[int, int]]:
    """Record the (pairs, tokens) of every forward `predict` runs (its network is the fp32 model here)."""
    shapes: list[tuple[int, int]] = []
    forward = type(ce.model).forward

    def spy(net, input_ids, *args, **kwargs):
        shapes.append(tuple(input_ids.shape))
        return forward(net, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(ce.model), "forward", spy)
    return shapes


def test_default_batches_fill_a_token_budget_and_score_as_one_pair_at_a_time(saved, monkeypatch):
    """Without batch_size, each forward holds as many length-sorted pairs as fit in the CPU token budget (at
    least one): a fixed 32 pairs of 256 tokens made fp32 activations above glibc's mmap threshold, mapped and
    page-faulted afresh every forward. Scores do not depend on the batching."""
    import twotower.encoder.core.encode as module

    ce, _ = saved
    ref = ce.predict(PAIRS, batch_size=1)
    many = PAIRS * 8  # 40 pairs: the old fixed batch of 32 put up to 32 in a forward
    monkeypatch.setattr(module, "CPU_BATCH_TOKENS", 100)
    shapes = _forward_shapes(ce, monkeypatch)
    got = ce.predict(many)
    np.testing.assert_allclose(got, np.tile(ref, 8), atol=1e-5)
    assert sum(b for b, _ in shapes) == len(many)
    assert all(b * t <= 100 or b == 1 for b, t in shapes), shapes
    assert max(b for b, _ in shapes) > 1  # short pairs share a forward
    shapes.clear()
    ce.predict(many, batch_size=5)  # a given batch_size is what each forward holds, whatever the budget
    assert [b for b, _ in shapes] == [5] * 8
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        ce.predict(many, batch_size=0)


def test_predict_keeps_and_trims_the_heap(saved, monkeypatch):
    """Scoring fixes the malloc thresholds before its forwards and offers the heap's free pages back after them
    (common/malloc.py), once a call."""
    import twotower.retrieval.cross_encoder as module

    ce, _ = saved
    calls = []
    monkeypatch.setattr(module, "steady_thresholds_for", lambda device: calls.append(("steady", device.type)))
    monkeypatch.setattr(module, "trim_free_heap_for", lambda device: calls.append(("trim", device.type)))
    ce.predict(PAIRS * 3, batch_size=2)
    assert calls == [("steady", "cpu"), ("trim", "cpu")]


def test_rerank_scores_leaves_another_rerankers_batch_size_to_it():
    """A reranker from another library (sentence-transformers' `predict(pairs, batch_size=32)`) is not handed
    batch_size=None, which it cannot take; a batch size the caller gives is passed on."""
    from twotower.retrieval.rerank import rerank_scores

    class Theirs:
        def __init__(self):
            self.sizes = []

        def predict(self, pairs, batch_size=32, progress=False):
            if batch_size is None:
                raise TypeError("'<' not supported between instances of 'NoneType' and 'int'")
            self.sizes.append(batch_size)
            return np.arange(len(pairs), dtype=np.float32)

    theirs = Theirs()
    scores = rerank_scores(theirs, ["q1", "q2"], [["a", "b"], ["c"]])
    assert [s.tolist() for s in scores] == [[0.0, 1.0], [2.0]]
    rerank_scores(theirs, ["q1"], [["a"]], batch_size=7)
    assert theirs.sizes == [32, 7]


def test_rank_sorts_best_first(saved):
    ce, _ = saved
    docs = [d for _, d in PAIRS]
    scores = ce.predict([("tea cold", d) for d in docs])
    ranked = ce.rank("tea cold", docs)
    assert [i for i, _ in ranked] == list(np.argsort(-scores, kind="stable"))
    assert [s for _, s in ranked] == pytest.approx(sorted(scores, reverse=True), abs=1e-6)
    assert len(ce.rank("tea cold", docs, top_k=2)) == 2
    assert len(ce.rank("tea cold", docs, top_k=len(docs) + 3)) == len(docs)


def test_rank_refuses_a_top_k_below_one(saved):
    """top_k=-1 dropped the last document (a numpy slice) and 0 returned nothing, without a word."""
    ce, _ = saved
    docs = [d for _, d in PAIRS]
    for bad in (-1, 0, 2.0, True):
        with pytest.raises(ValueError, match=f"top_k must be None \\(all documents\\) or an int >= 1, got {bad!r}"):
            ce.rank("tea cold", docs, top_k=bad)
    assert len(ce.rank("tea cold", docs, top_k=np.int64(2))) == 2  # numpy's integers, as k takes them (`is_count`)


def test_only_the_document_is_truncated(saved):
    ce, _ = saved
    query, doc = "tea cold drink", "gene " * 200
    enc = ce.encode_pairs([query], [doc])
    ids = enc.input_ids[0][enc.attention_mask[0].bool()].tolist()
    assert len(ids) == ce.max_length
    n_query = len(ce.tokenizer.tokenize(query))
    assert ids[1:1 + n_query] == [ce.tokenizer.token_to_id(t) for t in ce.tokenizer.tokenize(query)]
    assert enc.token_type_ids[0, n_query + 2] == 1  # document starts right after [SEP]
    # A query longer than the whole budget is clipped to half of it instead of raising.
    long_query = "tea " * 100
    enc = ce.encode_pairs([long_query], ["cold"])
    assert int((enc.token_type_ids[0] == 0).sum()) == ce.max_length // 2 + 2
    assert np.isfinite(ce.predict([(long_query, "cold")])).all()


def test_bf16_close_to_fp32(saved):
    from twotower.common.device import bf16_supported

    if not bf16_supported("cpu"):
        pytest.skip("no bf16 on this CPU")
    ce, out = saved
    fast = CrossEncoder.from_pretrained(out, device="cpu", bf16=True)
    np.testing.assert_allclose(fast.predict(PAIRS), ce.predict(PAIRS), atol=0.1)


def test_bf16_copy_runs_the_head_in_fp32(saved):
    """The bf16 path on any CPU (emulated where unsupported): a bf16 copy of the encoder, an fp32 head."""
    from twotower.encoder.core.encode import inference_copy

    ce, out = saved
    fast = CrossEncoder.from_pretrained(out, device="cpu", bf16=False)
    fast.bf16 = True  # as resolve_bf16 would set it on a CPU with bf16 support
    got = fast.predict(PAIRS)
    copy = inference_copy(fast.model, torch.bfloat16, fast.device)
    assert copy.bert.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    assert copy.classifier.weight.dtype == torch.float32 and fast.classifier.weight.dtype == torch.float32
    np.testing.assert_allclose(got, ce.predict(PAIRS), atol=0.1)
    assert got.dtype == np.float32 and len(set(got.tolist())) == len(PAIRS)  # close logits are not tied


def test_bad_directories(tmp_path):
    with pytest.raises(ValueError, match="from_encoder"):
        CrossEncoder.from_pretrained(tiny_model_dir(), device="cpu")
    no_tok = tmp_path / "no_tok"
    shutil.copytree(tiny_model_dir(), no_tok)
    for name in ("tokenizer.json", "vocab.txt"):
        os.remove(no_tok / name)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        CrossEncoder.from_encoder(str(no_tok), device="cpu")
    with pytest.raises(FileNotFoundError, match="not found"):
        CrossEncoder.from_pretrained(str(tmp_path / "missing"))


def test_multi_label_checkpoint_refused(saved, tmp_path):
    _, out = saved
    three = tmp_path / "three"
    shutil.copytree(out, three)
    cfg = json.load(open(three / "config.json"))
    cfg["id2label"] = {"0": "a", "1": "b", "2": "c"}
    json.dump(cfg, open(three / "config.json", "w"))
    with pytest.raises(ValueError, match="num_labels=3"):
        CrossEncoder.from_pretrained(str(three), device="cpu")


def test_predict_scores_a_single_pair_as_a_float(saved):
    """As sentence-transformers' predict does: one (query, document) pair in, its score as a float out (it was
    refused); a list of pairs still gives an array."""
    ce, _ = saved
    batch = ce.predict(PAIRS[:2])
    for one in (PAIRS[0], list(PAIRS[0])):
        score = ce.predict(one)
        assert isinstance(score, float) and score == pytest.approx(float(batch[0]), abs=1e-5)
    titled = ce.predict(("tea cold", ("Tea", "cold tea is a drink")))
    assert isinstance(titled, float)
    with pytest.raises(TypeError, match="best_windows takes a list of .* wrap a single pair"):
        ce.best_windows(("q", "d"))


def test_repr_is_one_line(saved):
    """nn.Module's repr printed every layer of the network."""
    ce, _ = saved
    text = repr(ce)
    assert "\n" not in text and text.startswith("CrossEncoder(layers=3, hidden=32, pooling='cls', max_length=48")
    assert "device='cpu'" in text and "bf16=False" in text


def test_default_device_is_the_cpu_as_for_the_dual_encoder(saved, monkeypatch):
    """device=None picked CUDA whenever there was one, where DualEncoder and SearchPipeline run on the CPU unless
    told otherwise (it failed here on a machine whose torch sees no usable GPU)."""
    _, out = saved
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert CrossEncoder.from_pretrained(out).device == torch.device("cpu")
    assert CrossEncoder.from_pretrained(out, device=None).device == torch.device("cpu")
    assert CrossEncoder.from_encoder(tiny_model_dir(), bf16=False).device == torch.device("cpu")


def test_mean_pooled_head_scores_the_token_mean_and_round_trips(tmp_path):
    """pooling="mean": logit = classifier(mean of the real tokens' final states); saved and loaded as such."""
    from twotower.encoder.core.pooling import mean_pool

    ce = _spread(CrossEncoder.from_encoder(tiny_model_dir(), device="cpu", bf16=False, max_length=48,
                                           pooling="mean"))
    assert ce.model.pooling == "mean" and ce.bert.pooler is None
    enc = ce.encode_pairs([q for q, _ in PAIRS], [d for _, d in PAIRS]).model_inputs()
    with torch.no_grad():
        hidden, _ = ce.bert(**enc, return_pooled=False)  # (B, T, H)
        ref = ce.classifier(mean_pool(hidden, enc["attention_mask"])).squeeze(-1).numpy()  # by hand, no dropout
    scores = ce.predict(PAIRS)
    np.testing.assert_allclose(scores, ref, atol=1e-5)
    out = str(tmp_path / "mean")
    ce.save_pretrained(out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["classifier_pooling"] == "mean"
    back = CrossEncoder.from_pretrained(out, device="cpu", bf16=False)
    assert back.model.pooling == "mean"
    np.testing.assert_allclose(back.predict(PAIRS), scores, atol=1e-6)
    with pytest.raises(ValueError, match="pooling='max'"):
        CrossEncoder.from_encoder(tiny_model_dir(), device="cpu", bf16=False, pooling="max")


def test_fresh_cls_head_ignores_a_mean_pooling_source(tmp_path):
    """A mean-pooled reranker continued as an encoder gets the head asked for, not the source's pooling."""
    ce = CrossEncoder.from_encoder(tiny_model_dir(), device="cpu", bf16=False, max_length=48, pooling="mean")
    ce.save_pretrained(str(tmp_path / "mean"))
    fresh = CrossEncoder.from_encoder(str(tmp_path / "mean"), device="cpu", bf16=False)
    assert fresh.model.pooling == "cls" and fresh.bert.pooler is not None


# ---- windows (MaxP) ----------------------------------------------------------------------------------------
# Every word below is one token of the tiny vocabulary, so windows of 4 tokens every 3 are easy to write out.
TITLE, TEXT = "tea cold", "gene expression cancer cell mouse virus heart risk drug dose trial"
WINDOWS = ["gene expression cancer cell", "cell mouse virus heart", "heart risk drug dose", "dose trial"]


def _windowed(out, window=4, stride=3):
    from twotower.retrieval.cross_encoder import RerankWindows

    ce = CrossEncoder.from_pretrained(out, device="cpu", bf16=False)
    ce.windows = RerankWindows(window, stride)
    return ce


def test_windows_score_a_document_by_its_best_window(saved):
    """A (title, text) document is read as title + window, every window; its score is the best one's."""
    head, out = saved
    ce = _windowed(out)
    assert ce.document_windows([(TITLE, TEXT)]) == [[f"{TITLE} {w}" for w in WINDOWS]]
    assert ce.document_windows([TEXT]) == [WINDOWS]  # a plain string has no title to repeat
    queries = ["drug dose trial", "mouse virus", "tea cold"]
    for q in queries:
        each = head.predict([(q, f"{TITLE} {w}") for w in WINDOWS])  # the windows, scored one by one
        assert np.ptp(each) > 1e-3, "test needs windows that score differently"
        got = ce.predict([(q, (TITLE, TEXT))])
        np.testing.assert_allclose(got, [each.max()], atol=1e-5)
        assert ce.best_windows([(q, (TITLE, TEXT))]) == [f"{TITLE} {WINDOWS[int(np.argmax(each))]}"]
    # Many pairs in one call (a document repeated across queries) give each pair its own maximum.
    many = ce.predict([(q, (TITLE, TEXT)) for q in queries] + [("virus", "mouse virus")])
    np.testing.assert_allclose(many[:3], [ce.predict([(q, (TITLE, TEXT))])[0] for q in queries], atol=1e-5)
    # A document that fits one window is scored whole: windows change nothing for it.
    np.testing.assert_allclose(many[3], head.predict([("virus", "mouse virus")]), atol=1e-5)
    np.testing.assert_allclose(ce.predict([("virus", ("heart", "mouse virus"))]),
                               head.predict([("virus", "heart mouse virus")]), atol=1e-5)
    # Without windows a (title, text) document is its "title text" string.
    np.testing.assert_allclose(head.predict([("virus", (TITLE, TEXT))]), head.predict([("virus", f"{TITLE} {TEXT}")]),
                               atol=1e-6)


def test_windows_round_trip_through_config_json(saved, tmp_path):
    _, out = saved
    ce = _windowed(out)
    path = str(tmp_path / "windowed")
    ce.save_pretrained(path)
    assert json.load(open(os.path.join(path, "config.json")))["rerank_windows"] == {"window": 4, "stride": 3}
    again = CrossEncoder.from_pretrained(path, device="cpu", bf16=False)
    assert (again.windows.window, again.windows.stride) == (4, 3)
    np.testing.assert_allclose(again.predict([("drug", (TITLE, TEXT))]), ce.predict([("drug", (TITLE, TEXT))]),
                               atol=1e-6)
    # A fresh head on it reads heads again: windows belong to the trained reranker, not to its encoder.
    assert CrossEncoder.from_encoder(path, device="cpu", bf16=False).windows is None
    transformers = pytest.importorskip("transformers")
    transformers.BertForSequenceClassification.from_pretrained(path)  # the extra key does not stop other loaders


def test_bad_windows_are_refused_with_the_flag_or_the_file(saved, tmp_path):
    from twotower.retrieval.cross_encoder import RerankWindows, check_windows

    ce, out = saved
    with pytest.raises(ValueError, match="--passage-window"):
        check_windows(RerankWindows(ce.max_length, 8), ce.max_length)  # no room for the query
    with pytest.raises(ValueError, match="--passage-stride"):
        check_windows(RerankWindows(16, 17), ce.max_length)
    bad = str(tmp_path / "bad")
    shutil.copytree(out, bad)
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["rerank_windows"] = {"window": 16}
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"config\.json: rerank_windows"):
        CrossEncoder.from_pretrained(bad, device="cpu", bf16=False)
    with pytest.raises(TypeError, match="pair 1"):
        ce.predict([("q", "doc"), ("q", ("title", 3))])


def test_keep_scores_only_the_windows_bm25_ranks_best_for_the_query(saved, tmp_path):
    """keep=2: of the four windows, the two BM25 (over the document's windows) ranks best for the query count."""
    from twotower.indexing.bm25 import BM25
    from twotower.retrieval.cross_encoder import RerankWindows

    head, out = saved
    ce = _windowed(out)
    ce.windows = RerankWindows(4, 3, keep=2)
    q = "heart risk dose"  # "heart" is in windows 1 and 2, "risk" in 2, "dose" in 2 and 3: windows 2, then 1 or 3
    windows = [f"{TITLE} {w}" for w in WINDOWS]
    bm25 = BM25()
    bm25.add(["0", "1", "2", "3"], windows)
    kept = sorted(np.argsort(-bm25.score(q, ["0", "1", "2", "3"]), kind="stable")[:2])
    assert 2 in kept and 0 not in kept
    assert ce.pair_windows([(q, (TITLE, TEXT))]) == [[windows[i] for i in kept]]
    each = head.predict([(q, w) for w in windows])
    np.testing.assert_allclose(ce.predict([(q, (TITLE, TEXT))]), [each[kept].max()], atol=1e-5)
    assert ce.best_windows([(q, (TITLE, TEXT))]) == [windows[kept[int(np.argmax(each[kept]))]]]
    path = str(tmp_path / "kept")
    ce.save_pretrained(path)
    assert json.load(open(os.path.join(path, "config.json")))["rerank_windows"] == {"window": 4, "stride": 3, "keep": 2}
    assert CrossEncoder.from_pretrained(path, device="cpu", bf16=False).windows == RerankWindows(4, 3, 2)


def test_best_windows_by_bm25_takes_bm25s_first_window_without_a_forward_pass(saved, monkeypatch):
    """by="bm25": each document's window that BM25 (over its windows) ranks best for the query, the model unused;
    a document of one window is itself."""
    from twotower.indexing.bm25 import BM25
    from twotower.retrieval.cross_encoder import RerankWindows

    _, out = saved
    ce = _windowed(out)
    ce.windows = RerankWindows(4, 3, keep=2)
    windows = [f"{TITLE} {w}" for w in WINDOWS]
    bm25 = BM25()
    bm25.add(["0", "1", "2", "3"], windows)
    queries = ["heart risk dose", "mouse virus", "trial"]
    expected = [windows[int(np.argmax(bm25.score(q, ["0", "1", "2", "3"])))] for q in queries]
    assert expected == [windows[2], windows[1], windows[3]]  # the test's queries pick different windows

    def no_forward(*a, **k):
        raise AssertionError("by='bm25' ran the model")

    monkeypatch.setattr(CrossEncoder, "_score", no_forward)
    pairs = [(q, (TITLE, TEXT)) for q in queries] + [("virus", ("heart", "mouse virus"))]
    assert ce.best_windows(pairs, by="bm25") == expected + ["heart mouse virus"]
    with pytest.raises(ValueError, match="by='max'"):
        ce.best_windows(pairs, by="max")


def test_max_length_zero_is_refused_not_read_as_the_default():
    """`max_length or default` read 0 as "not given"; a given value below a pair's minimum is an error."""
    CrossEncoder.from_encoder(tiny_model_dir(), device="cpu", bf16=False, max_length=8)
    for value in (0, 7):
        with pytest.raises(ValueError, match=f"max_length={value} is too short for a query-document pair: give 8"):
            CrossEncoder.from_encoder(tiny_model_dir(), device="cpu", bf16=False, max_length=value)


@pytest.mark.parametrize("pooling, pooler", [("cls", True), ("cls", False), ("mean", True)])
def test_a_fresh_head_is_the_one_the_seed_always_drew_and_the_callers_random_stream_is_left_alone(
        tmp_path, pooling, pooler):
    """`from_encoder` reseeded torch's global generator with `seed` (0) to draw the head, so a library call reset
    its caller's random stream. The head must stay the one drawn so (the shipped reranker is rebuilt from seed 0),
    here drawn the old way beside it; the caller's stream must be where it was."""
    from safetensors.torch import load_file, save_file

    from twotower.encoder.core.config import EncoderConfig
    from twotower.encoder.core.heads import BertForSequenceClassification

    source = tiny_model_dir()
    if not pooler:  # an MLM checkpoint without pooler weights: the pooler is drawn with the head
        source = str(tmp_path / "no-pooler")
        shutil.copytree(tiny_model_dir(), source)
        weights = load_file(os.path.join(source, "model.safetensors"))
        save_file({k: v for k, v in weights.items() if "pooler" not in k}, os.path.join(source, "model.safetensors"))
    for seed in (0, 7):
        torch.manual_seed(seed)  # the old way: reseed the global generator, build the model from it
        old = BertForSequenceClassification(EncoderConfig.load(os.path.join(source, "config.json")), num_labels=1,
                                            pooling=pooling)
        torch.manual_seed(1234)
        torch.rand(5)  # the caller's stream, part way
        before = torch.get_rng_state()
        ce = CrossEncoder.from_encoder(source, device="cpu", bf16=False, seed=seed, pooling=pooling)
        assert torch.equal(torch.get_rng_state(), before)
        if not pooler:
            assert torch.equal(ce.bert.pooler.dense.weight, old.bert.pooler.dense.weight)
        assert torch.equal(ce.model.classifier.weight, old.classifier.weight), seed
        assert torch.equal(ce.model.classifier.bias, old.classifier.bias)


def test_predict_refuses_show_progress_bar_naming_progress(saved):
    """sentence-transformers' ``predict(..., show_progress_bar=True)`` was a bare TypeError."""
    ce, _ = saved
    with pytest.raises(TypeError, match=r"predict\(\) got an unexpected keyword argument 'show_progress_bar' "
                                        r"\(use progress=True\)"):
        ce.predict([("q", "d")], show_progress_bar=True)
