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

Under torchrun (``torchrun --nproc-per-node N -m twotower train reranker ...``) every rank draws the
same global batch of N x `batch_size` groups (or pairs) from the same seeded stream and computes the
loss of its own slice (its windows chosen, its teacher logits read); the gradients are averaged over
the ranks (`twotower.common.distributed.average_gradients`), so N ranks train like one process with
an N times larger batch (tests/retrieval/training/test_train_reranker_ranks.py), up to floating point
and dropout (each rank draws its own masks). Rank 0 alone builds the dev first stage, mines the
negatives (the other ranks receive them), evaluates, chooses the checkpoint and the interpolation
weights, and writes ``out``; the others wait at a barrier. A teacher's corpus and training queries
are embedded a share per rank and gathered. Still done on every rank: reading the data, loading the
model, a teacher index's vectors, and the BM25 index of `teacher_bm25`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from twotower.common.device import autocast
from twotower.common.distributed import (
    DistInfo,
    all_reduce_sum,
    average_gradients,
    barrier,
    from_main,
    gather_shards,
)
from twotower.common.errors import check_at_least, check_setting
from twotower.common.lines import is_json_lines, json_lines
from twotower.encoder.training.optim import param_groups
from twotower.retrieval.cross_encoder import (
    MIN_PAIR_TOKENS,
    WINDOW_CHOICES,
    CrossEncoder,
    PairDocument,
    RerankWindows,
    check_windows,
)
from twotower.retrieval.export import write_training_args
from twotower.retrieval.interpolation import ALPHA_FILE, write_alpha
from twotower.retrieval.rerank import DEFAULT_RERANK_K
from twotower.retrieval.training.alpha import choose_alpha
from twotower.retrieval.training.loop import Schedule, StopTraining, TrainingLoop, TrainSettings, start_run
from twotower.retrieval.training.losses import listwise_ce, listwise_kl, pointwise_bce
from twotower.retrieval.training.losses.gather import rank, world_size
from twotower.retrieval.training.mining import DenseRetriever
from twotower.retrieval.training.negatives import (
    add_mined_negatives,
    check_negatives_fit,
    mine_negatives,
    sample_negatives,
)
from twotower.retrieval.training.training_data import (
    LabeledPair,
    PairSet,
    TrainExample,
    TrainingSet,
    carve_dev,
    check_batch_fits,
    pairs_from_training,
    qrels_of,
    queries_of,
    query_key,
    read_labeled_pairs,
    read_titles,
    read_training,
    swapped_columns,
    titled_documents,
    training_from_pairs,
)

logger = logging.getLogger(__name__)

LOSSES = ("listwise", "pointwise")


