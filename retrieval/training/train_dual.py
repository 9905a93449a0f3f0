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
gradients are averaged, so N ranks train exactly like one process with an N
times larger batch.

Example:
    >>> cfg = DualTrainConfig(model=minilm_dir, data="data/beir-scifact", out="runs/dual")  # doctest: +SKIP
    >>> result = train_dual(cfg)                                                               # doctest: +SKIP
    >>> result.best_dir, result.best_score
    ('runs/dual/best', 0.71)
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from twotower.common.device import autocast, default_device, resolve_bf16
from twotower.common.malloc import retain_freed_memory_for
from twotower.encoder.training.optim import lr_factor, make_optimizer, set_lr
from twotower.retrieval.export import write_training_args
from twotower.retrieval.training.batch_sampler import Item, UniquePositiveBatches
from twotower.retrieval.training.losses.gather import gather_with_grad, rank, world_size
from twotower.retrieval.training.losses.gradcache import cached_step
from twotower.retrieval.training.losses.infonce import Temperature, info_nce
from twotower.retrieval.training.training_data import (
    TrainExample,
    TrainingSet,
    merge_negatives,
    qrels_of,
    queries_of,
    read_training,
    split_dev,
)
from twotower.retrieval.training.training_run import TrainingRun

logger = logging.getLogger(__name__)


@dataclass
class DualTrainConfig:
    """Settings of a dual-encoder training run. Defaults are what worked for SciFact-sized data on a CPU.

    model: starting checkpoint (HF BERT-family or sentence-transformers directory).
    data: BEIR directory (uses qrels/<split>.tsv) or {query, pos, neg} JSONL; `corpus` resolves ids in JSONL.
    negatives: JSONL of mined negatives (`twotower.retrieval.training.mining.write_mined`) to add to each query.
    mine: "bm25" to mine negatives from ranks `mine_ranks` before training (when `negatives` is not given).
    shared: one set of weights for both towers (separate towers double the parameters).
    freeze_documents: train the query tower only, against the starting model's document tower: the corpus
        is embedded once, every query is contrasted with the *whole corpus* (a full softmax instead of
        sampled negatives), dev evaluation is exact and cheap, and an index built with the starting model
        stays valid. Steps cost a query forward/backward only, which is what makes many epochs affordable
        on a CPU.
    pooling / normalize / query_prefix / doc_prefix: None = the starting directory's settings.
    query_max_length / doc_max_length: token caps (doc_max_length is saved with the model and used for dev
        evaluation); train_doc_max_length: a shorter cap while training (None = doc_max_length), which cuts
        the cost of a step roughly in proportion.
    hard_negatives: k hard negatives per query (topped up with random corpus documents when a query has fewer).
    chunk_size: GradCache chunk (rows embedded at once); None = no caching.
    temperature: tau (0.05 is the usual fixed value for cosine scores); learn_temperature trains it.
    epochs / max_steps: training length (max_steps wins); time_budget (seconds) stops early, and the
        LR schedule follows whichever of steps and time runs out first.
    dev_fraction / dev_size: dev split carved from train by query; dev_pool: evaluate over the dev
        positives + this many other corpus documents (None = the whole corpus).
    eval_every: steps between dev evaluations (None = once per epoch); eval at step 0 too.
    eval_interval_s: also evaluate when this many seconds passed since the last evaluation.
    """

    model: str
    data: str
    out: str
    split: str = "train"
    corpus: str | None = None
    negatives: str | None = None
    mine: str | None = None
    mine_ranks: tuple[int, int] = (10, 100)
    shared: bool = True
    freeze_documents: bool = False
    pooling: str | None = None
    normalize: bool | None = None
    query_prefix: str | None = None
    doc_prefix: str | None = None
    query_max_length: int = 64
    doc_max_length: int = 256
    train_doc_max_length: int | None = None
    batch_size: int = 32
    hard_negatives: int = 1
    chunk_size: int | None = None
    temperature: float = 0.05
    learn_temperature: bool = False
    symmetric: bool = False
    epochs: float = 1.0
    max_steps: int | None = None
    lr: float = 2e-5
    warmup: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    bf16: bool | str = "auto"
    seed: int = 0
    dev_fraction: float = 0.1
    dev_size: int | None = None
    dev_pool: int | None = None
    eval_every: int | None = None
    eval_interval_s: float | None = None
    eval_batch_size: int = 64
    time_budget: float | None = None
    save_last: bool = False
    progress: bool = True
    device: str | None = None
    dry_run: bool = False


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
                                       query_prefix=cfg.query_prefix, document_prefix=cfg.doc_prefix,
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
        pool = list(ex.negatives)
        chosen = rng.sample(pool, k) if len(pool) >= k else pool[:]
        while len(chosen) < k:
            d = corpus_ids[rng.randrange(len(corpus_ids))]
            if d not in ex.positives and d not in chosen:
                chosen.append(d)
                filled += 1
        neg.extend(chosen)
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


