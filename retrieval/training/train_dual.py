"""Contrastive training of a dual encoder: InfoNCE over in-batch and hard negatives.

The loop, top-down:

1. read the data (BEIR qrels or {query, pos, neg} JSONL), merge mined hard
   negatives, carve a dev split out of train *by query* (seeded);
2. load the towers (`twotower.encoder.core.encode.SentenceEncoder`, shared or separate) from
   any BERT-family or sentence-transformers directory;
3. each step: a batch of B (query, positive) items with distinct positives,
   plus k hard negatives per query -> query vectors (B, H), document vectors
   (B + B*k, H) -> InfoNCE (optionally symmetric, optionally cached with
   GradCache so that B can exceed memory), AdamW with warmup + linear decay,
   gradient clipping, bf16 autocast where the hardware has it;
4. every `eval_every` steps: dev nDCG@10 of dense retrieval; the best
   checkpoint is kept (atomic swap into ``out/best``), the curve is drawn.

Under torchrun each rank takes its slice of a global batch, the embeddings of
all ranks are gathered (differentiably) into the single-batch layout, and the
gradients are averaged, so N ranks train like one process with an N times larger
batch: the gathered loss and its gradients equal one process's on the concatenated
batch (tests/retrieval/training/test_losses.py). Not bit for bit: dropout draws its
masks per rank, not as one process would for the whole batch, and sums run in another order.

Example:
    >>> cfg = DualTrainConfig(model=minilm_dir, data="data/beir-scifact", out="runs/dual")  # doctest: +SKIP
    >>> result = train_dual(cfg)                                                               # doctest: +SKIP
    >>> result.best_dir, result.best_score
    ('runs/dual/best', 0.71)
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from twotower.common.device import autocast
from twotower.common.distributed import DistInfo, average_gradients
from twotower.common.errors import check_at_least, check_setting
from twotower.encoder.training.optim import make_optimizer
from twotower.retrieval.export import write_training_args
from twotower.retrieval.training.batch_sampler import Item, UniquePositiveBatches
from twotower.retrieval.training.loop import Schedule, TrainingLoop, TrainSettings, start_run
from twotower.retrieval.training.losses.gather import gather_with_grad, rank, world_size
from twotower.retrieval.training.losses.gradcache import cached_step
from twotower.retrieval.training.losses.infonce import Temperature, info_nce
from twotower.retrieval.training.negatives import (
    add_mined_negatives,
    check_negatives_fit,
    mine_negatives,
    sample_negatives,
)
from twotower.retrieval.training.training_data import (
    TrainExample,
    TrainingSet,
    carve_dev,
    check_batch_fits,
    qrels_of,
    queries_of,
    read_training,
)

logger = logging.getLogger(__name__)


@dataclass
class DualTrainConfig(TrainSettings):
    """Settings of a dual-encoder training run. Defaults are what worked for SciFact-sized data on a CPU.

    The settings both trainers share (split, corpus, negatives, length, schedule, dev split, evaluation
    schedule) come from `TrainSettings`; these are the dual encoder's own.

    model: starting checkpoint (HF BERT-family or sentence-transformers directory).
    data: BEIR directory (uses qrels/<split>.tsv) or {query, pos, neg} JSONL; `corpus` resolves ids in JSONL.
    out: the run directory (`twotower.retrieval.training.training_run`).
    mine: "bm25" to mine negatives from ranks `mine_ranks` before training (the CLI does it only when
        `negatives` is not given).
    shared: one set of weights for both towers (separate towers double the parameters).
    freeze_documents: train the query tower only, against the starting model's document tower: the corpus
        is embedded once, every query is contrasted with the *whole corpus* (a full softmax instead of
        sampled negatives), dev evaluation is exact and cheap, and an index built with the starting model
        stays valid. Steps cost a query forward/backward only, which is what makes many epochs affordable
        on a CPU.
    pooling / normalize / query_prefix / document_prefix: None = the starting directory's settings; a start
        without sentence-transformers settings (an MLM checkpoint) gets mean pooling and normalisation, the
        cosine scores InfoNCE at temperature 0.05 assumes (`start_settings`; not with freeze_documents).
    query_max_length / doc_max_length: token caps (doc_max_length is saved with the model and used for dev
        evaluation); None = 64 / 256, or the positions the model was trained on if fewer (`start_settings`);
        train_doc_max_length: a shorter cap while training (None = doc_max_length), which cuts
        the cost of a step roughly in proportion.
    hard_negatives: k hard negatives per query (topped up with random corpus documents when a query has fewer).
    chunk_size: GradCache chunk (rows embedded at once); None = no caching.
    temperature: tau (0.05 is the usual fixed value for cosine scores); learn_temperature trains it.
    dev_pool: evaluate over the dev positives + this many other corpus documents (None = the whole corpus).
    The dev split is evaluated at step 0 too.
    """

    model: str
    data: str
    out: str
    mine: str | None = None
    mine_ranks: tuple[int, int] = (10, 100)
    shared: bool = True
    freeze_documents: bool = False
    pooling: str | None = None
    normalize: bool | None = None
    query_prefix: str | None = None
    document_prefix: str | None = None
    query_max_length: int | None = None
    doc_max_length: int | None = None
    train_doc_max_length: int | None = None
    batch_size: int = 32
    hard_negatives: int = 1
    chunk_size: int | None = None
    temperature: float = 0.05
    learn_temperature: bool = False
    symmetric: bool = False
    lr: float = 2e-5
    dev_pool: int | None = None
    eval_batch_size: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        check_setting(0 < self.temperature <= 1, "temperature", self.temperature, "--temperature",
                      "give a temperature in (0, 1]")
        check_at_least(self, 0, {"hard_negatives": "--hard-negatives", "dev_pool": "--dev-pool"})
        check_at_least(self, 1, {"batch_size": "--batch-size", "eval_batch_size": None, "chunk_size": "--grad-cache-chunk",
                                 "query_max_length": "--query-max-length", "doc_max_length": "--doc-max-length",
                                 "train_doc_max_length": "--train-doc-max-length"})


def start_settings(cfg: DualTrainConfig, say: bool = True) -> DualTrainConfig:
    """`cfg` with the settings its start decides filled in, each said in the log (`say`: rank 0) and kept in
    training_args.json. A resume takes those the command leaves unset from the run it continues (a run started
    before they were filled in recorded them unset, and must go on as it trained):

    - normalize (and pooling), where the start has no sentence-transformers settings: on (mean), except with
      freeze_documents, whose document vectors must stay the start's. Why: "the
      starting directory's settings" of an MLM checkpoint were "off" by silence, and InfoNCE at temperature
      0.05 over unnormalised dot products trained at losses of 4-15 to a tenth of the cosine run's nDCG.
    - query_max_length / doc_max_length not given: 64 / 256 (all-MiniLM-L6-v2's), capped at the positions the
      model was trained on (its tokenizer's model_max_length, its position table). Why: 256 on a model of 96
      positions failed after the step-0 evaluation had saved a best/ that read 256 tokens.
    """
    from twotower.encoder.core.checkpoint import CONFIG_NAME
    from twotower.encoder.core.config import EncoderConfig
    from twotower.encoder.core.sentence_config import read_sentence_config, transformer_dir
    from twotower.encoder.core.tokenizer import Tokenizer
    from twotower.retrieval.dual_encoder import DUAL_CONFIG_NAME

    directory = cfg.model
    if directory == "default":
        from twotower.retrieval.manifest import default_model_dir

        directory = default_model_dir()
    decided = ("pooling", "normalize", "query_max_length", "doc_max_length")
    saved = _saved_settings(cfg.out) if cfg.resume else {}
    kept = {name: saved[name] for name in decided if getattr(cfg, name) is None and name in saved}
    cfg = replace(cfg, **kept)
    unset = {name for name in decided if getattr(cfg, name) is None and name not in kept}
    changes: dict[str, object] = {}
    # (freeze_documents keeps the start's vectors as they are: an index built with it must stay valid)
    bare = (not cfg.freeze_documents and os.path.isdir(directory)
            and not os.path.isfile(os.path.join(directory, DUAL_CONFIG_NAME)) and read_sentence_config(directory) is None)
    if bare and "normalize" in unset:
        changes["normalize"] = True
    if bare and "pooling" in unset:
        changes["pooling"] = "mean"
    if {"query_max_length", "doc_max_length"} & unset:
        towers = {"query_max_length": directory, "doc_max_length": directory}
        try:  # separate towers: each length is capped by its own tower
            with open(os.path.join(directory, DUAL_CONFIG_NAME), encoding="utf-8") as f:
                named = json.load(f)
            towers = {"query_max_length": os.path.join(directory, named["query"]),
                      "doc_max_length": os.path.join(directory, named["document"])}
        except (OSError, ValueError, TypeError, KeyError):
            pass
        for name, default in (("query_max_length", 64), ("doc_max_length", 256)):
            if name not in unset:
                continue
            cap = None
            try:  # a directory that cannot be read is named by loading it (`load_towers`)
                base = transformer_dir(towers[name])
                cap = min(EncoderConfig.load(os.path.join(base, CONFIG_NAME)).max_position_embeddings,
                          Tokenizer.from_pretrained(base).model_max_length)
            except (OSError, ValueError, TypeError):
                pass
            changes[name] = default if cap is None else min(default, cap)
    # said where the start decided something a user may not expect (cosine for a bare checkpoint, lengths cut to
    # a short model); the usual lengths of a sentence encoder are a detail (logged at INFO, kept in the args)
    capped = any(changes.get(name, default) < default for name, default in (("query_max_length", 64),
                                                                           ("doc_max_length", 256)))
    if changes and say:
        why = ("the start has no sentence-transformers settings: cosine scores" if "normalize" in changes else
               "the start has no sentence-transformers settings" if bare else
               "the model reads fewer positions" if capped else "the start's defaults")
        (logger.warning if bare or capped else logger.info)(
            "train dual: %s (%s)", ", ".join(f"{k}={v}" for k, v in changes.items()), why)
    return replace(cfg, **changes)


def _saved_settings(out: str) -> dict:
    """The settings of the run a resume continues ({} when there is none: `start_run` then says why)."""
    from twotower.encoder.training.same_run import locate_state, read_saved_identity
    from twotower.retrieval.training.training_run import STATE_DIR

    state = locate_state(out, STATE_DIR)
    if state is None:
        return {}
    try:
        return read_saved_identity(state)[1]["settings"]
    except (OSError, ValueError):  # a damaged state: `start_run` names it
        return {}


@dataclass
class DualTrainResult:
    best_dir: str | None
    best_step: int
    best_score: float
    initial_score: float | None
    steps: int
    history: list[dict] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)


# ---- the model pieces --------------------------------------------------------------------------------
def load_towers(cfg: DualTrainConfig, device: torch.device):
    """A `twotower.retrieval.dual_encoder.DualEncoder` whose towers are trainable `SentenceEncoder` modules."""
    from twotower.encoder.core.sentence_config import SentenceConfig
    from twotower.retrieval.dual_encoder import DualEncoder

    dual = DualEncoder.from_pretrained(cfg.model, pooling=cfg.pooling, normalize=cfg.normalize,
                                       query_prefix=cfg.query_prefix, document_prefix=cfg.document_prefix,
                                       bf16=cfg.bf16, device=device)
    tower = dual.query_tower
    tower.sentence_config = SentenceConfig(tower.pooling, tower.normalize, cfg.doc_max_length)
    if cfg.shared and not cfg.freeze_documents:
        return dual
    if cfg.freeze_documents:
        tower.eval()
        for p in tower.parameters():
            p.requires_grad_(False)
    q = copy.deepcopy(tower)
    for p in q.parameters():
        p.requires_grad_(True)
    q.sentence_config = SentenceConfig(tower.pooling, tower.normalize, cfg.query_max_length)
    return DualEncoder(q, tower, query_prefix=dual.query_prefix, document_prefix=dual.document_prefix)


def trainable_towers(dual) -> list:
    towers = [dual.query_tower] if dual.shared else [dual.query_tower, dual.document_tower]
    return [t for t in towers if any(p.requires_grad for p in t.parameters())]


def tower_params(dual) -> list[torch.nn.Parameter]:
    return [p for t in trainable_towers(dual) for p in t.parameters()]


def _encoder_fn(tower, device: torch.device, bf16: bool):
    """Differentiable embedding of a chunk of token tensors, trimmed to the chunk's longest row."""

    def encode(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        T = int(inputs["attention_mask"].sum(dim=1).max())
        ids, mask = inputs["input_ids"][:, :T].to(device), inputs["attention_mask"][:, :T].to(device)
        with autocast(device, bf16):
            return tower(ids, mask).float()  # (n, H)

    return encode


# ---- batches -----------------------------------------------------------------------------------------
@dataclass
class Batch:
    """One global batch: B queries, their positives, and k negatives each (ids in loss layout)."""

    queries: list[str]
    positive_ids: list[str]
    negative_ids: list[str]  # B * k, query-major
    mask: torch.Tensor  # (B, B + B*k) True = another positive of the query: not a negative


def make_batch(items: Sequence[Item], examples: Sequence[TrainExample], k: int, corpus_ids: Sequence[str],
               rng: random.Random) -> tuple[Batch, int]:
    """Assemble a batch; returns it and how many negatives had to be random fill-ins.

    The layout (all positives, then negatives query-major) is also what the
    cross-rank gather produces from per-rank slices of consecutive items:
    positives of rank 0, rank 1, ...; then negatives of rank 0, rank 1, ...
    """
    queries, pos, neg, filled = [], [], [], 0
    for it in items:
        ex = examples[it.example]
        queries.append(ex.query)
        pos.append(it.positive)
        chosen, n_random = sample_negatives(ex, k, corpus_ids, rng)
        neg.extend(chosen)
        filled += n_random
    doc_ids = pos + neg
    B = len(items)
    mask = torch.zeros(B, len(doc_ids), dtype=torch.bool)
    for i, it in enumerate(items):
        own = set(examples[it.example].positives)
        for j, d in enumerate(doc_ids):
            if d in own and j != i:
                mask[i, j] = True
    return Batch(queries, pos, neg, mask), filled


# ---- the loss ----------------------------------------------------------------------------------------
def contrastive_loss(q: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, temperature: torch.Tensor,
                     mask: torch.Tensor | None, symmetric: bool) -> torch.Tensor:
    """InfoNCE of this rank's slice against the documents of every rank.

    q, pos: (b, H) this rank's queries and positives; neg: (b*k, H).  After the
    gather: queries (B, H), documents (B + B*k, H) in the global batch layout,
    `mask` (B, B + B*k).  Every rank computes the same full loss.
    """
    q_all, pos_all = gather_with_grad(q), gather_with_grad(pos)
    docs = torch.cat([pos_all, gather_with_grad(neg)]) if neg.shape[0] else pos_all
    return info_nce(q_all, docs, temperature, mask=mask, symmetric=symmetric)


def corpus_loss(q: torch.Tensor, doc_matrix: torch.Tensor, positive_ids: Sequence[str],
                examples: Sequence[TrainExample], doc_row: dict[str, int], temperature: torch.Tensor,
                symmetric: bool) -> torch.Tensor:
    """InfoNCE of each query against every corpus document (frozen vectors), other positives masked.

    q: (b, H) this rank's queries (gathered to (B, H)); doc_matrix: (N, H); positive_ids and examples
    describe the *global* batch (every rank knows it), so positives and the (B, N) mask need no exchange.
    """
    q_all = gather_with_grad(q)  # (B, H)
    B, N = q_all.shape[0], doc_matrix.shape[0]
    target = torch.tensor([doc_row[d] for d in positive_ids], device=q.device)  # (B,)
    mask = torch.zeros(B, N, dtype=torch.bool, device=q.device)
    for i, ex in enumerate(examples):
        for d in ex.positives:
            mask[i, doc_row[d]] = True
    return info_nce(q_all, doc_matrix, temperature, positive_index=target, mask=mask, symmetric=symmetric)


def _batch_step(cfg, batch, me, q_in, corpus, d_tok, document_prefix, enc_q, enc_d, temperature, device):
    """Embed this rank's queries and documents (optionally via GradCache), backpropagate the batch loss."""
    b, k = cfg.batch_size, cfg.hard_negatives
    mine_pos = batch.positive_ids[me * b:(me + 1) * b]
    mine_neg = batch.negative_ids[me * b * k:(me + 1) * b * k]
    d_texts = [document_prefix + corpus[d] for d in mine_pos + mine_neg]
    d_in = d_tok.encode(d_texts, max_length=cfg.train_doc_max_length or cfg.doc_max_length).model_inputs()
    mask = batch.mask.to(device)

    def loss_fn(reps: list[torch.Tensor]) -> torch.Tensor:
        q, d = reps
        return contrastive_loss(q, d[:b], d[b:], temperature(), mask, cfg.symmetric)

    if cfg.chunk_size:
        return cached_step([(enc_q, q_in), (enc_d, d_in)], loss_fn, cfg.chunk_size, device)
    loss = loss_fn([enc_q(q_in), enc_d(d_in)])
    loss.backward()
    return loss


def _save_document_vectors(out: str, ids: Sequence[str], matrix: torch.Tensor) -> None:
    """``document_vectors.npy`` (N, H) + ``document_ids.json``: the frozen document tower's corpus vectors.

    The document tower never changes in this mode, so these are exactly what the saved model gives;
    evaluation and indexing can reuse them instead of encoding the corpus again.
    """
    import json

    import numpy as np

    from twotower.common.atomic import atomic_path, atomic_write_text

    with atomic_path(os.path.join(out, "document_vectors.npy")) as tmp, open(tmp, "wb") as f:
        np.save(f, matrix.float().cpu().numpy())
    atomic_write_text(os.path.join(out, "document_ids.json"), json.dumps(list(ids)) + "\n")


# ---- the loop ----------------------------------------------------------------------------------------
def load_training_data(cfg: DualTrainConfig) -> TrainingSet:
    data = read_training(cfg.data, split=cfg.split, corpus_path=cfg.corpus)
    if cfg.negatives:
        data.examples = add_mined_negatives(data.examples, cfg.negatives, data.corpus, data.skipped)
    return data


def evaluate_dual(dual, dev: Sequence[TrainExample], pool: dict[str, str], batch_size: int,
                  progress: bool, doc_matrix: torch.Tensor | None = None,
                  doc_ids: Sequence[str] | None = None) -> dict[str, float]:
    """Dev nDCG@10 and recall@100 of dense retrieval over `pool`, or over precomputed corpus vectors."""
    from twotower.retrieval.training.dev_eval import dense_run, dev_metrics

    if doc_matrix is None:
        run = dense_run(dual, queries_of(dev), pool, k=100, batch_size=batch_size, progress=progress)
    else:
        queries = queries_of(dev)
        q = torch.from_numpy(dual.encode_queries(list(queries.values()), batch_size=batch_size))  # (Q, H)
        scores = q @ doc_matrix.float().cpu().T  # (Q, N)
        top = scores.topk(min(100, scores.shape[1]), dim=1)
        run = {qid: {doc_ids[j]: float(v) for v, j in zip(vals.tolist(), idx.tolist())}
               for qid, vals, idx in zip(queries, top.values, top.indices)}
    return dev_metrics(run, qrels_of(dev))


def train_dual(cfg: DualTrainConfig) -> DualTrainResult:
    """Train, evaluate on the dev split, keep the best checkpoint. See the module docstring."""
    R, me = world_size(), rank()
    cfg = start_settings(cfg, say=me == 0)
    run, rng, device, bf16 = start_run(cfg, cfg.out, enabled=me == 0, world_size=R)

    dual = load_towers(cfg, device)  # first: a bad model directory fails before any data work
    data = load_training_data(cfg)
    train, dev = carve_dev(data, cfg)
    check_batch_fits(data.source, sum(len(e.positives) for e in train), cfg.batch_size, "(query, positive) pairs",
                     ranks=R)
    if not cfg.freeze_documents:  # a frozen corpus scores every document; no negatives are drawn
        check_negatives_fit(train, len(data.corpus), cfg.hard_negatives, "--hard-negatives", cfg.hard_negatives)
    run.open()  # the inputs are read and checked: only now is an earlier run's log set aside
    if cfg.mine and not cfg.freeze_documents:  # with a frozen corpus every document is a negative already
        train = mine_negatives(train, data.corpus, run, method=cfg.mine, ranks=cfg.mine_ranks,
                               num_negatives=max(cfg.hard_negatives * 4, 8), seed=cfg.seed, progress=cfg.progress,
                               info=DistInfo(R, me))  # under torchrun: mined once, on rank 0
    if data.skipped and me == 0:  # every rank read the same data: said once
        logger.warning("training data: skipped %s", data.skipped.summary())
    run.log("data", source=data.source, train_queries=len(train), dev_queries=len(dev),
            corpus=len(data.corpus), skipped=data.skipped.as_dict(), skipped_where=data.skipped.where)
    from twotower.retrieval.training.dev_eval import dev_pool

    pool = dev_pool(data.corpus, qrels_of(dev), cfg.dev_pool, cfg.seed)

    temperature = Temperature(cfg.temperature, learn=cfg.learn_temperature).to(device)
    params = tower_params(dual)
    towers = trainable_towers(dual)
    opt = make_optimizer(torch.nn.ModuleList([*towers, temperature]), lr=cfg.lr, weight_decay=cfg.weight_decay)
    enc_q = _encoder_fn(dual.query_tower, device, bf16)
    enc_d = _encoder_fn(dual.document_tower, device, bf16)
    q_tok, d_tok = dual.query_tower.tokenizer, dual.document_tower.tokenizer

    sampler = UniquePositiveBatches(train, cfg.batch_size * R, seed=cfg.seed)
    corpus_ids = list(data.corpus)
    doc_matrix, doc_row = None, {}
    if cfg.freeze_documents:
        doc_matrix = torch.from_numpy(dual.encode_documents(
            [data.corpus[d] for d in corpus_ids], batch_size=cfg.eval_batch_size, progress=cfg.progress)).to(device)
        doc_row = {d: i for i, d in enumerate(corpus_ids)}  # (N, H) rows in corpus order
        run.log("documents_embedded", documents=len(corpus_ids))
        if me == 0 and run.enabled:
            _save_document_vectors(run.out, corpus_ids, doc_matrix)
    n_docs = len(corpus_ids) if doc_matrix is not None else len(pool)

    def save(directory: str, step: int, score: float | None = None) -> None:
        dual.save_pretrained(directory)
        # world_size: --batch-size is per rank, so the global batch (world_size x batch_size) is rebuilt from it
        write_training_args(directory, {**asdict(cfg), "world_size": R, "step": step, "dev_queries": len(dev),
                                        "dev_ndcg@10": score})

    def evaluate(step: int) -> dict:
        metrics = (evaluate_dual(dual, dev, pool, cfg.eval_batch_size, cfg.progress, doc_matrix, corpus_ids)
                   if me == 0 else {})
        if R > 1:
            import torch.distributed as dist

            dist.barrier()
        return {"pool": n_docs, **metrics}

    batches = iter(sampler)
    filled_total = 0

    def draw(done: int) -> tuple[list, Batch, int]:
        """Step `done + 1`'s global batch: its items, with their negatives drawn from `rng`."""
        nonlocal filled_total
        items = next(batches)
        k = 0 if doc_matrix is not None else cfg.hard_negatives
        batch, filled = make_batch(items, train, k, corpus_ids, rng)
        filled_total += filled
        return items, batch, filled

    def step(done: int) -> tuple[torch.Tensor, dict]:
        items, batch, filled = draw(done)
        b = cfg.batch_size
        mine_q = batch.queries[me * b:(me + 1) * b]
        q_in = q_tok.encode([dual.query_prefix + t for t in mine_q], max_length=cfg.query_max_length).model_inputs()
        if doc_matrix is not None:
            loss = corpus_loss(enc_q(q_in), doc_matrix, batch.positive_ids, [train[it.example] for it in items],
                               doc_row, temperature(), cfg.symmetric)
            loss.backward()
        else:
            loss = _batch_step(cfg, batch, me, q_in, data.corpus, d_tok, dual.document_prefix, enc_q, enc_d,
                               temperature, device)
        if R > 1:
            average_gradients(params + list(temperature.parameters()))
        return loss, {"random_negatives": filled}

    result = TrainingLoop(
        run, Schedule.of(cfg, max(1, len(sampler)), cfg.lr), opt, params, cfg.max_grad_norm, towers, step, evaluate, save,
        update_fields=lambda: {"tau": float(temperature().detach())},
        save_last=save if cfg.save_last else None, main_process=me == 0, progress=cfg.progress,
        desc="train dual", plot_title=f"dual encoder: dev nDCG@10 ({len(dev)} queries, {n_docs} documents)",
        state_module=torch.nn.ModuleList([*towers, temperature]) if cfg.resumable else None, skip=draw,
        save_every=cfg.save_every,
    ).train()
    run.finish({**result.summary(), "random_negative_fill_ins": filled_total, "skipped": data.skipped.as_dict(),
                "dev_queries": len(dev), "dev_pool": len(pool)})
    return DualTrainResult(run.final_path(result.best_dir), result.best_step, result.best_score, result.initial_score, result.steps,
                           result.history, data.skipped.as_dict())