@dataclass
class RerankerTrainConfig(TrainSettings):
    """Settings of a reranker training run.

    The settings both trainers share (split, corpus, negatives, length, schedule, dev split, evaluation
    schedule) come from `TrainSettings`; these are the reranker's own.

    model: encoder checkpoint (a fresh relevance head is added), a reranker directory (continued), or
        "default": the reranker twotower ships (`twotower.retrieval.default_reranker`), continued on your
        labels; it starts from a ranking that already beats the dense first stage, not from a random head.
    pairs: labeled pairs .tsv/.jsonl ({query, passage, label}), a BEIR directory, or {query, pos, neg} JSONL.
    out: the run directory (`twotower.retrieval.training.training_run`).
    mine: without `negatives`, "bm25" (or "dense": the teacher's ranking) mines ranks `mine_ranks` for the
        listwise groups (None: no mining).
    first_stage: what dev reranks, where the checkpoint and the interpolation weight are chosen: "bm25" (BM25
        over the corpus), "dense" (the teacher's ranking) or a TREC run covering the dev queries. None (the
        default): "dense" when there is a teacher, else "bm25". Why the teacher's ranking by default: the
        weight is applied over the first stage `twotower search` reranks, which is dense; a teacher that is
        the user's index ranks dev exactly as their searches will.
    loss: "listwise" (group_size = 1 positive + group_size-1 negatives) or "pointwise" (BCE on pairs).
    batch_size: groups per step (listwise) or pairs per step (pointwise).
    head_pooling: what a fresh relevance head reads: "cls" (the [CLS] pooler, the layout transformers and
        sentence-transformers load) or "mean" (the mean of the token states; a checkpoint only twotower
        scores correctly). From a mean-pooling sentence encoder such as all-MiniLM-L6-v2, whose [CLS]
        hardly varies between inputs, "mean" learns in the first hundred steps where "cls" stays at
        chance for hundreds (docs/training.md, "Why the fp32 demo reranker learned nothing").
    head_lr_scale: learning-rate multiplier for the fresh head (pooler + classifier). A new head on an
        encoder whose [CLS] barely varies starts with near-constant scores; at the encoder's learning rate
        it takes hundreds of steps to move, which a CPU budget cannot spare.
    dev_rerank_k: first-stage depth reranked at dev evaluation, where the interpolation weight is chosen;
        the default is search's default rerank_k, so the weight is chosen at the depth it will be used at.
    eval_at_start: evaluate the untrained model too (a fresh head ranks at random: skip it to save time).
    trainable_layers: train only the top N encoder layers and the head; the embeddings and the layers
        below stay as loaded (None: train everything). Why: a step then back-propagates through N
        layers instead of all, and the result differs from its base in those layers only, so it can be
        shipped as a small delta over the base (`twotower.retrieval.default_reranker`).
    teacher: a dual-encoder directory (e.g. the embedded all-MiniLM-L6-v2), or an index directory built
        from the training corpus (its vectors and query encoder: no document is encoded again), whose inner products also
        train the reranker: its listwise softmax over each group is pulled towards the teacher's
        (`twotower.retrieval.training.losses.distill`), weighted by `distill_weight`. It also serves
        ``mine="dense"`` (negatives from the teacher's ranking) and ``first_stage="dense"`` (dev reranks the
        teacher's top-k, as `twotower search --rerank` reranks the dense index's). None: labels only.
    distill_weight: weight of the distillation term next to the label loss (1.0: equal).
    teacher_bm25: add BM25's scores to the teacher's logits with this weight (0: the dense teacher alone).
        BM25 is first rescaled so that its scores spread over the training queries' candidates as much as the
        dense teacher's do (`Teacher.calibrate`); 1.0 then weighs the two equally. Why: the hybrid ranks
        better than either alone on claims whose evidence was never seen in training (docs/results.md), and
        a reranker interpolated with the dense first stage can only add the lexical evidence it has learned.
    residual: train the reranker as a correction to the teacher instead of a ranker of its own: the listwise
        loss reads reranker + teacher logits (no distillation term), so the gradient flows where the teacher
        ranks a group wrong and vanishes where it is already right. At search time the pipeline's z-score
        interpolation with the first stage (`twotower.retrieval.interpolation`) stands in for the sum, so
        dev chooses the checkpoint on the interpolated nDCG@10; the reranker alone is not a ranking then.
        Why: 150 CPU steps do not teach a cross-encoder to rank as well as the dual encoder it started from
        (alone it stays below it on claims whose evidence it never saw, docs/results.md), but they can
        teach it what the dual encoder gets wrong. With `teacher_bm25`, the correction is to dense + BM25.
        Measured on SciFact it learned less than distillation (dev 0.746 against 0.779, docs/results.md).
    teacher_scale: the teacher's scores are scale x inner product before the softmax (20: the scale
        sentence-transformers trains all-MiniLM-L6-v2 with, 1 / temperature 0.05).
    passage_window / passage_stride: read each document as windows of this many text tokens, every
        `passage_stride` tokens (default two thirds of the window), the title in front of each, and score it by
        its best window (`CrossEncoder.windows`). Each step first scores every window of the group's documents
        without gradients and trains on the best one of each (the gradient of a max); dev reranks the same way,
        and the setting is saved with the checkpoint, so searches read windows too. None: the head of each
        document up to `max_length` (a reranker that already has windows keeps them). Why: on SciFact, where
        most abstracts are longer than 192 tokens, windows of 96 added 0.035-0.045 nDCG@10 on dev (docs/results.md).
    max_windows: with windows, score at most this many per (query, document): those BM25 over the document's
        windows ranks best for the query (None: every window). Why: a document's cost stays bounded however
        long it is; on SciFact dev, 3 of a document's ~5 windows ranked as well as all of them (docs/results.md).
    window_choice: with windows, which window of a training document a step trains on: "model" (the one the
        model scores best, after scoring the kept windows without gradients) or "bm25" (the one BM25 over the
        document's windows ranks best for the query; no extra forward pass). Why "bm25": scoring the windows
        is ~40 % of a step on a CPU, and on SciFact dev the demo recipe trained as well with it (dev 0.794
        interpolated against 0.792, docs/results.md) in 5 min 15 s instead of 7 min 24 s (fp32, CPU-A).
    collapse_std: stop when the standard deviation of dev scores, or of the training logits over the last
        collapse_window steps, falls below this (`CollapseGuard`).
    """

    model: str
    pairs: str
    out: str
    mine: str | None = "bm25"
    mine_ranks: tuple[int, int] = (1, 100)
    first_stage: str | None = None
    loss: str = "listwise"
    group_size: int = 8
    batch_size: int = 4
    max_length: int = 256
    lr: float = 3e-5
    head_pooling: str = "cls"
    head_lr_scale: float = 20.0
    dev_rerank_k: int = DEFAULT_RERANK_K
    eval_batch_size: int = 32
    eval_at_start: bool = True
    trainable_layers: int | None = None
    teacher: str | None = None
    distill_weight: float = 1.0
    teacher_bm25: float = 0.0
    teacher_scale: float = 20.0
    residual: bool = False
    passage_window: int | None = None
    passage_stride: int | None = None
    max_windows: int | None = 3
    window_choice: str = "model"
    collapse_std: float = 1e-3
    collapse_window: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, 1, {"batch_size": "--batch-size", "eval_batch_size": None, "collapse_window": None})
        check_at_least(self, MIN_PAIR_TOKENS, {"max_length": "--max-length"})  # 0 read as "the model's maximum"
        check_setting(self.collapse_std >= 0, "collapse_std", self.collapse_std, "--collapse-std",
                      "give 0 (off) or more")
        if self.loss not in LOSSES:
            raise ValueError(f"loss={self.loss!r}; choose one of {LOSSES}")
        if self.head_pooling not in ("cls", "mean"):
            raise ValueError(f"head_pooling={self.head_pooling!r}; choose 'cls' or 'mean'")
        if self.dev_rerank_k < 1:
            raise ValueError(f"dev_rerank_k={self.dev_rerank_k}: give a positive number of first-stage candidates "
                             "(--dev-rerank-k)")
        if self.loss == "listwise" and self.group_size < 2:
            raise ValueError(f"group_size={self.group_size}: listwise groups need a positive and at least one "
                             "negative: give 2 or more (--group-size)")
        if self.first_stage is None:
            self.first_stage = "dense" if self.teacher else "bm25"
        if self.first_stage not in ("bm25", "dense") and not os.path.isfile(self.first_stage):
            raise ValueError(f"first_stage={self.first_stage!r}: no such file; give a TREC run of the dev queries, "
                             "'bm25' or 'dense' (the teacher's ranking) (--first-stage)")
        if self.teacher is None and (self.mine == "dense" or self.first_stage == "dense"):
            raise ValueError("mine='dense' and first_stage='dense' rank with the teacher: give teacher (--teacher DIR)")
        if not 0 <= self.distill_weight < math.inf:  # NaN fails too: it turned distillation off without a word
            raise ValueError(f"distill_weight={self.distill_weight}; give a number, 0 or more (--distill-weight)")
        if self.teacher_bm25 < 0:
            raise ValueError(f"teacher_bm25={self.teacher_bm25}; give 0 or more (--teacher-bm25)")
        if self.teacher_bm25 > 0 and self.teacher is None:
            raise ValueError("teacher_bm25 adds BM25 to the dense teacher's scores: give teacher (--teacher DIR)")
        if self.residual and (self.teacher is None or self.loss != "listwise"):
            raise ValueError("residual trains the reranker as a correction to the teacher's listwise scores: give "
                             "teacher (--teacher DIR) and loss='listwise'")
        if self.passage_stride is not None and self.passage_window is None:
            raise ValueError("passage_stride needs passage_window (--passage-window TOKENS)")
        if self.window_choice not in WINDOW_CHOICES:
            raise ValueError(f"window_choice={self.window_choice!r}; choose one of {WINDOW_CHOICES}")
        if self.window_choice != "model" and self.passage_window is None:
            raise ValueError("window_choice picks a window of each document: give passage_window (--passage-window N)")
        if self.trainable_layers is not None and self.trainable_layers < 0:
            raise ValueError(f"trainable_layers={self.trainable_layers}; give 0 or more (None: all) "
                             "(--trainable-layers)")


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


