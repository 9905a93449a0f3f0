"""A small reranker trained by the library itself, for the README demo: minutes on a 2-core CPU, cached.

Where the supervision comes from: the bundled SciFact sample ships SciFact's
*train* claims with the ids of their evidence abstracts
(``data/scifact-train-claims.jsonl.gz``; every one of those abstracts is in the
sample).  They are labeled (query, positive) pairs, exactly what a user brings
when fine-tuning a reranker on their own data; negatives are mined by BM25 over
the sample (ranks 1-100 minus the positives).  The demo's example queries are
SciFact *test* claims, so nothing it is shown was trained on; the dev split
(10 % of the train claims) picks the checkpoint.

For a corpus of your own without labels (``corpus=...`` and ``claims=None``),
the pairs are self-supervised instead: a document's title is the query, its
text the positive, and BM25's next-best texts for that title the negatives.

The model starts from all six layers of all-MiniLM-L6-v2 and is trained with
`twotower.retrieval.training.train_reranker` (listwise loss, lr 1e-4 with the
fresh head at 10x), so the demo exercises the same code as the benchmarks.  All
six, not the first three: MiniLM is a mean-pooling sentence encoder, and its
[CLS] state is nearly the same vector for every input until the last layer (its
spread across claim/abstract pairs is 0.3 % of its norm after layer 3, 49 % after
layer 6).  A [CLS] relevance head on three layers therefore starts blind, and in
fp32 its loss stayed at chance (ln 4) for 200 steps; on six layers it reaches
BM25's dev nDCG@10 alone within 150 steps (docs/training.md, "Why the fp32 demo
reranker learned nothing"; `benchmarks/reranker_diagnosis.py`).  The result is
cached: a second call with the same settings returns the existing directory at
once.

Example:
    >>> path = train_demo_reranker("runs/demo-reranker")       # doctest: +SKIP
    >>> CrossEncoder.from_pretrained(path).rank("aspirin inhibits PGE2", docs)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import math
import os
import random

from twotower.common.atomic import atomic_path, atomic_write_text
from twotower.common.errors import check_setting
from twotower.common.paths import not_ours_refusal

DATA = str(importlib.resources.files("twotower.retrieval").joinpath("data"))  # the package data of twotower.retrieval
BUNDLED_CORPUS = os.path.join(DATA, "scifact-sample.jsonl.gz")
BUNDLED_CLAIMS = os.path.join(DATA, "scifact-train-claims.jsonl.gz")
MARKER = "demo_reranker.json"
logger = logging.getLogger(__name__)
TITLES = 600  # title/text pairs made when there are no claims (runs made before `titles` keep their cache key)


def title_abstract_pairs(corpus_path: str, out_path: str, negatives: int = 12, queries: int = TITLES,
                         seed: int = 0) -> int:
    """Write {query: title, pos: [abstract], neg: [BM25 ranks 2-30 abstracts]} JSONL; returns lines written.

    A title with no negative among BM25's ranks 2-30 (a title of numbers or of words no other text
    uses) gives no pair: the count is logged as a warning, and a corpus where every title does so
    is refused, naming the file, rather than training on nothing.
    """
    from twotower.retrieval.corpus import iter_documents
    from twotower.retrieval.training.mining import bm25_retriever

    docs = [d for _, d in iter_documents(corpus_path, keep_empty=True) if (d.get("title") or "").strip()
            and d["text"].strip()]
    if len(docs) < 50:
        raise ValueError(f"{corpus_path}: only {len(docs)} documents with a title and text; need 50 or more")
    abstracts = {d["id"]: d["text"] for d in docs}
    rng = random.Random(seed)
    chosen = rng.sample(docs, min(queries, len(docs)))
    hits = bm25_retriever(abstracts)([d["title"] for d in chosen], 30)
    rows = []
    for d, ranked in zip(chosen, hits):
        neg = [abstracts[i] for i, _ in ranked[1:] if i != d["id"]][:negatives]
        if neg:
            rows.append({"query_id": f"title:{d['id']}", "query": d["title"], "pos": [d["text"]], "neg": neg})
    if not rows:
        raise ValueError(f"{corpus_path}: none of {len(chosen)} titles has a negative among BM25's ranks 2-30, "
                         "so no title/text pair can be made; titles must share words with other documents' texts")
    if len(rows) < len(chosen):
        logger.warning("%s: %d of %d titles gave no title/text pair (no negative among BM25's ranks 2-30); "
                       "kept the other %d", corpus_path, len(chosen) - len(rows), len(chosen), len(rows))
    with atomic_path(out_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)


def truncated_encoder(model_dir: str, layers: int, out_dir: str) -> str:
    """Save the first `layers` transformer layers of `model_dir` as a new encoder directory."""
    from twotower.encoder import load_encoder, save_encoder

    model, tok = load_encoder(model_dir)
    if not 1 <= layers <= model.config.num_hidden_layers:
        raise ValueError(f"layers={layers}; {model_dir} has {model.config.num_hidden_layers}")
    model.encoder.layer = model.encoder.layer[:layers]
    model.config.num_hidden_layers = layers
    save_encoder(model, tok, out_dir)
    return out_dir


class NoCheckpointError(RuntimeError):
    """Training ended without a checkpoint to keep (the collapse guard stopped it): an outcome, not a bug."""


def out_state(out: str) -> str:
    """What is at a demo run's `out`: "free" (nothing, or an empty directory), "demo" (an earlier demo run: it
    holds `MARKER`, written when a run starts and completed when it ends), "file", or "other" (a directory
    holding anything else: a `train soup` reranker, another run, the user's files)."""
    if not os.path.lexists(out):
        return "free"
    if not os.path.isdir(out):
        return "file"
    names = os.listdir(out)
    if not names:
        return "free"
    return "demo" if MARKER in names else "other"


def check_out(out: str) -> None:
    """Refuse an `out` that is not new, empty or an earlier demo run, before anything is loaded or written.

    Why: the run wrote its log, pairs, start/ and best/ into whatever directory `out` was, and a finished
    `train soup` reranker there became a mix of two models. An earlier demo run is this command's own
    cache: the same settings are reused, other settings trained again in its place (there is no
    --overwrite: the demo's directory is a cache).
    """
    state = out_state(out)
    if state == "file":
        raise ValueError(f"--out {out}: a file; give a directory (a new one, or an empty one)")
    if state == "other":
        raise ValueError(not_ours_refusal(f"--out {out}", sorted(os.listdir(out)), "a demo-reranker run"))


def train_demo_reranker(
    out: str,
    model: str | None = None,
    corpus: str | None = None,
    claims: str | None = "bundled",
    titles: int = TITLES,
    steps: int = 150,
    layers: int | None = None,
    trainable_layers: int | None = None,
    head_pooling: str = "cls",
    group_size: int = 4,
    batch_size: int = 4,
    max_length: int = 192,
    lr: float = 1e-4,
    teacher: str | None = None,
    distill_weight: float = 1.0,
    teacher_bm25: float = 0.0,
    residual: bool = False,
    mine: str = "bm25",
    first_stage: str | None = None,
    evals: int = 2,
    dev_by: str = "query",
    passage_window: int | None = None,
    passage_stride: int | None = None,
    max_windows: int | None = 3,
    window_choice: str = "model",
    seed: int = 0,
    dev_seed: int | None = None,
    progress: bool = True,
) -> str:
    """Train (or reuse) the demo reranker under `out`; returns the directory to pass to CrossEncoder/--reranker.

    layers: keep only the first N encoder layers (None: all; module docstring for why all).
    trainable_layers: train only the top N of them and the head (None: all; `RerankerTrainConfig`).
    head_pooling: what the relevance head reads, "cls" or "mean" (`RerankerTrainConfig`).
    seed / dev_seed: the run's draws, and the dev split's (None: `seed`; `TrainSettings`).
    dev_by: "query" (10 % of the claims) or "document" (no dev claim's evidence is a training claim's;
        `split_dev`).
    evals: dev evaluations, evenly spaced, the last at the final step. Two, not more: a dev pass costs
        as much as ~30 training steps, and the first third of a run was never the best checkpoint
        (docs/results.md, "The reranker twotower ships").
    teacher / distill_weight / teacher_bm25 / residual / mine / first_stage: as `RerankerTrainConfig` (teacher "embedded": the
        embedded all-MiniLM-L6-v2, the dense model the demo index is built with).

    claims: ``{query, pos: [doc ids]}`` JSONL(.gz) over `corpus`; "bundled" = the SciFact train claims when
        `corpus` is the bundled sample (else title/text pairs); None = title/text pairs from `corpus`.
    titles: how many documents' titles become queries when the pairs are title/text (drawn at random).
    passage_window / passage_stride / max_windows: read abstracts as windows of this many tokens, scored by
        the best (`RerankerTrainConfig`; None: the head of each up to `max_length`).
    window_choice: with windows, the window of a training document a step trains on: the one the model scores
        best ("model") or the one BM25 ranks best ("bm25", ~40 % less time a step; `RerankerTrainConfig`).
    """
    from twotower.retrieval.manifest import default_model_dir
    from twotower.retrieval.training.train_reranker import RerankerTrainConfig, teacher_dir, train_reranker

    if evals < 1:
        raise ValueError(f"evals={evals}: need at least one dev evaluation to choose a checkpoint (--evals)")
    # before any work, in this command's own words (the config below would name train reranker's --max-steps)
    check_setting(steps >= 1, "steps", steps, "--steps", "give 1 or more")
    check_setting(layers is None or layers >= 1, "layers", layers, "--layers", "give 1 or more (None: all)")
    check_out(out)
    model = model or default_model_dir()
    teacher = teacher_dir(teacher)
    corpus = corpus or BUNDLED_CORPUS
    if claims == "bundled":
        claims = BUNDLED_CLAIMS if os.path.abspath(corpus) == os.path.abspath(BUNDLED_CORPUS) else None
    settings = {"model": os.path.abspath(model), "corpus": os.path.abspath(corpus),
                "claims": os.path.abspath(claims) if claims else None, "steps": steps,
                "layers": layers, "trainable_layers": trainable_layers, "head_pooling": head_pooling,
                "group_size": group_size, "batch_size": batch_size, "max_length": max_length,
                "lr": lr, "seed": seed, "evals": evals}
    if first_stage is None and teacher is not None:
        first_stage = "dense"  # as RerankerTrainConfig resolves it, so that the cache key says what dev reranked
    if first_stage == "bm25" and teacher is None:
        first_stage = None  # the default without a teacher: older caches keep their key
    if teacher is not None or mine != "bm25" or first_stage is not None:  # older caches keep their key
        settings.update(teacher=os.path.abspath(teacher) if teacher else None, distill_weight=distill_weight,
                        mine=mine, first_stage=first_stage)
    if teacher_bm25:
        settings.update(teacher_bm25=teacher_bm25)
    if residual:
        settings.update(residual=True)
    if dev_by != "query":
        settings.update(dev_by=dev_by)
    if dev_seed is not None and dev_seed != seed:
        settings.update(dev_seed=dev_seed)
    if titles != TITLES and not claims:
        settings.update(titles=titles)
    if passage_window is not None:
        settings.update(passage_window=passage_window, passage_stride=passage_stride, max_windows=max_windows)
    if window_choice != "model":  # older caches keep their key
        settings.update(window_choice=window_choice)
    best = os.path.join(out, "best")
    marker = os.path.join(out, MARKER)
    if os.path.isfile(marker) and os.path.isdir(best):
        with open(marker, encoding="utf-8") as f:
            earlier = json.load(f)
        if earlier.get("settings") == settings and earlier.get("finished", True):  # markers before "finished": done
            return best
    os.makedirs(out, exist_ok=True)
    # claimed at once, so that an interrupted run is known as this command's (and trained again, not reused)
    atomic_write_text(marker, json.dumps({"settings": settings, "finished": False}, indent=2) + "\n")
    start = model
    if layers is not None:
        start = truncated_encoder(model, layers, os.path.join(out, "start"))
    if claims:
        data, data_corpus = claims, corpus
    else:
        data, data_corpus, mine = os.path.join(out, "title_abstract_pairs.jsonl"), None, None
        title_abstract_pairs(corpus, data, queries=titles, seed=seed)
    cfg = RerankerTrainConfig(
        model=start, pairs=data, corpus=data_corpus, out=out, mine=mine, loss="listwise", group_size=group_size,
        batch_size=batch_size, max_length=max_length, lr=lr, head_lr_scale=10.0, warmup=0.05, max_steps=steps,
        eval_every=max(1, math.ceil(steps / evals)), dev_rerank_k=20, eval_at_start=False, seed=seed, progress=progress,
        dev_by=dev_by, dev_seed=dev_seed,
        trainable_layers=trainable_layers, head_pooling=head_pooling, teacher=teacher,
        distill_weight=distill_weight, teacher_bm25=teacher_bm25, residual=residual, first_stage=first_stage,
        passage_window=passage_window, passage_stride=passage_stride, max_windows=max_windows,
        window_choice=window_choice,
        resumable=False,  # minutes long, and rerun from the start when interrupted (its marker above)
    )
    result = train_reranker(cfg)
    if result.best_dir is None:
        raise NoCheckpointError(f"training kept no checkpoint ({result.stopped_by}); the log is in "
                                f"{os.path.join(out, 'train_log.jsonl')}: try another --seed, or a lower --lr")
    from twotower.retrieval.interpolation import read_alpha

    atomic_write_text(marker, json.dumps({"settings": settings, "best_dev_ndcg@10": result.best_score,
                                          "interpolation_alpha": read_alpha(result.best_dir),
                                          "first_stage_dev_ndcg@10": result.first_stage_score,
                                          "best_step": result.best_step, "stopped_by": result.stopped_by,
                                          "finished": True}, indent=2) + "\n")
    return result.best_dir
