"""Training a cross-encoder reranker: listwise groups or pointwise pairs, negatives from the first stage.

The loop, top-down:

1. read labeled pairs (TSV/JSONL), a BEIR directory, or {query, pos, neg} JSONL;
   carve a dev split by query (seeded);
2. negatives: a mined JSONL file, or mined here from the first stage (BM25) so that the
   reranker learns to separate exactly the documents it will be shown;
3. the model: `CrossEncoder.from_encoder` (a fresh head on any encoder checkpoint)
   or `CrossEncoder.from_pretrained` (continue a reranker);
4. each step: listwise softmax cross-entropy over groups (1 positive + n
   negatives, `twotower.retrieval.training.losses.listwise`) or pointwise BCE on labeled pairs
   (`twotower.retrieval.training.losses.pointwise`); AdamW, warmup + linear decay, clipping, bf16 autocast;
5. dev evaluation: nDCG@10 after reranking each dev query's first-stage top-k
   (default 100); the best checkpoint is kept (atomic swap into ``out/best``).

A collapse guard watches the scores: a cross-encoder whose outputs become (nearly)
constant ranks at random while its loss can still look fine (pointwise BCE can be
minimised by predicting the base rate).  When the spread of dev scores, or of the
training logits over a window of steps, falls below `collapse_std`, training stops
and the summary says why.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from twotower.common.device import autocast, default_device
from twotower.common.malloc import retain_freed_memory_for
from twotower.encoder.training.optim import lr_factor, param_groups
from twotower.retrieval.cross_encoder import CrossEncoder
from twotower.retrieval.export import write_training_args
from twotower.retrieval.interpolation import choose_alpha, write_alpha
from twotower.retrieval.training.losses.listwise import listwise_ce
from twotower.retrieval.training.losses.pointwise import pointwise_bce
from twotower.retrieval.training.training_data import (
    LabeledPair,
    PairSet,
    TrainExample,
    TrainingSet,
    merge_negatives,
    pairs_from_training,
    qrels_of,
    queries_of,
    read_labeled_pairs,
    read_training,
    split_dev,
    training_from_pairs,
)
from twotower.retrieval.training.training_run import TrainingRun

logger = logging.getLogger(__name__)

LOSSES = ("listwise", "pointwise")


@dataclass
class RerankerTrainConfig:
    """Settings of a reranker training run.

    model: encoder checkpoint (a fresh relevance head is added) or a reranker directory (continued).
    pairs: labeled pairs .tsv/.jsonl ({query, passage, label}), a BEIR directory, or {query, pos, neg} JSONL.
    negatives: mined JSONL (`twotower.retrieval.training.mining.write_mined`); else `mine` ("bm25") mines ranks `mine_ranks`.
    first_stage: TREC run covering the dev queries (their top-k is reranked at evaluation);
        None = BM25 over the corpus.
    loss: "listwise" (group_size = 1 positive + group_size-1 negatives) or "pointwise" (BCE on pairs).
    batch_size: groups per step (listwise) or pairs per step (pointwise).
    head_lr_scale: learning-rate multiplier for the fresh head (pooler + classifier). A new head on an
        encoder whose [CLS] barely varies starts with near-constant scores; at the encoder's learning rate
        it takes hundreds of steps to move, which a CPU budget cannot spare.
    dev_rerank_k: first-stage depth reranked at dev evaluation (100 as at test time; lower is cheaper).
    eval_at_start: evaluate the untrained model too (a fresh head ranks at random: skip it to save time).
    collapse_std: stop when the standard deviation of scores falls below this.
    """

    model: str
    pairs: str
    out: str
    split: str = "train"
    corpus: str | None = None
    negatives: str | None = None
    mine: str | None = "bm25"
    mine_ranks: tuple[int, int] = (1, 100)
    first_stage: str | None = None
    loss: str = "listwise"
    group_size: int = 8
    batch_size: int = 4
    max_length: int = 256
    lr: float = 3e-5
    head_lr_scale: float = 20.0
    warmup: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    epochs: float = 1.0
    max_steps: int | None = None
    time_budget: float | None = None
    bf16: bool | str = "auto"
    seed: int = 0
    dev_fraction: float = 0.1
    dev_size: int | None = None
    dev_rerank_k: int = 100
    eval_every: int | None = None
    eval_interval_s: float | None = None
    eval_batch_size: int = 32
    eval_at_start: bool = True
    collapse_std: float = 1e-3
    collapse_window: int = 20
    save_last: bool = False
    progress: bool = True
    device: str | None = None
    dry_run: bool = False

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss={self.loss!r}; choose one of {LOSSES}")
        if self.loss == "listwise" and self.group_size < 2:
            raise ValueError("listwise groups need at least one negative: group_size >= 2")


@dataclass
class RerankerTrainResult:
    best_dir: str | None
    best_step: int
    best_score: float
    initial_score: float | None
    first_stage_score: float
    steps: int
    stopped_by: str
    history: list[dict] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)


class ScoreCollapse(RuntimeError):
    """The reranker's scores no longer vary: it cannot rank."""