class ScoreCollapse(StopTraining):
    """The reranker's scores no longer vary: it cannot rank."""

    kind = "collapse"


class CollapseGuard:
    """The collapse guard of the module docstring, as a `TrainingLoop` guard: it reads the step and eval records.

    Dev scores (``score_std`` of an eval after step 0; None when dev scored fewer than two pairs) or the
    training logits of the last `window` steps (``logit_std``) spread less than `min_std`: raise `ScoreCollapse`.
    """

    def __init__(self, min_std: float, window: int) -> None:
        self.min_std = min_std
        self.recent: deque[float] = deque(maxlen=window)

    def __call__(self, record: dict) -> None:
        step = record["step"]
        if record["event"] == "eval":
            if step > 0 and record["score_std"] is not None and record["score_std"] < self.min_std:
                raise ScoreCollapse(f"dev scores collapsed to a constant at step {step} (std {record['score_std']:.2e} "
                                    f"< {self.min_std:g}); lower the learning rate or check the labels")
            return
        self.recent.append(record["logit_std"])
        if len(self.recent) == self.recent.maxlen and max(self.recent) < self.min_std:
            raise ScoreCollapse(f"training logits have been constant for {self.recent.maxlen} steps "
                                f"(std < {self.min_std:g}) at step {step}")


# ---- data --------------------------------------------------------------------------------------------
def load_reranker_data(cfg: RerankerTrainConfig) -> tuple[TrainingSet, PairSet | None]:
    """(grouped examples, original labeled pairs or None). Labeled-pair files keep their graded labels."""
    src = cfg.pairs
    if os.path.isfile(src) and not (src.endswith(".tsv") or is_json_lines(src)):  # said only "BEIR or .jsonl"
        raise ValueError(f"{src}: expected labeled pairs (a .tsv of query<TAB>passage<TAB>label, or a .jsonl of "
                         "{query, passage, label}), a .jsonl of {query, pos, neg}, or a BEIR directory")
    is_pairs = os.path.isfile(src) and (src.endswith(".tsv") or (src.endswith(".jsonl") and _looks_like_pairs(src)))
    if is_pairs:
        pairs = read_labeled_pairs(src)
        if rank() == 0 and (swapped := swapped_columns(pairs)):  # a warning: a real file can look the same
            logger.warning("--pairs %s: %s", src, swapped)
        return training_from_pairs(pairs), pairs
    data = read_training(src, split=cfg.split, corpus_path=cfg.corpus)
    return data, None


def _looks_like_pairs(path: str) -> bool:
    """Whether a JSONL file holds labeled pairs (its first object has a "label"), read as every reader reads
    lines: a byte-order mark is dropped and a bad byte or bad JSON is an error naming its line."""
    for lineno, obj in json_lines(path):
        if "label" not in obj and "pos" not in obj and any(k in obj for k in ("passage", "text", "document", "doc")):
            # read as {query, pos, neg}, it failed with "no usable training query (... no positive)"
            raise ValueError(f"{path}:{lineno}: a labeled pair needs 'label' (the first record decides how the file "
                             "is read: with 'label', labeled pairs; with 'pos', {query, pos, neg} groups)")
        return "label" in obj
    return False