def _batch_step(cfg, batch, me, q_in, corpus, d_tok, doc_prefix, enc_q, enc_d, temperature, device):
    """Embed this rank's queries and documents (optionally via GradCache), backpropagate the batch loss."""
    b, k = cfg.batch_size, cfg.hard_negatives
    mine_pos = batch.positive_ids[me * b:(me + 1) * b]
    mine_neg = batch.negative_ids[me * b * k:(me + 1) * b * k]
    d_texts = [doc_prefix + corpus[d] for d in mine_pos + mine_neg]
    d_in = d_tok.encode(d_texts, max_length=cfg.train_doc_max_length or cfg.doc_max_length).model_inputs()
    mask = batch.mask.to(device)

    def loss_fn(reps: list[torch.Tensor]) -> torch.Tensor:
        q, d = reps
        return contrastive_loss(q, d[:b], d[b:], temperature(), mask, cfg.symmetric)

    if cfg.chunk_size:
        return cached_step([(enc_q, q_in), (enc_d, d_in)], loss_fn, cfg.chunk_size)
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


def _average_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    import torch.distributed as dist

    n = world_size()
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= n


# ---- the loop ----------------------------------------------------------------------------------------
def load_training_data(cfg: DualTrainConfig) -> TrainingSet:
    data = read_training(cfg.data, split=cfg.split, corpus_path=cfg.corpus)
    if cfg.negatives:
        from twotower.retrieval.training.mining import read_mined_negatives

        mined = read_mined_negatives(cfg.negatives)
        missing = sum(1 for ids in mined.values() for d in ids if d not in data.corpus)
        if missing:
            data.skipped.add("mined negatives missing from the corpus", cfg.negatives, missing)
            mined = {q: [d for d in ids if d in data.corpus] for q, ids in mined.items()}
        data.examples = merge_negatives(data.examples, mined)
    return data


def mine_before_training(cfg: DualTrainConfig, train: list[TrainExample], corpus: dict[str, str],
                         run: TrainingRun) -> list[TrainExample]:
    """BM25 negatives from ranks `mine_ranks`, written to ``out/negatives.jsonl`` for inspection."""
    from twotower.retrieval.training.mining import (
        MiningConfig,
        bm25_retriever,
        mine_hard_negatives,
        write_mined,
    )

    if cfg.mine != "bm25":
        raise ValueError(f"mine={cfg.mine!r}: only 'bm25' mining runs inside training; mine densely with "
                         "`twotower train mine` and pass the file as negatives")
    mcfg = MiningConfig(rank_start=cfg.mine_ranks[0], rank_end=cfg.mine_ranks[1],
                        num_negatives=max(cfg.hard_negatives * 4, 8), seed=cfg.seed)
    mined, stats = mine_hard_negatives(train, bm25_retriever(corpus), list(corpus), mcfg, progress=cfg.progress)
    if run.enabled and rank() == 0:
        write_mined(os.path.join(cfg.out, "negatives.jsonl"), mined, {"retriever": "bm25", **asdict(mcfg),
                                                                      "stats": stats.as_dict()})
    run.log("mining", retriever="bm25", **stats.as_dict())
    return merge_negatives(train, {m.query_id: m.negatives for m in mined})


def evaluate_dual(dual, dev: Sequence[TrainExample], pool: dict[str, str], batch_size: int,
                  progress: bool, doc_matrix: torch.Tensor | None = None,
                  doc_ids: Sequence[str] | None = None) -> dict[str, float]:
    """Dev nDCG@10 (+ recall@100) of dense retrieval over `pool`, or over precomputed corpus vectors."""
    from twotower.retrieval.training.dev_eval import dense_run, ndcg_at_10

    if doc_matrix is None:
        run = dense_run(dual, queries_of(dev), pool, k=100, batch_size=batch_size, progress=progress)
    else:
        queries = queries_of(dev)
        q = torch.from_numpy(dual.encode_queries(list(queries.values()), batch_size=batch_size))  # (Q, H)
        scores = q @ doc_matrix.float().cpu().T  # (Q, N)
        top = scores.topk(min(100, scores.shape[1]), dim=1)
        run = {qid: {doc_ids[j]: float(v) for v, j in zip(vals.tolist(), idx.tolist())}
               for qid, vals, idx in zip(queries, top.values, top.indices)}
    return ndcg_at_10(run, qrels_of(dev))


