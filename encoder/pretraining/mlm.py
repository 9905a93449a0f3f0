"""BERT pretraining model: the encoder plus a sparse, tied MLM head and an optional NSP head.

Parameter names equal HF's `BertForPreTraining` / `BertForMaskedLM`
(``bert.*``, ``cls.predictions.transform.dense``, ``cls.predictions.transform.LayerNorm``,
``cls.predictions.bias``, ``cls.predictions.decoder`` tied to
``bert.embeddings.word_embeddings``, ``cls.seq_relationship``), so the saved
directory loads in `transformers.BertForMaskedLM.from_pretrained`.

The head is *sparse*: hidden states are gathered at the MLM targets first and
only those ~15% of positions go through transform + decoder.  The decoder is a
(H x V) matmul, the single largest cost of a small model with a 16k-30k
vocabulary, so predicting every position (as HF does) wastes ~85% of it.

So is the encoder's last layer, by default: nothing reads its output except the head
(and, with NSP, the pooler at [CLS]), so its queries, residuals and FFN run at the
targets only while every position still gives keys and values
(`BertModel.forward(query_positions=...)`).  Exact, and ~15 % fewer FLOPs per step
of a 4-layer `mini` (`benchmarks/mlm_throughput.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.model import BertModel, activation
from twotower.encoder.pretraining.fused_cross_entropy import cross_entropy_with_correct
from twotower.encoder.pretraining.masking import IGNORE_INDEX


class BertPredictionHeadTransform(nn.Module):
    """dense -> activation -> LayerNorm, applied to the gathered target states."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(h)))  # (N, H)


class BertLMPredictionHead(nn.Module):
    """transform, then the decoder whose weight *is* the input embedding matrix, plus a bias."""

    def __init__(self, config: EncoderConfig, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.word_embeddings = [word_embeddings]  # a list: not a registered sub-module, so no duplicate name
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    @property
    def decoder_weight(self) -> torch.Tensor:
        return self.word_embeddings[0].weight  # (V, H)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.transform(h), self.decoder_weight, self.bias)  # (N, V)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: EncoderConfig, word_embeddings: nn.Embedding, nsp: bool) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config, word_embeddings)
        self.seq_relationship = nn.Linear(config.hidden_size, 2) if nsp else None


@dataclass
class PretrainOutput:
    """loss = mlm_loss (+ nsp_loss); logits (N, V) at the N targets in row-major order."""

    loss: torch.Tensor
    mlm_loss: torch.Tensor
    nsp_loss: torch.Tensor | None
    logits: torch.Tensor
    targets: torch.Tensor  # (N,)
    mlm_correct: torch.Tensor  # () long
    mlm_count: int
    nsp_correct: torch.Tensor | None = None


def target_slots(idx: torch.Tensor, B: int, T: int, lead_cls: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay the flat target positions of a (B, T) batch out as per-row query slots for the last layer.

    idx: (N,) ascending flat positions (b * T + t).  Returns query_positions (B, M) — row b's targets
    in order, after position 0 when `lead_cls`; unused slots point at position 0 and are computed then
    ignored — and slot (N,), the index of each target in the flattened (B * M) output.
    """
    b, t = idx // T, idx % T
    counts = torch.bincount(b, minlength=B)  # (B,)
    lead = int(lead_cls)
    M = int(counts.max()) + lead
    first = counts.cumsum(0) - counts  # (B,) index in idx of each row's first target
    rank = torch.arange(idx.numel(), device=idx.device) - first[b] + lead  # (N,) slot within the row
    positions = torch.zeros(B, M, dtype=torch.long, device=idx.device)
    positions[b, rank] = t
    return positions, b * M + rank


class BertForPreTraining(nn.Module):
    """Encoder + MLM head (+ NSP head when `nsp`). Without NSP it is HF's `BertForMaskedLM` (no pooler).

    `sparse_last_layer=False` computes the last layer at every position (the same result, more work).
    """

    def __init__(self, config: EncoderConfig, nsp: bool = False, sparse_last_layer: bool = True) -> None:
        super().__init__()
        self.config = config
        self.nsp = nsp
        self.sparse_last_layer = sparse_last_layer
        self.bert = BertModel(config, add_pooling_layer=nsp)
        self.cls = BertPreTrainingHeads(config, self.bert.embeddings.word_embeddings, nsp)
        self.cls.apply(self.bert._init_weights)
        nn.init.zeros_(self.cls.predictions.bias)

    @property
    def architectures(self) -> list[str]:
        return ["BertForPreTraining"] if self.nsp else ["BertForMaskedLM"]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """State with HF names; the tied decoder weight is omitted (HF re-ties it on load)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("cls.predictions.decoder")}

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
    ) -> PretrainOutput:
        """input_ids, labels (-100 off-target), attention_mask, token_type_ids, document_ids: (B, T);
        next_sentence_label: (B,) 0 = B follows A, 1 = random (HF convention)."""
        flat_labels = labels.reshape(-1)
        idx = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)  # (N,)
        if idx.numel() == 0:
            raise ValueError("MLM batch has zero target positions (every label is -100); nothing to predict")
        positions, slot = None, idx
        if self.sparse_last_layer:
            positions, slot = target_slots(idx, *labels.shape, lead_cls=self.nsp)  # (B, M), (N,)
        hidden, pooled = self.bert(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, document_ids=document_ids,
            return_pooled=self.nsp, query_positions=positions,
        )  # (B, M or T, H), (B, H)
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, slot)  # (N, H): gather first ...
        logits = self.cls.predictions(h)  # (N, V) ... then transform + tied decoder
        targets = flat_labels.index_select(0, idx)
        # Loss and accuracy from one fp32 log-softmax (encoder/pretraining/fused_cross_entropy.py).
        mlm_loss, correct = cross_entropy_with_correct(logits, targets)
        loss, nsp_loss, nsp_correct = mlm_loss, None, None
        if self.nsp:
            if next_sentence_label is None:
                raise ValueError("NSP model needs next_sentence_label")
            nsp_logits = self.cls.seq_relationship(pooled)  # (B, 2)
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label)
            nsp_correct = (nsp_logits.argmax(-1) == next_sentence_label).sum()
            loss = mlm_loss + nsp_loss
        return PretrainOutput(loss=loss, mlm_loss=mlm_loss, nsp_loss=nsp_loss, logits=logits, targets=targets,
                              mlm_correct=correct, mlm_count=int(idx.numel()), nsp_correct=nsp_correct)