def first_stage_run(cfg: RerankerTrainConfig, dev: Sequence[TrainExample], corpus: dict[str, str],
                    k: int, dense: DenseRetriever | None = None) -> dict[str, dict[str, float]]:
    """The dev queries' first-stage candidates: BM25's, the teacher's ranking (``first_stage="dense"``, `dense`)
    or a TREC run's (`cfg.first_stage` a path)."""
    if cfg.first_stage == "dense":
        hits = dense([e.query for e in dev], k)
        return {e.query_id: dict(h) for e, h in zip(dev, hits)}
    if cfg.first_stage != "bm25":
        from twotower.eval.io.trec import read_trec_run

        run = read_trec_run(cfg.first_stage)
        missing = [e.query_id for e in dev if e.query_id not in run]
        if missing:
            made = [q for q in missing if q == query_key(next(e.query for e in dev if e.query_id == q))]
            hint = ("; those ids were made from the query texts, as the training data names no query ids: a run "
                    "cannot name them, so give JSONL with \"query_id\" or --first-stage bm25 / dense") if made else ""
            raise ValueError(f"--first-stage {cfg.first_stage}: {len(missing)} dev queries have no first-stage "
                             f"results, e.g. {missing[:3]}{hint}")
        unknown = {d for e in dev for d in run[e.query_id] if d not in corpus}
        if unknown:
            raise ValueError(f"--first-stage {cfg.first_stage}: {len(unknown)} documents are not in the corpus, "
                             f"e.g. {sorted(unknown)[:3]}")
        return {e.query_id: dict(run[e.query_id]) for e in dev}
    from twotower.retrieval.training.mining import bm25_retriever

    hits = bm25_retriever(corpus)([e.query for e in dev], k)
    return {e.query_id: dict(h) for e, h in zip(dev, hits)}


def hybrid_first_stage(dev: Sequence[TrainExample], corpus: dict[str, str], dense: DenseRetriever, k: int,
                       depth: int = 100) -> dict[str, dict[str, float]]:
    """The dev queries' top-k of the search pipeline's hybrid: dense and BM25 top-`depth` fused by RRF (k=60)."""
    from twotower.retrieval.fusion import reciprocal_rank_fusion
    from twotower.retrieval.training.mining import bm25_retriever

    queries = [e.query for e in dev]
    dense_hits, bm25_hits = dense(queries, depth), bm25_retriever(corpus)(queries, depth)
    return {e.query_id: dict(reciprocal_rank_fusion([[d for d, _ in a], [d for d, _ in b]], limit=k))
            for e, a, b in zip(dev, dense_hits, bm25_hits)}


def corpus_file(cfg: RerankerTrainConfig) -> str | None:
    """The corpus file the training documents come from (`cfg.corpus`, or a BEIR directory's), if there is one."""
    path = cfg.corpus or (os.path.join(cfg.pairs, "corpus.jsonl") if os.path.isdir(cfg.pairs) else None)
    return path if path and os.path.isfile(path) else None


def reranker_documents(cfg: RerankerTrainConfig, corpus: dict[str, str],
                       model: CrossEncoder) -> Mapping[str, PairDocument]:
    """The documents as `model` reads them: (title, text) when it reads windows and the corpus file has titles
    (each window carries the title), else the texts."""
    if model.windows is None:
        return corpus
    path = corpus_file(cfg)
    return titled_documents(corpus, read_titles(path) if path else {})


def write_dev_alpha(directory: str, cfg: RerankerTrainConfig, alpha: float, curve: Mapping[float, float],
                    dev_queries: int) -> None:
    """Store the rerank/first-stage mix that was best on dev for the checkpoint in `directory`, with its curve
    (`twotower.retrieval.interpolation`).

    The weight is also filed under its first stage ("bm25" or "dense"; a TREC run's kind is unknown), so that a
    search over another first stage can tell it was not chosen there (`SearchPipeline.rerank_alpha_chosen_over`).
    """
    named = cfg.first_stage if cfg.first_stage in ("bm25", "dense") else None
    write_alpha(directory, alpha, {named: alpha} if named else None,
                chosen_on=f"dev nDCG@10 of the first stage's top-{cfg.dev_rerank_k} ({dev_queries} "
                          f"queries, first stage {cfg.first_stage})",
                **{"dev_ndcg@10_by_alpha": {str(a): v for a, v in curve.items()}})


def default_stride(window: int) -> int:
    """Windows overlap by a third unless told otherwise (96 -> 64, the setting measured in docs/results.md)."""
    return max(1, window * 2 // 3)


# ---- batches -----------------------------------------------------------------------------------------
def listwise_batches(train: Sequence[TrainExample], corpus_ids: Sequence[str], group_size: int,
                     batch_size: int, rng: random.Random):
    """Endless groups: (example index, [positive, n negatives]) with n = group_size - 1, one group per labelled
    pair (the index, not the query text, so that the teacher can look up the query's vector).

    A query short of mined negatives is topped up with random corpus documents (counted).
    """
    items = [(i, p) for i, e in enumerate(train) for p in e.positives]
    n = group_size - 1
    while True:
        rng.shuffle(items)
        for s in range(0, len(items) - batch_size + 1, batch_size):
            groups, filled = [], 0
            for i, p in items[s:s + batch_size]:
                neg, n_random = sample_negatives(train[i], n, corpus_ids, rng)
                filled += n_random
                groups.append((i, [p, *neg]))
            yield groups, filled


def pointwise_batches(pairs: Sequence[LabeledPair], batch_size: int, rng: random.Random):
    order = list(range(len(pairs)))
    while True:
        rng.shuffle(order)
        for s in range(0, len(order) - batch_size + 1, batch_size):
            yield [pairs[i] for i in order[s:s + batch_size]]


def make_head_optimizer(model: CrossEncoder, lr: float, weight_decay: float, head_scale: float):
    """AdamW (no decay on biases / norms, as `twotower.encoder.training.optim`) with the head (pooler + classifier) at head_scale x lr.

    A mean-pooled head has no pooler: the classifier alone is the head.
    """
    head = torch.nn.ModuleList([m for m in (model.bert.pooler, model.classifier) if m is not None])
    head_ids = {id(p) for p in head.parameters()}
    body = [(n, p) for n, p in model.named_parameters() if id(p) not in head_ids and p.requires_grad]
    groups = []
    for scale, named in ((1.0, body), (head_scale, list(head.named_parameters()))):
        holder = torch.nn.Module()
        for i, (name, p) in enumerate(named):
            holder.register_parameter(f"p{i}_{name.replace('.', '_')}", p)
        for g in param_groups(holder, weight_decay):
            if g["params"]:
                groups.append({**g, "lr": lr * scale, "lr_scale": scale})
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-6)


