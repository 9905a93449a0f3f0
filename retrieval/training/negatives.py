"""Negatives for the trainers: a mined file merged in, BM25 mining before training, random fill-ins.

`train_dual` and `train_reranker` get their hard negatives the same three ways, from here:

* `add_mined_negatives`: a file written by `twotower.retrieval.training.mining.write_mined` (for instance
  by ``twotower train mine --retriever dense``); ids the corpus does not have, lines for queries the
  training data does not have and negatives that are the query's positives are dropped and counted, since
  a file mined against another corpus build would otherwise fail far into training, and one mined for
  other queries would change nothing; a file with no line for a training query is refused;
* `mine_negatives`: BM25 (or, given one, a dense retriever over the corpus) just before training,
  written to ``OUT/negatives.jsonl`` so that a run can be inspected and its negatives reused;
* `sample_negatives`: the k negatives of one query for one batch, drawn from its hard negatives and,
  when it has fewer than k, topped up with random corpus documents that are not its positives
  (counted, since a run that is mostly random fill-ins learns much less than its settings suggest).
"""

from __future__ import annotations

import os
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, astuple

from twotower.common.distributed import DistInfo, from_main
from twotower.common.errors import DataError
from twotower.retrieval.training.mining import (
    DenseRetriever,
    MiningConfig,
    bm25_retriever,
    iter_mined,
    mine_hard_negatives,
    write_mined,
)
from twotower.retrieval.training.training_data import Skipped, TrainExample, merge_negatives
from twotower.retrieval.training.training_run import TrainingRun


def add_mined_negatives(examples: Sequence[TrainExample], path: str, corpus: Mapping[str, str],
                        skipped: Skipped, known: Collection[str] | None = None) -> list[TrainExample]:
    """The examples with the negatives of a mined JSONL file appended; what cannot be used is counted in
    `skipped`, one reason each, at ``path:line``.

    known: the query ids of the whole training data (default: the examples'). The reranker merges into the
        training split alone, so a line for a dev query is known, held out, and not a skip.

    Counted: lines whose query is no training query, negative ids missing from `corpus`, and negatives that
    are that query's positives (they would teach it that its answer is wrong). A file in which no line is a
    training query's is refused: it was mined for other data (another split, another query-id scheme),
    and training without it would have looked like training with it.
    """
    by_id = {e.query_id: e for e in examples}
    known = set(by_id) if known is None else set(known) | set(by_id)
    mined: dict[str, list[str]] = {}
    lines = matched = 0
    strangers: list[str] = []
    for lineno, qid, ids in iter_mined(path):
        lines += 1
        where = f"{path}:{lineno}"
        if qid not in known:
            skipped.add("negatives-file lines whose query is no training query", where)
            strangers.append(qid)
            continue
        matched += 1
        example = by_id.get(qid)
        if example is None:  # a held-out (dev) query
            continue
        missing = sum(1 for d in ids if d not in corpus)
        if missing:
            skipped.add("mined negatives missing from the corpus", where, missing)
        positives = sum(1 for d in ids if d in example.positives)
        if positives:
            skipped.add("mined negatives that are the query's positives", where, positives)
        mined.setdefault(qid, []).extend(d for d in ids if d in corpus and d not in example.positives)
    if not lines:
        raise DataError(path, None, "no mined queries")
    if not matched:
        raise DataError(path, None, f"the --negatives file has no line for a training query: its {lines} lines' "
                        f"query ids (e.g. {strangers[0]!r}) are not the training data's (e.g. "
                        f"{min(known, default='')!r}); was it mined for other data? `twotower train mine` mines "
                        "negatives for this data")
    return merge_negatives(examples, {q: list(dict.fromkeys(ids)) for q, ids in mined.items()})