def train_dual(cfg: DualTrainConfig) -> DualTrainResult:
    """Train, evaluate on the dev split, keep the best checkpoint. See the module docstring."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    R, me = world_size(), rank()
    device = torch.device(cfg.device) if cfg.device else default_device()
    bf16 = resolve_bf16(cfg.bf16, device)
    retain_freed_memory_for(device)  # reuse freed activation memory across steps (common/malloc.py)
    run = TrainingRun(cfg.out, enabled=me == 0)
    run.log("config", **{k: v for k, v in asdict(cfg).items()}, world_size=R, bf16_resolved=bf16)

    dual = load_towers(cfg, device)  # first: a bad model directory fails before any data work
    data = load_training_data(cfg)
    train, dev = split_dev(data.examples, cfg.dev_fraction, cfg.seed, cfg.dev_size)
    if cfg.mine and not cfg.freeze_documents:  # with a frozen corpus every document is a negative already
        train = mine_before_training(cfg, train, data.corpus, run)
    if data.skipped:
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

    global_batch = cfg.batch_size * R
    sampler = UniquePositiveBatches(train, global_batch, seed=cfg.seed)
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * len(sampler)))
    if cfg.dry_run:
        total = 1
    eval_every = cfg.eval_every or max(1, len(sampler))
    corpus_ids = list(data.corpus)
    doc_matrix, doc_row = None, {}
    if cfg.freeze_documents:
        doc_matrix = torch.from_numpy(dual.encode_documents(
            [data.corpus[d] for d in corpus_ids], batch_size=cfg.eval_batch_size, progress=cfg.progress)).to(device)
        doc_row = {d: i for i, d in enumerate(corpus_ids)}  # (N, H) rows in corpus order
        run.log("documents_embedded", documents=len(corpus_ids))
        if me == 0 and run.enabled:
            _save_document_vectors(cfg.out, corpus_ids, doc_matrix)

    def save(directory: str) -> None:
        dual.save_pretrained(directory)
        write_training_args(directory, {**asdict(cfg), "step": step_now[0], "dev_queries": len(dev)})

    def do_eval(step: int) -> float:
        for t in towers:
            t.eval()
        metrics = (evaluate_dual(dual, dev, pool, cfg.eval_batch_size, cfg.progress, doc_matrix, corpus_ids)
                   if me == 0 else {})
        for t in towers:
            t.train()
        if R > 1:
            import torch.distributed as dist

            dist.barrier()
        if me == 0:
            n_docs = len(corpus_ids) if doc_matrix is not None else len(pool)
            run.log("eval", step=step, pool=n_docs, **metrics)
            run.plot(title=f"dual encoder: dev nDCG@10 ({len(dev)} queries, {n_docs} documents)")
        return metrics.get("ndcg@10", float("nan"))

    best = {"score": -1.0, "step": -1, "dir": None}
    step_now = [0]

    def consider(step: int, score: float) -> None:
        step_now[0] = step
        if me == 0 and score > best["score"]:
            best.update(score=score, step=step, dir=run.save_checkpoint("best", save))

    initial = do_eval(0)
    consider(0, initial)
    last_eval = [run.elapsed]
    for t in towers:
        t.train()
    bar = None
    if cfg.progress and me == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="train dual", unit="step")
    batches = iter(sampler)
    step, filled_total, stop_reason = 0, 0, "steps"
    while step < total:
        items = next(batches)
        k = 0 if doc_matrix is not None else cfg.hard_negatives
        batch, filled = make_batch(items, train, k, corpus_ids, rng)
        filled_total += filled
        b = cfg.batch_size
        mine_q = batch.queries[me * b:(me + 1) * b]
        q_in = q_tok.encode([dual.query_prefix + t for t in mine_q], max_length=cfg.query_max_length).model_inputs()
        progress = max(step / total, run.elapsed / cfg.time_budget if cfg.time_budget else 0.0)
        lr_now = cfg.lr * lr_factor(progress, warmup=cfg.warmup)
        set_lr(opt, cfg.lr, lr_factor(progress, warmup=cfg.warmup))
        if doc_matrix is not None:
            loss = corpus_loss(enc_q(q_in), doc_matrix, batch.positive_ids, [train[it.example] for it in items],
                               doc_row, temperature(), cfg.symmetric)
            loss.backward()
        else:
            loss = _batch_step(cfg, batch, me, q_in, data.corpus, d_tok, dual.document_prefix, enc_q, enc_d,
                               temperature, device)
        if R > 1:
            _average_gradients(params + list(temperature.parameters()))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            run.log("stop", step=step, reason=f"loss is {loss_value}")
            raise FloatingPointError(f"training loss became {loss_value} at step {step}; lower the learning rate")
        run.log("step", step=step, loss=loss_value, lr=lr_now, tau=float(temperature().detach()),
                grad_norm=float(grad_norm), random_negatives=filled)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
        out_of_time = cfg.time_budget is not None and run.elapsed > cfg.time_budget
        due = cfg.eval_interval_s is not None and run.elapsed - last_eval[0] > cfg.eval_interval_s
        if step % eval_every == 0 or step == total or out_of_time or due:
            consider(step, do_eval(step))
            last_eval[0] = run.elapsed
        if out_of_time:
            stop_reason = "time budget"
            break
    if bar is not None:
        bar.close()
    if cfg.save_last and me == 0:
        run.save_checkpoint("last", save)
    history = [r for r in run.records if r["event"] == "eval"]
    summary = {"best_dir": best["dir"], "best_step": best["step"], "best_dev_ndcg@10": best["score"],
               "initial_dev_ndcg@10": initial, "steps": step, "stopped_by": stop_reason,
               "random_negative_fill_ins": filled_total, "skipped": data.skipped.as_dict(),
               "dev_queries": len(dev), "dev_pool": len(pool), "seconds": round(run.elapsed, 1)}
    run.log("done", **summary)
    run.write_summary(summary)
    return DualTrainResult(best["dir"], best["step"], best["score"], initial, step, history,
                           data.skipped.as_dict())