def freeze_below_top(model: CrossEncoder, trainable: int) -> None:
    """Freeze the embeddings and every encoder layer below the top `trainable` (the head stays trainable)."""
    layers = model.bert.encoder.layer
    if trainable > len(layers):
        raise ValueError(f"trainable_layers={trainable}, but the model has {len(layers)} layers (--trainable-layers)")
    frozen = [model.bert.embeddings, *layers[: len(layers) - trainable]]
    for module in frozen:
        for p in module.parameters():
            p.requires_grad_(False)


# ---- the loop ----------------------------------------------------------------------------------------
def teacher_dir(name: str | None) -> str | None:
    """A teacher as users name it: "default" (or "embedded") is the installed all-MiniLM-L6-v2, as a model named
    "default" is elsewhere; anything else a directory."""
    if name in ("default", "embedded"):
        from twotower.retrieval.manifest import default_model_dir

        return default_model_dir()
    return name


class Teacher:
    """The dual encoder `cfg.teacher` over the training corpus, embedded once: ranks (`dense`) and group logits.

    Why once: every group's teacher scores are inner products of vectors computed before the first step,
    so distillation costs no forward pass during training. With ``cfg.teacher_bm25`` the logits also carry
    BM25's scores of the same documents (a sparse lookup per group, no model).
    """

    def __init__(self, cfg: RerankerTrainConfig, corpus: dict[str, str], device: torch.device,
                 dist: DistInfo | None = None) -> None:
        """dist: under torchrun, every rank builds the teacher together (each embeds its share of the corpus,
        then of the training queries); None: this process alone."""
        from twotower.indexing.manifest import MANIFEST_NAME
        from twotower.retrieval.dual_encoder import DualEncoder

        self.dist = dist or DistInfo()
        if os.path.isfile(os.path.join(cfg.teacher, MANIFEST_NAME)):  # an index: its vectors, its query encoder
            self.dense = DenseRetriever.from_index(cfg.teacher, corpus, bf16=cfg.bf16, device=str(device))
        else:
            dual = DualEncoder.from_pretrained(cfg.teacher, bf16=cfg.bf16, device=device)
            ids = list(corpus)
            progress = cfg.progress and self.dist.is_main
            vectors = gather_shards([corpus[d] for d in ids],
                                    lambda texts: dual.encode_documents(texts, progress=progress), self.dist)  # (N, H)
            self.dense = DenseRetriever.from_vectors(dual, ids, vectors)
        self.scale = cfg.teacher_scale
        self.bm25_weight = cfg.teacher_bm25
        self.bm25 = None
        if self.bm25_weight > 0:
            from twotower.indexing.bm25 import BM25

            self.bm25 = BM25()
            self.bm25.add(list(corpus), list(corpus.values()))
        self.bm25_scale = 0.0  # set by calibrate
        self.queries: list[str] = []
        self.query_vectors: np.ndarray | None = None

    def embed_queries(self, train: Sequence[TrainExample]) -> None:
        self.queries = [e.query for e in train]
        self.query_vectors = gather_shards(self.queries, self.dense.dual.encode_queries, self.dist)  # (Q, H)
        if self.bm25 is not None:
            self.bm25_scale = self.calibrate(train)

    def _dense(self, i: int, docs: Sequence[str]) -> np.ndarray:
        return self.scale * (self.dense.index.reconstruct(list(docs)) @ self.query_vectors[i])  # (n,)

    def calibrate(self, train: Sequence[TrainExample], queries: int = 200) -> float:
        """The factor that gives BM25's scores the dense logits' spread: the ratio of their mean per-query
        standard deviations over the first `queries` training queries' positives and mined negatives."""
        dense_std, bm25_std = [], []
        for i, e in enumerate(train[:queries]):
            docs = list(dict.fromkeys((*e.positives, *e.negatives)))
            if len(docs) < 2:
                continue
            dense_std.append(float(np.std(self._dense(i, docs))))
            bm25_std.append(float(np.std(self.bm25.score(self.queries[i], docs))))
        if not dense_std or np.mean(bm25_std) == 0:
            raise ValueError("teacher_bm25: no training query has two candidates that BM25 tells apart; "
                             "mine negatives (--mine) or drop --teacher-bm25")
        return float(np.mean(dense_std) / np.mean(bm25_std))

    def logits(self, groups: Sequence[tuple[int, Sequence[str]]]) -> torch.Tensor:
        """(G, n): scale x <query, document> (+ weight x calibrated BM25) for each group's documents, in order."""
        rows = [self._dense(i, docs) for i, docs in groups]  # (n,) each
        if self.bm25 is not None:
            factor = self.bm25_weight * self.bm25_scale
            rows = [r + factor * self.bm25.score(self.queries[i], list(docs)) for r, (i, docs) in zip(rows, groups)]
        return torch.from_numpy(np.stack(rows)).float()


