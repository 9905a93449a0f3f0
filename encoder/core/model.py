"""A BERT encoder written top-down: embeddings -> N post-LN transformer layers -> pooler.

Module and parameter names follow HF `BertModel` exactly (``embeddings.word_embeddings``,
``encoder.layer.{i}.attention.self.query`` ...), so a `state_dict` maps 1:1 onto
`model.safetensors` of any BERT-family checkpoint.  Attention goes through
`torch.nn.functional.scaled_dot_product_attention`, which picks a fused kernel
on CPU and GPU alike, except on CPU when training (`explicit_attention`: faster
there, forward and backward) and in bf16 inference (`chunked_attention`: SDPA's CPU
kernel runs bf16 at about its fp32 rate).

Attention masks (docs/architecture.md, "Attention mask"):
- padding keys are excluded; padding queries compute something finite but never
  enter a loss or a pooling;
- ``[MASK]`` is an ordinary token;
- several independent samples packed into one row are isolated by a
  block-diagonal mask built from ``document_ids`` (a [SEP] between them is not
  isolation), and their position ids restart per sample.

Padding in inference: an eval-mode, no-grad forward of a padded batch runs the position-wise work
(Q/K/V, output projection, FFN, LayerNorms: nearly all the FLOPs) on the real tokens only,
packed into one (N, H) matrix (`Unpadding`); only attention sees the padded (B, T) layout.
Row-wise ops give the same numbers either way; a batch of short queries of mixed length
spends up to half its padded FLOPs on padding (`benchmarks/embed_speed.py --queries`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.dropout import Dropout, dropout

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported; choose one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def packed_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at every new document in a packed row.

    document_ids: (B, T) int, equal ids are one sample (contiguous runs).
    returns: (B, T) long
    """
    B, T = document_ids.shape
    idx = torch.arange(T, device=document_ids.device).expand(B, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # index of the most recent start at or before each position
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx


def build_attention_mask(
    attention_mask: torch.Tensor | None, document_ids: torch.Tensor | None
) -> torch.Tensor | None:
    """Boolean SDPA mask, True = may attend.

    attention_mask: (B, T) 1 for real tokens, 0 for padding, or None (no padding)
    document_ids:   (B, T) sample id per token for packed rows, or None
    returns: None (attend everywhere: lets SDPA use its fastest kernel),
             (B, 1, 1, T) key-padding mask, or (B, 1, T, T) block-diagonal mask.
    """
    if document_ids is None:
        if attention_mask is None or bool(attention_mask.all()):
            return None
        return attention_mask.bool()[:, None, None, :]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    if attention_mask is not None:
        same = same & attention_mask.bool()[:, None, :]
    # A query always sees itself, so a padding row is never fully masked (which would give NaN).
    same = same | torch.eye(same.shape[-1], dtype=torch.bool, device=same.device)
    return same[:, None, :, :]


# Pack when more than this fraction of a batch's (B, T) positions is padding.  0: any padding (with none
# there is nothing to skip).  `benchmarks/embed_speed.py --ours fp32,fp32-padded` sets it to infinity for
# the padded baseline: SciFact claims in batches of 32 gave 1.23x fp32 and 1.20x bf16 on CPU-A (results.md).
UNPAD_MIN_PADDING = 0.0


@dataclass(frozen=True)
class Unpadding:
    """Where the real tokens of a padded (B, T) batch sit, so position-wise layers skip the padding.

    keep: (N,) long, flat indices into B*T of the positions whose attention_mask is 1.
    """

    keep: torch.Tensor
    batch: int
    length: int

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> Unpadding:
        B, T = attention_mask.shape
        return cls(attention_mask.reshape(-1).nonzero().squeeze(1), B, T)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, F) -> (N, F), the real positions in row-major order."""
        return x.reshape(self.batch * self.length, -1).index_select(0, self.keep)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(N, F) -> (B, T, F) with zeros at the padding."""
        full = x.new_zeros(self.batch * self.length, x.shape[-1]).index_copy_(0, self.keep, x)
        return full.view(self.batch, self.length, -1)