# ---- data --------------------------------------------------------------------------------------------
def load_reranker_data(cfg: RerankerTrainConfig) -> tuple[TrainingSet, PairSet | None]:
    """(grouped examples, original labeled pairs or None). Labeled-pair files keep their graded labels."""
    src = cfg.pairs
    is_pairs = os.path.isfile(src) and (src.endswith(".tsv") or (src.endswith(".jsonl") and _looks_like_pairs(src)))
    if is_pairs:
        pairs = read_labeled_pairs(src)
        return training_from_pairs(pairs), pairs
    data = read_training(src, split=cfg.split, corpus_path=cfg.corpus)
    return data, None


def _looks_like_pairs(path: str) -> bool:

    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False  # let the reader report the line
                return isinstance(obj, dict) and "label" in obj
    return False


def first_stage_run(cfg: RerankerTrainConfig, dev: Sequence[TrainExample], corpus: dict[str, str],
                    k: int) -> dict[str, dict[str, float]]:
    """The dev queries' first-stage candidates: from `cfg.first_stage` (TREC run) or BM25."""
    if cfg.first_stage:
        from twotower.eval.io.trec import read_trec_run

        run = read_trec_run(cfg.first_stage)
        missing = [e.query_id for e in dev if e.query_id not in run]
        if missing:
            raise ValueError(f"{cfg.first_stage}: {len(missing)} dev queries have no first-stage results, "
                             f"e.g. {missing[:3]}")
        unknown = {d for e in dev for d in run[e.query_id] if d not in corpus}
        if unknown:
            raise ValueError(f"{cfg.first_stage}: {len(unknown)} documents are not in the corpus, "
                             f"e.g. {sorted(unknown)[:3]}")
        return {e.query_id: dict(run[e.query_id]) for e in dev}
    from twotower.retrieval.training.mining import bm25_retriever

    hits = bm25_retriever(corpus)([e.query for e in dev], k)
    return {e.query_id: dict(h) for e, h in zip(dev, hits)}


def mine_for_reranker(cfg: RerankerTrainConfig, train: list[TrainExample], corpus: dict[str, str],
                      run: TrainingRun) -> list[TrainExample]:
    from twotower.retrieval.training.mining import (
        MiningConfig,
        bm25_retriever,
        mine_hard_negatives,
        write_mined,
    )

    if cfg.mine != "bm25":
        raise ValueError(f"mine={cfg.mine!r}: only 'bm25' runs inside training; pass other negatives as a file")
    mcfg = MiningConfig(rank_start=cfg.mine_ranks[0], rank_end=cfg.mine_ranks[1],
                        num_negatives=max(4 * (cfg.group_size - 1), 16), seed=cfg.seed)
    mined, stats = mine_hard_negatives(train, bm25_retriever(corpus), list(corpus), mcfg, progress=cfg.progress)
    if run.enabled:
        write_mined(os.path.join(cfg.out, "negatives.jsonl"), mined,
                    {"retriever": "bm25", **asdict(mcfg), "stats": stats.as_dict()})
    run.log("mining", retriever="bm25", **stats.as_dict())
    return merge_negatives(train, {m.query_id: m.negatives for m in mined})


