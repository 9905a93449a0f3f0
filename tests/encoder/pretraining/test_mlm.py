"""BertForPreTraining: sparse tied MLM head and NSP head against transformers, and HF loading of our checkpoint."""

from __future__ import annotations

import pytest
import torch

from twotower.encoder.core.checkpoint import save_pretrained
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.pretraining.masking import IGNORE_INDEX
from twotower.encoder.pretraining.mlm import BertForPreTraining

transformers = pytest.importorskip("transformers")

# BERT's modeling_test dimensions: odd sizes make shape bugs surface.
CFG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)


def _batch(B: int = 13, T: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 99, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[0, -2:] = 0
    labels = torch.full((B, T), IGNORE_INDEX)
    sel = (torch.rand(B, T, generator=g) < 0.3) & attn.bool()
    sel[1, 1] = True
    labels[sel] = ids[sel]
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    return ids, attn, labels, types


def _hf_from_ours(ours: BertForPreTraining, tmp_path, nsp: bool):
    save_pretrained(str(tmp_path), ours.config, ours.hf_state_dict(), architectures=ours.architectures)
    cls = transformers.BertForPreTraining if nsp else transformers.BertForMaskedLM
    return cls.from_pretrained(str(tmp_path)).eval()


def test_sparse_head_equals_hf_masked_lm(tmp_path):
    torch.manual_seed(0)
    ours = BertForPreTraining(EncoderConfig(**CFG)).eval()
    with torch.no_grad():  # a non-zero bias so that the bias really is compared
        ours.cls.predictions.bias.normal_()
    hf = _hf_from_ours(ours, tmp_path, nsp=False)
    ids, attn, labels, types = _batch()
    out = ours(ids, labels, attention_mask=attn, token_type_ids=types)
    ref = hf(input_ids=ids, attention_mask=attn, token_type_ids=types, labels=labels)
    sel = labels != IGNORE_INDEX
    assert out.logits.shape == (int(sel.sum()), 99)  # only the targets were predicted
    torch.testing.assert_close(out.logits, ref.logits[sel], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-5)
    # the decoder is tied to the input embedding in both
    assert hf.cls.predictions.decoder.weight.data_ptr() == hf.bert.embeddings.word_embeddings.weight.data_ptr()
    assert out.mlm_count == int(sel.sum())
    assert int(out.mlm_correct) == int((ref.logits[sel].argmax(-1) == labels[sel]).sum())


def test_nsp_head_equals_hf_for_pretraining(tmp_path):
    torch.manual_seed(1)
    ours = BertForPreTraining(EncoderConfig(**CFG), nsp=True).eval()
    hf = _hf_from_ours(ours, tmp_path, nsp=True)
    ids, attn, labels, types = _batch(seed=3)
    nsl = torch.randint(0, 2, (13,), generator=torch.Generator().manual_seed(4))
    out = ours(ids, labels, attention_mask=attn, token_type_ids=types, next_sentence_label=nsl)
    ref = hf(input_ids=ids, attention_mask=attn, token_type_ids=types, labels=labels, next_sentence_label=nsl)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    nsp_ref = torch.nn.functional.cross_entropy(ref.seq_relationship_logits, nsl)
    torch.testing.assert_close(out.nsp_loss, nsp_ref, atol=1e-6, rtol=1e-5)


def test_gradients_reach_the_tied_embedding_through_the_head():
    torch.manual_seed(0)
    m = BertForPreTraining(EncoderConfig(**CFG))
    ids, attn, labels, types = _batch()
    m(ids, labels, attention_mask=attn).loss.backward()
    names = {n for n, _ in m.named_parameters()}
    assert "cls.predictions.bias" in names and not any("decoder" in n for n in names)
    g = m.bert.embeddings.word_embeddings.weight.grad
    # rows of tokens never in the input still get gradient: only the tied decoder can give it
    unused = torch.ones(99, dtype=torch.bool)
    unused[ids.flatten()] = False
    assert g[unused].abs().sum() > 0


def test_zero_targets_raise():
    m = BertForPreTraining(EncoderConfig(**CFG))
    ids, attn, _, _ = _batch()
    with pytest.raises(ValueError, match="zero target"):
        m(ids, torch.full_like(ids, IGNORE_INDEX))


def test_target_slots_lay_each_rows_targets_out_in_order():
    from twotower.encoder.pretraining.mlm import target_slots

    labels = torch.full((3, 6), IGNORE_INDEX)
    labels[0, [1, 4]] = 7
    labels[2, [0, 2, 3, 5]] = 7  # row 1 has no target at all
    idx = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
    pos, slot = target_slots(idx, 3, 6, lead_cls=False)
    assert pos.tolist() == [[1, 4, 0, 0], [0, 0, 0, 0], [0, 2, 3, 5]]
    assert slot.tolist() == [0, 1, 8, 9, 10, 11]
    assert (pos.reshape(-1)[slot] == idx % 6).all()
    pos, slot = target_slots(idx, 3, 6, lead_cls=True)  # NSP: [CLS] first in every row, for the pooler
    assert pos[:, 0].tolist() == [0, 0, 0] and pos[2].tolist() == [0, 0, 2, 3, 5]
    assert (pos.reshape(-1)[slot] == idx % 6).all()


@pytest.mark.parametrize("nsp", [False, True])
@pytest.mark.parametrize("kw", [{}, {"norm_first": True}])
def test_sparse_last_layer_equals_the_dense_one_in_loss_and_every_gradient(nsp, kw):
    """Training step of a packed batch (block-diagonal documents, padding, uneven targets per row, one row
    without any): the sparse last layer gives the dense layer's loss, logits and parameter gradients."""
    torch.manual_seed(2)
    config = EncoderConfig(**{**CFG, "num_hidden_layers": 3, **kw})
    dense = BertForPreTraining(config, nsp=nsp, sparse_last_layer=False).train()
    sparse = BertForPreTraining(config, nsp=nsp).train()
    sparse.load_state_dict(dense.state_dict())
    ids, attn, labels, types = _batch(seed=5)
    labels[3] = IGNORE_INDEX
    labels[4, :] = ids[4, :]  # a row that is all targets
    docs = torch.zeros_like(ids)
    docs[:, 4:] = 1
    docs[0, 5:] = torch.tensor([2, 3])
    nsl = torch.randint(0, 2, (13,), generator=torch.Generator().manual_seed(1)) if nsp else None
    outs = []
    for m in (dense, sparse):
        out = m(ids, labels, attention_mask=attn, token_type_ids=types, document_ids=docs, next_sentence_label=nsl)
        out.loss.backward()
        outs.append(out)
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outs[1].loss, outs[0].loss, atol=1e-6, rtol=1e-5)
    assert int(outs[1].mlm_correct) == int(outs[0].mlm_correct)
    grads = dict(dense.named_parameters())
    for name, p in sparse.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)