def mine_negatives(train: Sequence[TrainExample], corpus: Mapping[str, str], run: TrainingRun, *,
                   method: str, ranks: tuple[int, int], num_negatives: int, seed: int,
                   progress: bool, dense: DenseRetriever | None = None,
                   info: DistInfo | None = None) -> list[TrainExample]:
    """Negatives from `ranks` (1-based, inclusive) of BM25 or `dense`, written to ``run.out/negatives.jsonl``
    and merged in. Under torchrun (`info`), rank 0 mines once and the other ranks receive its result.

    method: the trainer's ``mine`` setting: "bm25", or "dense" with `dense` (a retriever over `corpus`;
    the reranker trainer builds one from its teacher; other dense models: ``twotower train mine
    --retriever dense``, then pass the file as negatives).
    """
    if info is not None and info.enabled:  # as JSON (nothing a rank receives is unpickled)
        return from_main(info, lambda: mine_negatives(train, corpus, run, method=method, ranks=ranks,
                                                      num_negatives=num_negatives, seed=seed, progress=progress,
                                                      dense=dense),
                         share=lambda mined: [astuple(e) for e in mined],
                         unshare=lambda rows: [TrainExample(q, t, tuple(p), tuple(n)) for q, t, p, n in rows])
    if method == "dense" and dense is None:
        raise ValueError("mine='dense' needs a dense retriever over the corpus (the reranker's --teacher)")
    if method not in ("bm25", "dense"):
        raise ValueError(f"mine={method!r}: choose 'bm25' or 'dense', or mine with `twotower train mine` "
                         "and pass the file as negatives")
    config = MiningConfig(rank_start=ranks[0], rank_end=ranks[1], num_negatives=num_negatives, seed=seed)
    retrieve = dense if method == "dense" else bm25_retriever(corpus)
    mined, stats = mine_hard_negatives(train, retrieve, list(corpus), config, progress=progress)
    if run.enabled:
        run.open()
        write_mined(os.path.join(run.out, "negatives.jsonl"), mined,
                    {"retriever": method, **asdict(config), "stats": stats.as_dict()})
    run.log("mining", retriever=method, **stats.as_dict())
    return merge_negatives(train, {m.query_id: m.negatives for m in mined})


def check_negatives_fit(train: Sequence[TrainExample], corpus_size: int, k: int, flag: str, value: int) -> None:
    """Refuse, naming the flag, a number of negatives per query that the corpus cannot supply.

    Why: a query short of hard negatives is topped up with random corpus documents that are not its
    positives; a corpus with fewer than k such documents can never fill the group, and the run would
    spin for ever instead of training. Checked once before training, so the error comes first.
    """
    if k <= 0 or not train:
        return
    worst = max(train, key=lambda e: len(set(e.positives)))
    positives = len(set(worst.positives))
    if corpus_size - positives < k:
        raise ValueError(f"{flag} {value}: each query needs {k} negatives besides its positives, but the corpus has "
                         f"{corpus_size} documents and the query {worst.query[:80]!r} has {positives} positive(s); lower "
                         f"{flag} or train on a larger corpus")


def sample_negatives(example: TrainExample, k: int, corpus_ids: Sequence[str],
                     rng: random.Random) -> tuple[list[str], int]:
    """k negative ids for `example` and how many of them are random fill-ins.

    k of its hard negatives drawn without replacement; with fewer than k, all of them and then random
    corpus documents that are neither a positive nor already chosen.  The draws come from `rng` in a
    fixed order, so a seeded run gets the same negatives every time. A corpus that cannot fill k is refused
    (`check_negatives_fit` says so in flag terms before training), never sampled for ever.
    """
    pool = list(example.negatives)
    chosen = rng.sample(pool, k) if len(pool) >= k else pool[:]
    excluded = set(example.positives) | set(chosen)
    if len(corpus_ids) - len(excluded) < k - len(chosen):  # maybe too few to draw from: count them (rare)
        free = sum(1 for d in set(corpus_ids) if d not in excluded)
        if free < k - len(chosen):
            raise ValueError(f"query {example.query[:80]!r}: {k} negatives are needed but the corpus has only "
                             f"{free + len(chosen)} documents that are not its positives")
    filled = 0
    while len(chosen) < k:
        d = corpus_ids[rng.randrange(len(corpus_ids))]
        if d not in example.positives and d not in chosen:
            chosen.append(d)
            filled += 1
    return chosen, filled