# ---- batches -----------------------------------------------------------------------------------------
def listwise_batches(train: Sequence[TrainExample], corpus_ids: Sequence[str], group_size: int,
                     batch_size: int, rng: random.Random):
    """Endless groups: (query, [positive, n negatives]) with n = group_size - 1, one group per labelled pair.

    A query short of mined negatives is topped up with random corpus documents (counted).
    """
    items = [(i, p) for i, e in enumerate(train) for p in e.positives]
    n = group_size - 1
    while True:
        rng.shuffle(items)
        for s in range(0, len(items) - batch_size + 1, batch_size):
            groups, filled = [], 0
            for i, p in items[s:s + batch_size]:
                ex = train[i]
                pool = list(ex.negatives)
                neg = rng.sample(pool, n) if len(pool) >= n else pool[:]
                while len(neg) < n:
                    d = corpus_ids[rng.randrange(len(corpus_ids))]
                    if d not in ex.positives and d not in neg:
                        neg.append(d)
                        filled += 1
                groups.append((ex.query, [p, *neg]))
            yield groups, filled


def pointwise_batches(pairs: Sequence[LabeledPair], batch_size: int, rng: random.Random):
    order = list(range(len(pairs)))
    while True:
        rng.shuffle(order)
        for s in range(0, len(order) - batch_size + 1, batch_size):
            yield [pairs[i] for i in order[s:s + batch_size]]


def make_head_optimizer(model: CrossEncoder, lr: float, weight_decay: float, head_scale: float):
    """AdamW (no decay on biases / norms, as `twotower.encoder.training.optim`) with the head (pooler + classifier) at head_scale x lr."""
    head = torch.nn.ModuleList([model.bert.pooler, model.classifier])
    head_ids = {id(p) for p in head.parameters()}
    body = [(n, p) for n, p in model.named_parameters() if id(p) not in head_ids]
    groups = []
    for scale, named in ((1.0, body), (head_scale, list(head.named_parameters()))):
        holder = torch.nn.Module()
        for i, (name, p) in enumerate(named):
            holder.register_parameter(f"p{i}_{name.replace('.', '_')}", p)
        for g in param_groups(holder, weight_decay):
            if g["params"]:
                groups.append({**g, "lr": lr * scale, "lr_scale": scale})
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-6)


# ---- the loop ----------------------------------------------------------------------------------------
def load_reranker(cfg: RerankerTrainConfig, device: torch.device) -> CrossEncoder:
    """Continue a reranker directory (it has a classifier head) or start a fresh head on an encoder."""
    from safetensors import safe_open

    path = os.path.join(cfg.model, "model.safetensors")
    has_head = False
    if os.path.isfile(path):
        with safe_open(path, framework="pt") as f:
            has_head = "classifier.weight" in f.keys()
    make = CrossEncoder.from_pretrained if has_head else CrossEncoder.from_encoder
    return make(cfg.model, device=device, max_length=cfg.max_length, bf16=cfg.bf16)