def worth_unpadding(attention_mask: torch.Tensor | None) -> bool:
    """True when enough of the batch is padding for `Unpadding` to pay (UNPAD_MIN_PADDING)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return False
    padding = attention_mask.numel() - int(attention_mask.count_nonzero())
    return padding > UNPAD_MIN_PADDING * attention_mask.numel()


class BertEmbeddings(nn.Module):
    """token + segment + learned absolute position embedding, then LayerNorm and dropout."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        # (B, T) ids -> (B, T, H)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        H, bias = config.hidden_size, config.use_bias
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query = nn.Linear(H, H, bias=bias)
        self.key = nn.Linear(H, H, bias=bias)
        self.value = nn.Linear(H, H, bias=bias)
        self.dropout_p = config.attention_probs_dropout_prob
        # (3H, H) weight and (3H,) bias for one fused projection; set only on frozen inference copies.
        self.fused_qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse_qkv(self) -> None:
        """Concatenate the Q/K/V projections into one matmul (about 5% faster inference on CPU).

        The fused tensors are plain attributes, not parameters: state_dict names
        stay HF's, and the fusion goes stale if query/key/value change later, so
        it is meant only for frozen copies (see `twotower.encoder.core.encode.inference_copy`).
        """
        w = torch.cat([self.query.weight, self.key.weight, self.value.weight]).detach().contiguous()
        b = None
        if self.query.bias is not None:
            b = torch.cat([self.query.bias, self.key.bias, self.value.bias]).detach().contiguous()
        self.fused_qkv = (w, b)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, xq: torch.Tensor | None = None,
        unpad: Unpadding | None = None,
    ) -> torch.Tensor:
        """x: (B, T, H) -> (B, T, H); with `xq` (B, M, H), the states at M query positions of each row,
        only those queries attend (to all T keys) and the result is (B, M, H); `mask` is then (B, 1, M|1, T).
        With `unpad`, x is the packed (N, H) real tokens and so is the result."""
        if unpad is not None:
            return unpad.pack(self._project_and_attend(unpad.unpack(self._qkv(x)), mask))  # (N, H)
        if xq is not None:
            return self._attend(*self._queries_and_keys(x, xq), mask)
        return self._project_and_attend(self._qkv(x), mask)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., 3H): Q, K and V side by side."""
        if self.fused_qkv is not None:
            w, b = self.fused_qkv
        else:
            # One (3H, H) projection instead of three: one GEMM, and under autocast one bf16 cast of x
            # (forward and backward) instead of three.  Gradients flow back through the cat to the
            # query / key / value parameters, whose names stay HF's.
            w = torch.cat([self.query.weight, self.key.weight, self.value.weight])  # (3H, H)
            b = None
            if self.query.bias is not None:
                b = torch.cat([self.query.bias, self.key.bias, self.value.bias])  # (3H,)
        return F.linear(x, w, b)

    def _project_and_attend(self, qkv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """(B, T, 3H) projections -> (B, T, H) attention output."""
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, nh, T, hd)
        return self._attend(q, k, v, mask, self_attention=True)

    def _queries_and_keys(
        self, x: torch.Tensor, xq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q from the M query states, K and V from all T: (B, nh, M, hd), (B, nh, T, hd) x 2."""
        (B, T, H), M = x.shape, xq.shape[1]
        if self.fused_qkv is not None:
            w, b = self.fused_qkv
            wq, bq, wkv, bkv = w[:H], None if b is None else b[:H], w[H:], None if b is None else b[H:]
        else:
            wq, bq = self.query.weight, self.query.bias
            wkv = torch.cat([self.key.weight, self.value.weight])  # (2H, H)
            bkv = None if self.key.bias is None else torch.cat([self.key.bias, self.value.bias])
        q = F.linear(xq, wq, bq).view(B, M, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, M, hd)
        kv = F.linear(x, wkv, bkv).view(B, T, 2, self.num_heads, self.head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # 2 x (B, nh, T, hd)
        return q, k, v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, self_attention: bool = False
    ) -> torch.Tensor:
        """(B, nh, Tq, hd) queries over (B, nh, T, hd) keys/values -> (B, Tq, H).  `self_attention`: query i is
        at key position i (not a chosen subset of positions)."""
        B, _, Tq, _ = q.shape
        # Training mode decides, not grad mode alone: a training-mode forward must draw the same dropout
        # with or without a graph (GradCache replays a no-grad pass with grad).
        p = self.dropout_p if self.training else 0.0
        if q.device.type == "cpu" and (self.training or torch.is_grad_enabled()):
            y = explicit_attention(q, k, v, mask, p)
        elif q.device.type == "cpu" and q.dtype in CHUNKED_ATTENTION_DTYPES:
            y = chunked_attention(q, k, v, mask, self_attention)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # (B, nh, Tq, hd)
        return y.transpose(1, 2).reshape(B, Tq, self.num_heads * self.head_dim)


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v with dropout on the probabilities, as three plain ops.

    Used for training on CPU, where it beats SDPA both ways (`benchmarks/cpu_train_kernels.py`,
    forward + backward, T = 128..512): with dropout SDPA falls back to its math path and draws the
    mask with `bernoulli_` (see encoder/core/dropout.py); without dropout its fused CPU kernel is slower
    too (2x or more at T = 128).  It keeps the (B, nh, T, T) probabilities for the backward, as SDPA's
    math path does.  Inference (eval mode, no grad) needs no such buffer: SDPA in fp32, `chunked_attention`
    in bf16 on CPU.

    q: (B, nh, Tq, hd); k, v: (B, nh, T, hd); mask: None or bool (B, 1, 1|Tq, T), True = may attend.
    returns: (B, nh, Tq, hd)
    """
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))  # (B, nh, Tq, T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = dropout(torch.softmax(scores, dim=-1), dropout_p, True)  # (B, nh, Tq, T); p == 0: identity
    return torch.matmul(probs, v)


# CPU inference in these dtypes runs `chunked_attention` instead of SDPA, whose CPU kernel does bf16 at its
# fp32 rate: +13 to +22 % bf16 reranking throughput on CPU-D; in fp32 it was no faster, so fp32 keeps SDPA
# (docs/results.md, "2x in bf16 on CPU-D").  Benchmarks empty it for the SDPA baseline (--sdpa, -sdpa).
CHUNKED_ATTENTION_DTYPES: set[torch.dtype] = {torch.bfloat16}

# Scores one step of `chunked_attention` holds: 2^20 (2 MiB in bf16), so that the scores and their softmax
# stay in cache between the three ops instead of going out to memory and back.
ATTENTION_CHUNK_SCORES = 1 << 20


def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, self_attention: bool = False,
    chunk_scores: int = ATTENTION_CHUNK_SCORES,
) -> torch.Tensor:
    """Inference attention as plain batched matmuls over a few rows at a time, each cut to its real keys.

    Why not SDPA: on CPU its fused kernel runs bf16 at about its fp32 rate (head size 32), while
    unfused attention over a whole batch sends (B, nh, T, T) scores out to memory and back.  Here
    consecutive rows go together while their scores fit in `chunk_scores`; the keys past the chunk's
    last attendable one are dropped (masked for every query, so exactly), and with `self_attention`
    (query i sits at key position i) so are the query rows past it: padding, whose output is left 0,
    finite as the mask contract asks.
    Scores and probabilities keep q's dtype, as in transformers' eager attention (the 1/sqrt(hd) scale is
    applied inside the matmul, before rounding); PyTorch's CPU softmax computes in fp32 inside either way.
    A query whose keys are all masked gives 0, as SDPA does on CPU (torch 2.13).

    q: (B, nh, Tq, hd); k, v: (B, nh, T, hd); mask: None or bool (B, 1, 1|Tq, T), True = may attend.
    returns: (B, nh, Tq, hd), a view of a (B, Tq, nh, hd) tensor, so that merging the heads is free
    """
    B, nh, Tq, hd = q.shape
    T = k.shape[2]
    out = q.new_zeros(B, Tq, nh, hd)
    if mask is None:
        ends = [T] * B
    else:
        keys = mask.reshape(B, -1, T).any(1)  # (B, T): attendable by some query
        ends = (T - keys.flip(-1).to(torch.uint8).argmax(-1)).tolist()  # last attendable key + 1 (T if none)
    scale = hd**-0.5
    b = 0
    while b < B:
        L, e = ends[b], b + 1
        while e < B:  # grow the chunk while its scores fit
            grown = max(L, ends[e])
            if (e + 1 - b) * nh * (grown if self_attention else Tq) * grown > chunk_scores:
                break
            L, e = grown, e + 1
        M, c = (L if self_attention else Tq), e - b
        m = None if mask is None else mask[b:e, :, :M if mask.shape[2] > 1 else 1, :L]
        # 3-D operands (copied where the slice needs it): a 4-D matmul of strided slices takes a slow per-matrix path
        qs = q[b:e, :, :M].reshape(c * nh, M, hd)
        ks = k[b:e, :, :L].reshape(c * nh, L, hd)
        scores = torch.baddbmm(qs.new_empty(c * nh, M, L), qs, ks.transpose(1, 2), beta=0, alpha=scale)
        scores = scores.view(c, nh, M, L)
        dead = None
        if m is not None and not bool(m.all()):
            scores.masked_fill_(~m, float("-inf"))
            dead = ~m.any(-1, keepdim=True)  # (c, 1, M|1, 1): queries with no key to attend to
        probs = torch.softmax(scores, dim=-1)
        if dead is not None and bool(dead.any()):
            probs.masked_fill_(dead, 0.0)  # a softmax over no key is NaN; SDPA gives 0
        probs = probs.view(c * nh, M, L)
        y = torch.bmm(probs, v[b:e, :, :L].reshape(c * nh, L, hd))  # (c * nh, M, hd)
        out[b:e, :M] = y.view(c, nh, M, hd).transpose(1, 2)
        b = e
    return out.transpose(1, 2)


class BertSelfOutput(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.use_bias)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)


class BertAttention(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)


class BertIntermediate(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        out = config.intermediate_size * (2 if config.ffn_type == "geglu" else 1)
        self.dense = nn.Linear(config.hidden_size, out, bias=config.use_bias)
        self.act = activation(config.hidden_act)
        self.geglu = config.ffn_type == "geglu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)  # (B, T, I) or (B, T, 2I) for GeGLU
        if self.geglu:
            a, g = h.chunk(2, dim=-1)
            return a * F.gelu(g)
        return self.act(h)


class BertOutput(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.use_bias)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)


class BertLayer(nn.Module):
    """One transformer block. Post-LN (BERT) by default; pre-LN with `norm_first`."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)
        self.norm_first = config.norm_first

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, query_positions: torch.Tensor | None = None,
        unpad: Unpadding | None = None,
    ) -> torch.Tensor:
        """x: (B, T, H) -> (B, T, H), or (B, M, H) at `query_positions` (B, M) when given: every position
        still serves as key and value, but attention output, residuals and FFN run at the M queries only.
        With `unpad`, x is the packed (N, H) real tokens of the batch and so is the result."""
        att, ffn = self.attention, self.output
        if unpad is not None:
            if self.norm_first:
                x = x + att.output.dropout(att.output.dense(att.self(att.output.LayerNorm(x), mask, unpad=unpad)))
                return x + ffn.dropout(ffn.dense(self.intermediate(ffn.LayerNorm(x))))
            x = att.output.LayerNorm(x + att.output.dropout(att.output.dense(att.self(x, mask, unpad=unpad))))
            return ffn.LayerNorm(x + ffn.dropout(ffn.dense(self.intermediate(x))))
        pos = query_positions
        index = None if pos is None else pos[..., None].expand(-1, -1, x.shape[-1])  # (B, M, H)

        def at_queries(t: torch.Tensor) -> torch.Tensor:
            return t if index is None else t.gather(1, index)  # (B, T or M, H)

        xq = at_queries(x)  # the residual stream where the output is wanted
        if self.norm_first:
            xn = att.output.LayerNorm(x)
            a = att.self(xn, mask, None if pos is None else at_queries(xn))  # (B, T or M, H)
            xq = xq + att.output.dropout(att.output.dense(a))
            return xq + ffn.dropout(ffn.dense(self.intermediate(ffn.LayerNorm(xq))))
        a = att.self(x, mask, None if pos is None else xq)  # (B, T or M, H)
        xq = att.output.LayerNorm(xq + att.output.dropout(att.output.dense(a)))
        return ffn.LayerNorm(xq + ffn.dropout(ffn.dense(self.intermediate(xq))))