def load_reranker(cfg: RerankerTrainConfig, device: torch.device) -> CrossEncoder:
    """Continue a reranker directory (it has a classifier head) or the shipped one ("default"), or start a
    fresh head on an encoder."""
    from twotower.encoder.core.checkpoint import safetensors_names
    from twotower.retrieval import default_reranker

    if cfg.model == default_reranker.NAME:
        return default_reranker.load(device=device, bf16=cfg.bf16, max_length=cfg.max_length)

    from twotower.encoder.core.checkpoint import CONFIG_NAME
    from twotower.encoder.core.config import EncoderConfig
    from twotower.retrieval.cross_encoder import check_two_segments

    if os.path.isfile(os.path.join(cfg.model, CONFIG_NAME)):  # else loading names what is wrong with it
        check_two_segments(EncoderConfig.load(os.path.join(cfg.model, CONFIG_NAME)), f"--model {cfg.model}")
    path = os.path.join(cfg.model, "model.safetensors")
    has_head = False
    if os.path.isfile(path):
        has_head = "classifier.weight" in safetensors_names(path)
    if has_head:  # a reranker keeps the head it was trained with
        return CrossEncoder.from_pretrained(cfg.model, device=device, max_length=cfg.max_length, bf16=cfg.bf16)
    # The run's global random stream (its dropout) goes on from where the fresh head's draw from seed 0 leaves it,
    # as in every run before `from_encoder` stopped reseeding the caller's stream: the shipped reranker is rebuilt
    # from seed 0 byte for byte, and starting the dropout elsewhere would change every seeded run.
    torch.manual_seed(0)
    return CrossEncoder.from_encoder(cfg.model, device=device, max_length=cfg.max_length, bf16=cfg.bf16,
                                     pooling=cfg.head_pooling, seed=None)


def hybrid_alpha(cfg: RerankerTrainConfig, best_dir: str, device: torch.device, dev: Sequence[TrainExample],
                 corpus: dict[str, str], dense: DenseRetriever, run,
                 known: Mapping[str, Mapping[str, float]] | None = None,
                 docs: Mapping[str, PairDocument] | None = None) -> float:
    """Choose the best checkpoint's weight over the hybrid first stage too, and store both in its ALPHA_FILE.

    Why: the weight chosen over the dense top-k is too high for the hybrid's, whose first-stage scores
    already carry BM25's evidence; with one weight (0.6) the shipped recipe's hybrid + rerank scored 0.6883
    nDCG@10 on SciFact test, with its own (0.2) 0.7174 (docs/results.md, "Distilling the dense model").
    known: the best checkpoint's dev scores over the dense top-k; only the hybrid's other pairs are scored.
    docs: the documents as the reranker reads them (`titled_documents`; default `corpus`).
    """
    from twotower.retrieval.interpolation import read_alpha
    from twotower.retrieval.training.dev_eval import rerank_run

    best = CrossEncoder.from_pretrained(best_dir, device=device, bf16=cfg.bf16)
    first = hybrid_first_stage(dev, corpus, dense, cfg.dev_rerank_k)
    reranked, _ = rerank_run(best, queries_of(dev), first, docs or corpus, k=cfg.dev_rerank_k,
                             batch_size=cfg.eval_batch_size, progress=cfg.progress, known=known)
    alpha, curve = choose_alpha(reranked, first, qrels_of(dev))
    dense_alpha = read_alpha(best_dir)
    with open(os.path.join(best_dir, ALPHA_FILE), encoding="utf-8") as f:
        dense_curve = json.load(f).get("dev_ndcg@10_by_alpha", {})  # kept beside the hybrid's
    write_alpha(best_dir, dense_alpha, {"dense": dense_alpha, "hybrid": alpha},
                chosen_on=f"dev nDCG@10 of the top-{cfg.dev_rerank_k} of each first stage ({len(dev)} queries; "
                          "dense: the teacher, hybrid: teacher + BM25 by RRF)",
                **{"dev_ndcg@10_by_alpha": dense_curve,
                   "hybrid_dev_ndcg@10_by_alpha": {str(a): v for a, v in curve.items()}})
    run.log("hybrid_alpha", alpha=alpha, dev_ndcg10=curve[alpha], first_stage_dev_ndcg10=curve[0.0])
    return alpha


def _step_over_ranks(loss: torch.Tensor, logits: torch.Tensor, extra: dict, world: DistInfo,
                     device: torch.device) -> tuple[torch.Tensor, dict]:
    """The step record of the whole global batch under torchrun: the loss terms are the means of the ranks'
    (their slices are equally large, so that is the batch's mean), the logits' spread is over every rank's
    logits (what the collapse guard reads). One all-reduce of a few numbers."""
    values = [float(loss.detach()), *extra.values(), float(logits.numel()), float(logits.double().sum()),
              float(logits.double().pow(2).sum())]
    total = all_reduce_sum(values, world, device)
    R, k = world.world_size, len(extra)
    n, s, sq = total[1 + k:]
    std = math.sqrt(max(0.0, (sq - s * s / n) / (n - 1))) if n > 1 else float("nan")
    return (torch.tensor(total[0] / R),
            {"logit_std": std, **{key: v / R for key, v in zip(extra, total[1:1 + k])}})