def train_reranker(cfg: RerankerTrainConfig) -> RerankerTrainResult:
    """Train, evaluate on the dev split by reranking its first stage, keep the best. See the module docstring."""
    from twotower.retrieval.training.dev_eval import ndcg_at_10, rerank_run

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    device = torch.device(cfg.device) if cfg.device else default_device()
    retain_freed_memory_for(device)  # reuse freed activation memory across steps (common/malloc.py)
    run = TrainingRun(cfg.out)
    run.log("config", **asdict(cfg))

    model = load_reranker(cfg, device)  # first: a bad model directory fails before any data work
    data, labeled = load_reranker_data(cfg)
    train, dev = split_dev(data.examples, cfg.dev_fraction, cfg.seed, cfg.dev_size)
    corpus = data.corpus
    if cfg.negatives:
        from twotower.retrieval.training.mining import read_mined_negatives

        mined = read_mined_negatives(cfg.negatives)
        missing = sum(1 for ids in mined.values() for d in ids if d not in corpus)
        if missing:
            data.skipped.add("mined negatives missing from the corpus", cfg.negatives, missing)
        train = merge_negatives(train, {q: [d for d in ids if d in corpus] for q, ids in mined.items()})
    elif cfg.mine and cfg.loss == "listwise":
        train = mine_for_reranker(cfg, train, corpus, run)
    if data.skipped:
        logger.warning("training data: skipped %s", data.skipped.summary())
    dev_ids = {e.query_id for e in dev}
    if labeled is not None and cfg.loss == "pointwise":
        train_pairs = [p for p in labeled.pairs if p.query_id not in dev_ids]
        scale = labeled.max_label
    else:
        train_pairs = pairs_from_training(TrainingSet(train, corpus, data.skipped, data.source)).pairs
        scale = 1.0
    run.log("data", source=data.source, train_queries=len(train), dev_queries=len(dev), corpus=len(corpus),
            train_pairs=len(train_pairs), skipped=data.skipped.as_dict(), skipped_where=data.skipped.where)

    first = first_stage_run(cfg, dev, corpus, cfg.dev_rerank_k)
    dev_queries, dev_qrels = queries_of(dev), qrels_of(dev)
    first_score = ndcg_at_10(first, dev_qrels)["ndcg@10"]
    run.log("first_stage", source=cfg.first_stage or "bm25", dev_ndcg10=first_score)

    opt = make_head_optimizer(model, cfg.lr, cfg.weight_decay, cfg.head_lr_scale)
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.loss == "listwise":
        per_epoch = max(1, sum(len(e.positives) for e in train) // cfg.batch_size)
        batches = listwise_batches(train, list(corpus), cfg.group_size, cfg.batch_size, rng)
    else:
        if len(train_pairs) < cfg.batch_size:
            raise ValueError(f"{len(train_pairs)} training pairs cannot fill a batch of {cfg.batch_size}")
        per_epoch = max(1, len(train_pairs) // cfg.batch_size)
        batches = pointwise_batches(train_pairs, cfg.batch_size, rng)
    total = 1 if cfg.dry_run else (cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch)))
    eval_every = cfg.eval_every or per_epoch

    def do_eval(step: int) -> float:
        reranked, scores = rerank_run(model, dev_queries, first, corpus, k=cfg.dev_rerank_k,
                                      batch_size=cfg.eval_batch_size, progress=cfg.progress)
        metrics = ndcg_at_10(reranked, dev_qrels)
        spread = float(np.std(scores)) if len(scores) else 0.0
        alpha, curve = choose_alpha(reranked, first, dev_qrels)
        last_alpha.update(alpha=alpha, curve=curve)
        run.log("eval", step=step, score_std=spread, rerank_k=cfg.dev_rerank_k, **metrics,
                interpolation_alpha=alpha, interpolated_ndcg10=curve[alpha])
        run.plot(title=f"reranker: dev nDCG@10 of first-stage top-{cfg.dev_rerank_k} ({len(dev)} queries)")
        model.train()
        if step > 0 and spread < cfg.collapse_std:
            raise ScoreCollapse(f"dev scores collapsed to a constant at step {step} (std {spread:.2e} < "
                                f"{cfg.collapse_std:g}); lower the learning rate or check the labels")
        return metrics["ndcg@10"]

    best = {"score": -1.0, "step": -1, "dir": None}
    last_alpha: dict = {}

    def consider(step: int, score: float) -> None:
        if score > best["score"]:
            def save(directory: str) -> None:
                model.save_pretrained(directory)
                write_training_args(directory, {**asdict(cfg), "step": step, "dev_ndcg@10": score})
                # The rerank/first-stage mix that was best on dev for *this* checkpoint (retrieval.interpolation).
                write_alpha(directory, last_alpha["alpha"],
                            chosen_on=f"dev nDCG@10 of the first stage's top-{cfg.dev_rerank_k} ({len(dev)} "
                                      f"queries, first stage {cfg.first_stage or 'bm25'})",
                            **{"dev_ndcg@10_by_alpha": {str(a): v for a, v in last_alpha["curve"].items()}})

            best.update(score=score, step=step, dir=run.save_checkpoint("best", save))

    initial = None
    if cfg.eval_at_start:
        initial = do_eval(0)
        consider(0, initial)
    last_eval = run.elapsed
    model.train()
    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=f"train reranker ({cfg.loss})", unit="step")
    recent_std: deque[float] = deque(maxlen=cfg.collapse_window)
    step, stop_reason, filled_total = 0, "steps", 0
    try:
        while step < total:
            if cfg.loss == "listwise":
                groups, filled = next(batches)
                filled_total += filled
                queries = [q for q, docs in groups for _ in docs]
                texts = [corpus[d] for _, docs in groups for d in docs]
                labels = None
            else:
                chunk = next(batches)
                queries = [p.query for p in chunk]
                texts = [corpus[p.doc_id] for p in chunk]
                labels = torch.tensor([p.label / scale for p in chunk], device=device)
            enc = model.encode_pairs(queries, texts).model_inputs(device)
            progress = max(step / total, run.elapsed / cfg.time_budget if cfg.time_budget else 0.0)
            factor = lr_factor(progress, warmup=cfg.warmup)
            for group in opt.param_groups:
                group["lr"] = cfg.lr * factor * group["lr_scale"]
            with autocast(device, model.bf16):
                logits = model(**enc).float()  # (N,)
            if labels is None:
                loss = listwise_ce(logits.view(len(groups), cfg.group_size))  # (G, 1 + n)
            else:
                loss = pointwise_bce(logits, labels)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            loss_value, logit_std = float(loss.detach()), float(logits.detach().std())
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"training loss became {loss_value} at step {step}; lower the learning rate")
            recent_std.append(logit_std)
            run.log("step", step=step, loss=loss_value, lr=cfg.lr * factor, grad_norm=float(grad_norm),
                    logit_std=logit_std)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}")
            if len(recent_std) == cfg.collapse_window and max(recent_std) < cfg.collapse_std:
                raise ScoreCollapse(f"training logits have been constant for {cfg.collapse_window} steps "
                                    f"(std < {cfg.collapse_std:g}) at step {step}")
            out_of_time = cfg.time_budget is not None and run.elapsed > cfg.time_budget
            due = cfg.eval_interval_s is not None and run.elapsed - last_eval > cfg.eval_interval_s
            if step % eval_every == 0 or step == total or out_of_time or due:
                consider(step, do_eval(step))
                last_eval = run.elapsed
            if out_of_time:
                stop_reason = "time budget"
                break
    except ScoreCollapse as exc:
        stop_reason = f"collapse: {exc}"
        run.log("stop", step=step, reason=str(exc))
        logger.error("%s", exc)
    finally:
        if bar is not None:
            bar.close()
    if cfg.save_last:
        run.save_checkpoint("last", model.save_pretrained)
    history = [r for r in run.records if r["event"] == "eval"]
    summary = {"best_dir": best["dir"], "best_step": best["step"], "best_dev_ndcg@10": best["score"],
               "initial_dev_ndcg@10": initial, "first_stage_dev_ndcg@10": first_score, "steps": step,
               "stopped_by": stop_reason, "random_negative_fill_ins": filled_total,
               "skipped": data.skipped.as_dict(), "dev_queries": len(dev), "seconds": round(run.elapsed, 1)}
    run.log("done", **summary)
    run.write_summary(summary)
    return RerankerTrainResult(best["dir"], best["step"], best["score"], initial, first_score, step, stop_reason,
                               history, data.skipped.as_dict())