class BertEncoder(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """dense + tanh on the [CLS] hidden state (input of NSP and classification heads)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))  # (B, H)


class BertModel(nn.Module):
    """The encoder. `forward` returns (last_hidden_state (B, T, H), pooled (B, H))."""

    def __init__(self, config: EncoderConfig, add_pooling_layer: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        # Pre-LN stacks end without a norm; add the final one they need.
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.norm_first else None
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """BERT's init: N(0, initializer_range) weights, zero biases, unit LayerNorm."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        return_pooled: bool = True,
        query_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encode a batch.

        input_ids:       (B, T) token ids
        attention_mask:  (B, T) 1 real / 0 padding (None: no padding)
        token_type_ids:  (B, T) segment ids (None: all 0)
        position_ids:    (B, T) (None: 0..T-1, or restarting per sample when document_ids is given)
        document_ids:    (B, T) packed-row sample ids -> block-diagonal attention
        query_positions: (B, M) long, positions in each row whose final states are wanted (MLM targets):
                         the last layer then runs its attention queries, residuals and FFN at these M
                         positions only and the hidden states returned are (B, M, H).  Exact — every
                         position still feeds the last layer's keys and values — and ~15 % fewer FLOPs
                         per pretraining step of a 4-layer model.  The pooled output needs
                         ``query_positions[:, 0] == 0`` (the [CLS] state).
        """
        B, T = input_ids.shape
        if T > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {T} exceeds max_position_embeddings={self.config.max_position_embeddings}"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if position_ids is None:
            if document_ids is not None:
                position_ids = packed_position_ids(document_ids)
            else:
                position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        mask = build_attention_mask(attention_mask, document_ids)
        x = self.embeddings(input_ids, token_type_ids, position_ids)  # (B, T, H)
        if (document_ids is None and not self.training
                and not torch.is_grad_enabled() and worth_unpadding(attention_mask)):
            # Inference only (eval mode, no grad): a training forward, even GradCache's no-grad first
            # pass, keeps the padded layout so its dropout draws replay identically with grad.
            x = self._forward_unpadded(x, mask, Unpadding.of(attention_mask), query_positions, return_pooled)
        else:
            x = self._forward_padded(x, mask, query_positions, return_pooled)
        pooled = self.pooler(x) if (self.pooler is not None and return_pooled) else None
        return x, pooled

    def _forward_unpadded(
        self, x: torch.Tensor, mask: torch.Tensor | None, unpad: Unpadding,
        query_positions: torch.Tensor | None = None, return_pooled: bool = True,
    ) -> torch.Tensor:
        """(B, T, H) embeddings -> (B, T, H) final states, every layer run on the (N, H) real tokens; with
        `query_positions`, the last layer runs padded at those positions only and the result is (B, M, H)."""
        x = unpad.pack(x)  # (N, H)
        *inner, last = self.encoder.layer
        for layer in inner:
            x = layer(x, mask, unpad=unpad)
        if query_positions is not None:
            return self._last_at_queries(unpad.unpack(x), mask, query_positions, return_pooled)  # (B, M, H)
        x = last(x, mask, unpad=unpad)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return unpad.unpack(x)  # (B, T, H), zeros at the padding

    def _forward_padded(
        self, x: torch.Tensor, mask: torch.Tensor | None, query_positions: torch.Tensor | None, return_pooled: bool
    ) -> torch.Tensor:
        """(B, T, H) embeddings -> (B, T, H) final states, or (B, M, H) at `query_positions`."""
        *inner, last = self.encoder.layer
        for layer in inner:
            x = layer(x, mask)
        if query_positions is not None:
            return self._last_at_queries(x, mask, query_positions, return_pooled)
        x = last(x, mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x

    def _last_at_queries(
        self, x: torch.Tensor, mask: torch.Tensor | None, query_positions: torch.Tensor, return_pooled: bool
    ) -> torch.Tensor:
        """The last layer (and final norm) on (B, T, H) states, at the (B, M) `query_positions` only -> (B, M, H)."""
        T = x.shape[1]
        if return_pooled and self.pooler is not None and bool((query_positions[:, 0] != 0).any()):
            raise ValueError("a pooled output needs query_positions[:, 0] == 0 (the [CLS] position)")
        if mask is not None and mask.shape[2] != 1:  # block-diagonal: the rows of the M queries
            mask = mask.gather(2, query_positions[:, None, :, None].expand(-1, 1, -1, T))  # (B, 1, M, T)
        x = self.encoder.layer[-1](x, mask, query_positions)  # (B, M, H)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token (2 per multiply-add): the dense layers plus attention scores."""
        c = self.config
        H, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
        ffn_in = I * (2 if c.ffn_type == "geglu" else 1)
        dense = 4 * H * H + H * ffn_in + I * H
        attn = 2 * seq_len * H  # QK^T and AV
        return 2.0 * L * (dense + attn)