def train_reranker(cfg: RerankerTrainConfig) -> RerankerTrainResult:
    """Train, evaluate on the dev split by reranking its first stage, keep the best. See the module docstring
    (and its "Under torchrun" for what each rank does)."""
    from twotower.retrieval.training.dev_eval import dev_metrics, rerank_run

    R, me = world_size(), rank()
    world = DistInfo(R, me)
    run, rng, device, _ = start_run(cfg, cfg.out, enabled=me == 0, world_size=R)
    model = load_reranker(cfg, device)  # first: a bad model directory fails before any data work
    if R > 1:  # every rank loaded the same weights (a fresh head is drawn with a fixed seed); dropout is its own
        torch.manual_seed(cfg.seed + me)
    if cfg.trainable_layers is not None:
        freeze_below_top(model, cfg.trainable_layers)
    if cfg.passage_window is not None:
        model.windows = check_windows(RerankWindows(cfg.passage_window, cfg.passage_stride
                                                    or default_stride(cfg.passage_window), cfg.max_windows),
                                      model.max_length)
    data, labeled = load_reranker_data(cfg)
    if labeled is not None and cfg.loss == "pointwise" and cfg.negatives:  # they were read, and never used
        raise ValueError(f"--negatives {cfg.negatives}: --loss pointwise trains on the labeled pairs of --pairs "
                         f"{cfg.pairs} alone; add the negatives to that file as pairs labeled 0, or use --loss listwise")
    train, dev = carve_dev(data, cfg)
    if cfg.loss == "listwise":  # one group per (query, positive): known before any mining or teacher work
        check_batch_fits(data.source, sum(len(e.positives) for e in train), cfg.batch_size, "(query, positive) pairs",
                         ranks=R)
    corpus = data.corpus
    docs = reranker_documents(cfg, corpus, model)
    teacher = Teacher(cfg, corpus, device, world) if cfg.teacher else None
    if cfg.negatives:
        # dev queries are the data's too: their lines are held out with them, not unknown
        train = add_mined_negatives(train, cfg.negatives, corpus, data.skipped,
                                    known={e.query_id for e in data.examples})
    if cfg.loss == "listwise":  # mining adds negatives, never positives: checked before it
        check_negatives_fit(train, len(corpus), cfg.group_size - 1, "--group-size", cfg.group_size)
    # what dev reranks: only rank 0 evaluates (None on the others)
    first = from_main(world, lambda: first_stage_run(cfg, dev, corpus, cfg.dev_rerank_k,
                                                    dense=teacher.dense if teacher else None))
    dev_ids = {e.query_id for e in dev}
    if labeled is not None and cfg.loss == "pointwise":
        train_pairs = [p for p in labeled.pairs if p.query_id not in dev_ids]
        scale = labeled.max_label
    else:  # listwise: counted again once mined negatives are in (pointwise mines none)
        train_pairs = pairs_from_training(TrainingSet(train, corpus, data.skipped, data.source)).pairs
        scale = 1.0
    if cfg.loss == "pointwise":
        check_batch_fits(data.source, len(train_pairs), cfg.batch_size, "labeled pairs", ranks=R)
    run.open()  # the inputs are read and checked: only now is an earlier run's log set aside
    if not cfg.negatives and cfg.mine and cfg.loss == "listwise":
        # mined once, on rank 0 (which writes OUT/negatives.jsonl); every rank trains on its result
        train = mine_negatives(train, corpus, run, method=cfg.mine, ranks=cfg.mine_ranks,
                               num_negatives=max(4 * (cfg.group_size - 1), 16), seed=cfg.seed,
                               progress=cfg.progress, dense=teacher.dense if teacher else None, info=world)
        train_pairs = pairs_from_training(TrainingSet(train, corpus, data.skipped, data.source)).pairs
    if data.skipped and world.is_main:
        logger.warning("training data: skipped %s", data.skipped.summary())
    run.log("data", source=data.source, train_queries=len(train), dev_queries=len(dev), corpus=len(corpus),
            train_pairs=len(train_pairs), skipped=data.skipped.as_dict(), skipped_where=data.skipped.where)

    dev_queries, dev_qrels = queries_of(dev), qrels_of(dev)
    first_score = dev_metrics(first, dev_qrels)["ndcg@10"] if first is not None else float("nan")
    if first is not None:
        run.log("first_stage", source=cfg.first_stage, dev_ndcg10=first_score)

    opt = make_head_optimizer(model, cfg.lr, cfg.weight_decay, cfg.head_lr_scale)
    params = [p for p in model.parameters() if p.requires_grad]
    # Every rank draws the same global batch of batch_size x R from the same seeded stream and trains on its
    # slice; the averaged gradients are then the global batch's.
    b, global_batch = cfg.batch_size, cfg.batch_size * R
    own = slice(me * b, (me + 1) * b)
    if cfg.loss == "listwise":
        per_epoch = max(1, sum(len(e.positives) for e in train) // global_batch)
        batches = listwise_batches(train, list(corpus), cfg.group_size, global_batch, rng)
        if teacher is not None and (cfg.distill_weight > 0 or cfg.residual):
            teacher.embed_queries(train)
            if teacher.bm25 is not None:
                run.log("teacher_bm25", weight=cfg.teacher_bm25, bm25_scale=teacher.bm25_scale)
    else:
        per_epoch = max(1, len(train_pairs) // global_batch)
        batches = pointwise_batches(train_pairs, global_batch, rng)
    filled_total = 0

    def draw(done: int) -> list:
        """The global batch of step `done + 1`: groups (listwise) or pairs (pointwise), drawn from `rng`."""
        nonlocal filled_total
        if cfg.loss == "pointwise":
            return next(batches)
        groups, filled = next(batches)
        filled_total += filled  # the global batch's fill-ins: every rank drew them alike
        return groups

    def step(done: int) -> tuple[torch.Tensor, dict]:
        if cfg.loss == "listwise":
            groups = draw(done)[own]
            queries = [train[i].query for i, ids in groups for _ in ids]
            texts = [docs[d] for _, ids in groups for d in ids]
            labels = None
        else:
            chunk = draw(done)[own]
            queries = [p.query for p in chunk]
            texts = [docs[p.doc_id] for p in chunk]
            labels = torch.tensor([p.label / scale for p in chunk], device=device)
        # each document's best window, scored without gradients (the text itself without windows)
        texts = model.best_windows(list(zip(queries, texts)), batch_size=cfg.eval_batch_size, by=cfg.window_choice)
        enc = model.encode_pairs(queries, texts).model_inputs(device)
        with autocast(device, model.bf16):
            logits = model(**enc).float()  # (N,)
        extra = {}
        if labels is None:
            scores = logits.view(len(groups), cfg.group_size)  # (G, 1 + n)
            if cfg.residual:  # the label loss of teacher + reranker; the teacher's part is a constant
                loss = listwise_ce(scores + teacher.logits(groups).to(device))
            else:
                loss = listwise_ce(scores)
            if teacher is not None and cfg.distill_weight > 0 and not cfg.residual:
                kl = listwise_kl(scores, teacher.logits(groups).to(device))
                extra.update(label_loss=float(loss.detach()), distill_kl=float(kl.detach()))
                loss = loss + cfg.distill_weight * kl
        else:
            loss = pointwise_bce(logits, labels)
        loss.backward()
        if R == 1:
            return loss, {"logit_std": float(logits.detach().std()), **extra}
        average_gradients(params)
        return _step_over_ranks(loss, logits.detach(), extra, world, device)

    last_alpha: dict = {}
    best_scores: dict = {}  # the best checkpoint's dev scores, reused by hybrid_alpha

    def evaluate(step: int) -> dict:
        if not world.is_main:  # rank 0 evaluates; the others wait for it
            barrier(world)
            return {}
        reranked, scores = rerank_run(model, dev_queries, first, docs, k=cfg.dev_rerank_k,
                                      batch_size=cfg.eval_batch_size, progress=cfg.progress)
        metrics = dev_metrics(reranked, dev_qrels)
        alpha, curve = choose_alpha(reranked, first, dev_qrels)
        last_alpha.update(alpha=alpha, curve=curve, run=reranked)
        barrier(world)
        # one score has no spread to lose: None, which the guard passes over (a dev query whose first stage
        # found a single candidate used to read as a collapse at step 1)
        return {"score_std": float(np.std(scores)) if len(scores) > 1 else None, "rerank_k": cfg.dev_rerank_k,
                **metrics, "interpolation_alpha": alpha, "interpolated_ndcg10": curve[alpha]}

    def save(directory: str, step: int, score: float) -> None:
        best_scores.clear()
        best_scores.update(last_alpha["run"])
        model.save_pretrained(directory)
        write_training_args(directory, {**asdict(cfg), "world_size": R, "step": step, "dev_ndcg@10": score})
        write_dev_alpha(directory, cfg, last_alpha["alpha"], last_alpha["curve"], len(dev))

    def save_last(directory: str, steps: int) -> None:
        """``last/``: the final weights and, as in ``best/``, what trained them (world_size: --batch-size is per
        rank, so the global batch is world_size x batch_size)."""
        model.save_pretrained(directory)
        write_training_args(directory, {**asdict(cfg), "world_size": R, "step": steps, "dev_ndcg@10": None})

    result = TrainingLoop(
        run, Schedule.of(cfg, per_epoch, cfg.lr, eval_at_start=cfg.eval_at_start), opt, params, cfg.max_grad_norm, [model],
        step, evaluate, save, guard=CollapseGuard(cfg.collapse_std, cfg.collapse_window),
        save_last=save_last if cfg.save_last else None,
        main_process=world.is_main, progress=cfg.progress, desc=f"train reranker ({cfg.loss})",
        metric="interpolated_ndcg10" if cfg.residual else "ndcg@10",
        plot_title=f"reranker: dev nDCG@10 of first-stage top-{cfg.dev_rerank_k} ({len(dev)} queries)",
        state_module=model if cfg.resumable else None, skip=draw, save_every=cfg.save_every,
        # the best checkpoint's dev scores, which hybrid_alpha reuses, survive a resume
        state_fields=lambda: {"best_dev_scores": best_scores},
        load_state_fields=lambda fields: best_scores.update(fields["best_dev_scores"]),
    ).train()
    if teacher is not None and cfg.first_stage == "dense":  # on every rank alike: from_main is a collective
        from_main(world, lambda: result.best_dir and hybrid_alpha(cfg, result.best_dir, device, dev, corpus,
                                                                  teacher.dense, run, known=best_scores, docs=docs))
    run.finish({**result.summary(), "first_stage_dev_ndcg@10": first_score,
                "random_negative_fill_ins": filled_total, "skipped": data.skipped.as_dict(), "dev_queries": len(dev)})
    return RerankerTrainResult(run.final_path(result.best_dir), result.best_step, result.best_score, result.initial_score,
                               first_score, result.steps, result.stopped_by, result.history, data.skipped.as_dict())
