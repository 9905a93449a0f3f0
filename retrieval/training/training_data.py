"""Readers for retrieval training data, and the dev split carved out of train.

Three inputs, one in-memory shape:

* a BEIR directory: ``queries.jsonl`` + ``qrels/<split>.tsv`` + ``corpus.jsonl``;
* a JSONL file ``{"query", "pos": [...], "neg": [...]}`` whose items are document
  texts, or document ids of a corpus given alongside (``pos_ids`` / ``neg_ids``
  name ids explicitly);
* labeled pairs ``(query, passage, label)`` as TSV or JSONL, binary or graded.

Everything becomes `TrainExample` (query + positive and negative *document ids*)
over a ``corpus`` dict, or `LabeledPair`.  Texts given inline get a content-hash
id, so that "the same positive twice in a batch" and "a hard negative that is
another query's positive" are decided on ids whichever way the data came.

Nothing is dropped silently: queries without a positive, positives missing from
the corpus, duplicate pairs, and the like are counted in a `Skipped` tally that
the trainers log and report; malformed input raises with ``file:line``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shlex
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from twotower.common.distributed import launched_as
from twotower.common.lines import is_json_lines, json_lines, numbered_lines
from twotower.indexing import document_text
from twotower.retrieval.corpus import example_ids, is_empty, iter_documents

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainExample:
    """One training query: its positives and (optional) hard negatives, as corpus ids."""

    query_id: str
    query: str
    positives: tuple[str, ...]
    negatives: tuple[str, ...] = ()


@dataclass(frozen=True)
class LabeledPair:
    """One judged (query, document) pair. ``label`` is 0/1 or a graded judgment >= 0."""

    query_id: str
    query: str
    doc_id: str
    label: float


@dataclass
class Skipped:
    """Counted, reported skips: reason -> count, plus the first few places each happened."""

    counts: Counter = field(default_factory=Counter)
    where: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, location: str, n: int = 1) -> None:
        self.counts[reason] += n
        places = self.where.setdefault(reason, [])
        if len(places) < 3:
            places.append(location)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def summary(self) -> str:
        """One line per reason, e.g. ``"3 positives missing from the corpus (e.g. q1:d9, ...)"``."""
        return "; ".join(f"{n} {reason} (e.g. {', '.join(self.where[reason])})"
                         for reason, n in sorted(self.counts.items()))

    def as_dict(self) -> dict[str, int]:
        return dict(self.counts)


@dataclass
class TrainingSet:
    """Examples over a corpus (id -> text), with what was skipped while reading."""

    examples: list[TrainExample]
    corpus: dict[str, str]
    skipped: Skipped
    source: str


@dataclass
class PairSet:
    """Labeled pairs over a corpus (id -> text). ``max_label`` scales graded labels to [0, 1]."""

    pairs: list[LabeledPair]
    corpus: dict[str, str]
    skipped: Skipped
    source: str
    max_label: float = 1.0
    # query id -> "file:line" of its first pair, so that a skip names a line, not a generated id
    where: dict[str, str] = field(default_factory=dict)


def text_id(text: str) -> str:
    """A stable id for a document given as text (equal texts share it)."""
    return "t:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def query_key(query: str) -> str:
    """Query id for inputs without one: equal query texts are one query (for the dev split, for grouping)."""
    return "q:" + hashlib.sha1(query.strip().encode("utf-8")).hexdigest()[:16]


# ---- corpus ------------------------------------------------------------------------------------------
def read_corpus(path: str) -> dict[str, str]:
    """``corpus.jsonl`` -> {id: document_text}; a repeated id is an error naming both lines.

    A document whose text and title are both blank is left out, counted in a warning: it has nothing to
    train on, and a judgment of it is then a counted skip like any document missing from the corpus. It
    stopped training at the first (Cranfield has two), where ``index build`` can skip them
    (``--on-empty skip``).
    """
    corpus: dict[str, str] = {}
    first: dict[str, int] = {}
    empty: list[str] = []
    for lineno, doc in iter_documents(path, keep_empty=True):
        doc_id = doc["id"]
        if is_empty(doc):
            empty.append(doc_id)
            continue
        if doc_id in corpus:
            raise ValueError(f"{path}:{lineno}: document id {doc_id!r} appears twice (first on line {first[doc_id]})")
        first[doc_id] = lineno
        corpus[doc_id] = document_text(doc)  # "title text": exactly what the index encodes
    if not corpus:
        raise ValueError(f"{path}: corpus is empty" + (f" ({len(empty)} documents with blank text and title)"
                                                       if empty else ""))
    if empty and launched_as().is_main:  # under torchrun every rank reads the corpus: said once
        logger.warning("%s: %d document%s with blank text and title left out (judgments of them are skipped as "
                       "missing from the corpus): %s", path, len(empty), "s" * (len(empty) != 1),
                       example_ids(empty, len(empty)))
    return corpus


def read_titles(path: str) -> dict[str, str]:
    """``corpus.jsonl`` -> {id: title} for the documents that have a title.

    Why apart from `read_corpus`: a reranker that reads documents window by window puts the title in
    front of every window (`twotower.retrieval.cross_encoder.CrossEncoder.windows`), so it needs the title
    separately from the "title text" string everything else trains on.
    """
    return {doc["id"]: doc["title"] for _, doc in iter_documents(path, keep_empty=True)
            if (doc.get("title") or "").strip()}


def titled_documents(corpus: Mapping[str, str], titles: Mapping[str, str]) -> dict[str, str | tuple[str, str]]:
    """The corpus as a windowed reranker reads it: ``(title, text)`` where `titles` has one, else the text.

    `read_corpus` joined them as "title text" (`twotower.indexing.document_text`); this splits there again.
    """
    out: dict[str, str | tuple[str, str]] = {}
    for d, text in corpus.items():
        title = titles.get(d)
        out[d] = (title, text[len(title) + 1:]) if title and text.startswith(title + " ") else text
    return out


def _string(obj: dict, key: str, where: str, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise ValueError(f"{where}: missing field {key!r}")
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


# ---- BEIR --------------------------------------------------------------------------------------------
def read_beir_training(directory: str, split: str = "train", corpus: dict[str, str] | None = None) -> TrainingSet:
    """Training examples from a BEIR directory's ``qrels/<split>.tsv``.

    Judgments > 0 are positives; judgments <= 0 are kept as (labelled) hard
    negatives.  A judged query without any positive, and positives absent from
    the corpus, are counted skips.
    """
    from twotower.eval.io.beir import load_beir

    data = load_beir(directory, split=split, corpus=False)
    corpus = corpus if corpus is not None else read_corpus(os.path.join(directory, "corpus.jsonl"))
    qrels_path = os.path.join(directory, "qrels", f"{split}.tsv")
    skipped = Skipped()
    examples = []
    for qid, judged in data.qrels.items():
        pos, neg = [], []
        for did, rel in judged.items():
            if did not in corpus:
                skipped.add("judged documents missing from the corpus", f"{qid}:{did}")
                continue
            (pos if rel > 0 else neg).append(did)
        if not pos:
            skipped.add("queries with no positive in the corpus", qid)
            continue
        examples.append(TrainExample(qid, data.queries[qid], tuple(pos), tuple(neg)))
    if not examples:
        raise ValueError(f"{qrels_path}: no usable training query ({skipped.summary() or 'file is empty'})")
    return TrainingSet(examples, corpus, skipped, qrels_path)


# ---- {"query", "pos", "neg"} JSONL -------------------------------------------------------------------
def read_jsonl_training(path: str, corpus: dict[str, str] | None = None) -> TrainingSet:
    """Training examples from JSONL lines ``{"query", "pos": [...], "neg": [...]}``.

    Items of ``pos``/``neg`` are texts, or ids of `corpus` when one is given and
    the item is one of its ids; ``pos_ids``/``neg_ids`` are always ids.  An id
    not in the corpus is a counted skip (a missing *positive* is worth knowing
    about: the line may be stale against a rebuilt corpus).  Lines with the
    same query are merged.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"training file not found: {path}")
    corpus = dict(corpus) if corpus is not None else {}
    own_texts = corpus == {}
    skipped = Skipped()
    merged: dict[str, dict] = {}
    n_lines = 0
    for lineno, obj in json_lines(path):
        n_lines += 1
        where = f"{path}:{lineno}"
        query = _string(obj, "query", where)
        if not query.strip():
            raise ValueError(f"{where}: field 'query' is empty")
        qid = _string(obj, "query_id", where, required=False) or query_key(query)
        entry = merged.setdefault(qid, {"query": query, "pos": [], "neg": [], "where": where})
        for kind in ("pos", "neg"):
            items = []
            for key, as_ids in ((kind, None), (f"{kind}_ids", True)):
                raw = obj.get(key, [])
                if isinstance(raw, str):
                    raw = [raw]
                # bool is an int to Python: `true` became the id "True"
                if not isinstance(raw, list) or not all(isinstance(x, (str, int)) and not isinstance(x, bool)
                                                        for x in raw):
                    raise ValueError(f"{where}: field {key!r} must be a list of strings (or integer ids)")
                items += [(str(x), as_ids) for x in raw]
            for item, as_ids in items:
                if as_ids is None:
                    as_ids = not own_texts and item in corpus
                if as_ids:
                    if item not in corpus:
                        what = "positive" if kind == "pos" else "negative"
                        skipped.add(f"{what} ids missing from the corpus", f"{where}:{item}")
                        continue
                    did = item
                else:
                    if not item.strip():
                        skipped.add("empty document texts", where)
                        continue
                    did = text_id(item)
                    corpus.setdefault(did, item)
                target = entry[kind]
                if did in target:
                    skipped.add("duplicate pairs", f"{where}:{did}")
                    continue
                target.append(did)
    if n_lines == 0:
        raise ValueError(f"{path}: training file is empty")
    examples = []
    for qid, e in merged.items():
        if not e["pos"]:
            skipped.add("queries with no positive", e["where"])
            continue
        neg = tuple(d for d in e["neg"] if d not in set(e["pos"]))
        if len(neg) < len(e["neg"]):
            skipped.add("negatives that are also positives", e["where"], len(e["neg"]) - len(neg))
        examples.append(TrainExample(qid, e["query"], tuple(e["pos"]), neg))
    if not examples:
        raise ValueError(f"{path}: no usable training query ({skipped.summary()})")
    return TrainingSet(examples, corpus, skipped, path)


def read_training(source: str, split: str = "train", corpus_path: str | None = None) -> TrainingSet:
    """Dispatch on the source: a BEIR directory or a ``.jsonl`` file (ids resolved against `corpus_path`)."""
    if os.path.isdir(source):
        corpus = read_corpus(corpus_path) if corpus_path else None
        return read_beir_training(source, split=split, corpus=corpus)
    if not os.path.exists(source):
        raise FileNotFoundError(f"training data not found: {source}")
    if not is_json_lines(source):
        raise ValueError(f"{source}: expected a BEIR directory or a .jsonl(.gz) file of {{query, pos, neg}}")
    return read_jsonl_training(source, corpus=read_corpus(corpus_path) if corpus_path else None)


# ---- labeled pairs -----------------------------------------------------------------------------------
# The largest grade a pairs file may hold unless the caller names its own scale (`read_labeled_pairs`'s
# max_label). Relevance scales in use are small (TREC and MS MARCO 0-3, Likert 1-5 or 1-10, at most a
# percentage); grades are scaled by the largest, so one far above the rest (1e308: a score column, a typo)
# turned every other positive into a target of about 0, the same as a negative's, with no error.
MAX_GRADE = 100


def _label(raw: object, where: str, limit: float = MAX_GRADE) -> float:
    """A pair's label: a number from 0 to `limit`, or a ValueError naming ``file:line`` (a TSV field is shown
    quoted, a JSON value as JSON)."""
    shown = repr(raw) if isinstance(raw, str) else json.dumps(raw)
    if len(shown) > 80:  # a passage in the label column (columns swapped) was quoted whole
        shown = shown[:60] + "..."
    try:
        if isinstance(raw, bool):  # JSON true/false: float() made them 1 and 0
            raise TypeError
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: label {shown} is not a number") from None
    if not math.isfinite(value) or not 0 <= value <= limit:
        raise ValueError(f"{where}: label {shown} is out of range (labels are 0/1 or integer grades from 0 to "
                         f"{limit:g})")
    return value


def read_labeled_pairs(path: str, max_label: float | None = None) -> PairSet:
    """Labeled pairs from TSV (``query<TAB>passage<TAB>label``, optional header) or JSONL.

    JSONL keys: ``query``, ``passage`` (or ``text``/``document``), ``label``,
    optional ``query_id``/``doc_id``.  Labels must be numbers from 0 to `MAX_GRADE`;
    above 1 they are graded judgments and must be integers (scaled by the largest,
    or by `max_label`, which then bounds them instead of `MAX_GRADE`).  A repeated
    pair with the same label is a counted skip; with a different label it is an error.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pairs file not found: {path}")
    rows: list[tuple[str, str | None, str, str | None, float, str]] = []
    limit = MAX_GRADE if max_label is None else max(MAX_GRADE, max_label)  # a lower max_label is checked below
    if is_json_lines(path):
        for lineno, obj in json_lines(path):
            where = f"{path}:{lineno}"
            query = _string(obj, "query", where)
            key = next((k for k in ("passage", "text", "document", "doc") if k in obj), "passage")
            passage = _string(obj, key, where)
            if "label" not in obj:
                raise ValueError(f"{where}: missing field 'label'")
            rows.append((query, _string(obj, "query_id", where, False), passage,
                         _string(obj, "doc_id", where, False), _label(obj["label"], where, limit), where))
    else:
        # numbered_lines: a byte-order mark (spreadsheet exports) is not part of the first query, a bad byte
        # is named by its line, and a field may be as long as a document is (csv caps fields at 128 KiB)
        for lineno, line in numbered_lines(path):
            fields = line.split("\t")
            if not any(x.strip() for x in fields):
                continue
            where = f"{path}:{lineno}"
            if len(fields) != 3:
                raise ValueError(f"{where}: expected 3 tab-separated columns 'query passage label', "
                                 f"got {len(fields)}")
            if lineno == 1 and fields[2].strip().lower() in ("label", "score", "relevance"):
                continue  # header
            try:
                label = _label(fields[2], where, limit)
            except ValueError as e:
                if lineno != 1:
                    raise
                # a header in another order ("label query passage") was read as a pair, its error naming a label
                raise ValueError(f"{e}; the columns are query, passage, label, and a header line ends in 'label', "
                                 "'score' or 'relevance'") from None
            rows.append((fields[0], None, fields[1], None, label, where))
    if not rows:
        raise ValueError(f"{path}: pairs file is empty")
    top = max(r[4] for r in rows)
    if max_label is not None:
        for r in rows:
            if r[4] > max_label:
                raise ValueError(f"{r[5]}: label {r[4]:g} is out of range (max_label={max_label:g})")
    if top > 1:
        for r in rows:
            if r[4] != int(r[4]):
                raise ValueError(f"{r[5]}: graded label {r[4]:g} must be an integer (labels above 1 are grades)")
    scale = max_label if max_label is not None else max(1.0, top)
    corpus: dict[str, str] = {}
    skipped = Skipped()
    seen: dict[tuple[str, str], tuple[float, str]] = {}
    first: dict[str, str] = {}
    pairs = []
    for query, qid, passage, did, label, where in rows:
        if not query.strip() or not passage.strip():
            skipped.add("pairs with an empty query or passage", where)
            continue
        qid = qid or query_key(query)
        did = did or text_id(passage)
        if corpus.get(did, passage) != passage:
            raise ValueError(f"{where}: doc_id {did!r} was given another text earlier")
        corpus[did] = passage
        key = (qid, did)
        if key in seen:
            if seen[key][0] != label:
                raise ValueError(f"{where}: pair repeats line {seen[key][1].rsplit(':', 1)[-1]} with a different label "
                                 f"({label:g} vs {seen[key][0]:g})")
            skipped.add("duplicate pairs", where)
            continue
        seen[key] = (label, where)
        first.setdefault(qid, where)
        pairs.append(LabeledPair(qid, query, did, label))
    if not pairs:
        raise ValueError(f"{path}: no usable pair ({skipped.summary()})")
    return PairSet(pairs, corpus, skipped, path, max_label=float(scale), where=first)


# A pairs file whose first two columns are swapped (passage, query, label) reads without an error and trains a
# reranker on reversed pairs. In real pairs files queries are the short texts: built from the qrels of BEIR
# SciFact (train and test, alone and with 3 random negatives a positive, and its claim/evidence pairs), of the
# classic Cranfield, CISI, MEDLINE and ADI collections (alone and with negatives) and of XQuAD, the query was
# the longer text in at most 15.3% of pairs (CISI, whose queries are long), and its median length at most
# 0.20 of the passages'; swapped, in at least 84.7% of pairs, with a median 4.9 times the passages' or more.
# Fewer distinct passages than queries is no sign of a swap: positives-only SciFact and XQuAD files have it
# the right way round (several claims cite one abstract), so that test missed their swapped copies.
# A warning, not an error: a legitimate file can look the same (long texts matched to short labels, e.g.
# AG News articles to their class names, which every such test flags too).
SWAP_MIN_PAIRS = 10  # fewer pairs say little either way
SWAP_SHARE = 0.75  # of the pairs whose 'query' is the longer text
SWAP_MEDIAN_RATIO = 2.0  # median 'query' length over median 'passage' length


def swapped_columns(data: PairSet) -> str | None:
    """Why `data` looks like a pairs file with its query and passage columns swapped, or None.

    Fires when the 'query' text is the longer one in at least `SWAP_SHARE` of the pairs and its median
    length is at least `SWAP_MEDIAN_RATIO` times the passages' (the evidence is in the comment above);
    the answer gives those numbers and what to do, for the caller to prefix with the file.
    """
    n = len(data.pairs)
    if n < SWAP_MIN_PAIRS:
        return None
    queries = [len(p.query) for p in data.pairs]
    passages = [len(data.corpus[p.doc_id]) for p in data.pairs]
    longer = sum(q > d for q, d in zip(queries, passages))
    mq, mp = statistics.median(queries), statistics.median(passages)
    if longer < SWAP_SHARE * n or mq < SWAP_MEDIAN_RATIO * mp:
        return None
    fix = ("the values of 'query' and 'passage'" if is_json_lines(data.source) else
           f"awk -F'\\t' -v OFS='\\t' '{{print $2, $1, $3}}' {shlex.quote(data.source)} > swapped.tsv")
    return (f"the query is longer than the passage in {longer:,} of {n:,} pairs (median {mq:,.0f} against "
            f"{mp:,.0f} characters): are the query and passage swapped? A pairs file holds "
            "query<TAB>passage<TAB>label (JSONL: {query, passage, label}), and trained on it the other way round "
            f"the reranker learns to find queries for a passage; swap them ({fix}), or ignore this if your "
            "queries are meant to be the longer texts")


def pairs_from_training(data: TrainingSet) -> PairSet:
    """Positives (label 1) and hard negatives (label 0) of a TrainingSet as labeled pairs."""
    pairs = []
    for ex in data.examples:
        pairs += [LabeledPair(ex.query_id, ex.query, d, 1.0) for d in ex.positives]
        pairs += [LabeledPair(ex.query_id, ex.query, d, 0.0) for d in ex.negatives]
    return PairSet(pairs, data.corpus, data.skipped, data.source)


def training_from_pairs(data: PairSet) -> TrainingSet:
    """Group labeled pairs by query: label > 0 -> positives, label 0 -> negatives (graded order kept)."""
    groups: dict[str, dict] = {}
    for p in data.pairs:
        g = groups.setdefault(p.query_id, {"query": p.query, "pos": [], "neg": []})
        (g["pos"] if p.label > 0 else g["neg"]).append((p.label, p.doc_id))
    skipped = Skipped(Counter(data.skipped.counts), dict(data.skipped.where))
    examples = []
    for qid, g in groups.items():
        if not g["pos"]:
            skipped.add("queries with no positive", data.where.get(qid, qid))
            continue
        pos = tuple(d for _, d in sorted(g["pos"], key=lambda x: -x[0]))
        examples.append(TrainExample(qid, g["query"], pos, tuple(d for _, d in g["neg"])))
    if not examples:
        raise ValueError(f"{data.source}: no query has a positive pair ({skipped.summary()})")
    return TrainingSet(examples, data.corpus, skipped, data.source)


# ---- dev split ---------------------------------------------------------------------------------------
DEV_SPLITS = ("query", "document")


def carve_dev(data: TrainingSet, settings) -> tuple[list[TrainExample], list[TrainExample]]:
    """`split_dev` of a training set with a run's settings (``dev_fraction``, ``dev_split_seed``, ``dev_size``,
    ``dev_by``). A set it cannot split is refused naming its file and what was skipped from it: "2 queries"
    is a puzzle when the file held ten and eight had no positive."""
    try:
        return split_dev(data.examples, settings.dev_fraction, settings.dev_split_seed, settings.dev_size,
                         by=settings.dev_by)
    except ValueError as exc:
        skipped = f" (skipped: {data.skipped.summary()})" if data.skipped else ""
        raise ValueError(f"{data.source}: {exc}{skipped}") from None


def check_batch_fits(source: str, items: int, batch_size: int, what: str, ranks: int = 1) -> None:
    """Refuse, naming --batch-size and the file, a batch larger than the training split can fill.

    Why: batches are whole (every batch the same shape, as the cross-rank gather needs), so a split smaller
    than one batch never yields a step; the reranker's batch stream then looked for one for ever.
    """
    if items >= batch_size * ranks:
        return
    on = f" on each of {ranks} ranks" if ranks > 1 else ""
    raise ValueError(f"--batch-size {batch_size}{on}: the training split of {source} has {items} {what}, fewer "
                     f"than one batch needs; lower --batch-size (at most {items // ranks}) or add training data")


def split_dev(
    examples: Sequence[TrainExample], dev_fraction: float = 0.1, seed: int = 0, dev_size: int | None = None,
    by: str = "query",
) -> tuple[list[TrainExample], list[TrainExample]]:
    """Carve a dev split out of train *by query* (all lines of a query land on one side), seeded.

    by="document": also keep every positive document on one side. Queries that share a positive
    are grouped (transitively) and whole groups are dealt into dev, so no dev query's positive is a
    training query's positive. Why: with split by query, a dev query whose answer other training
    queries also cite rewards a model for remembering which documents are answers; choosing the
    checkpoint and the interpolation weight on such queries favours memorising over matching, which
    costs on new documents (on SciFact 50 of 81 dev claims cite evidence that train claims cite;
    docs/results.md). Groups larger than what is left of the dev budget are passed over, so dev can
    come out a few queries short of the target, never empty.

    The dev split is for model selection; test splits are for reporting only.
    """
    if by not in DEV_SPLITS:
        raise ValueError(f"dev split by {by!r}; choose one of {DEV_SPLITS}")
    qids = sorted({e.query_id for e in examples})
    if len(qids) < 2:
        raise ValueError(f"need at least 2 distinct queries to carve a dev split, got {len(qids)}")
    n_dev = dev_size if dev_size is not None else max(1, round(dev_fraction * len(qids)))
    if not 0 < n_dev < len(qids):
        raise ValueError(f"dev split of {n_dev} queries out of {len(qids)} leaves nothing to train on")
    groups = [[q] for q in qids] if by == "query" else _groups_sharing_positives(examples)
    random.Random(seed).shuffle(groups)
    dev_ids: set[str] = set()
    for g in groups:
        if len(dev_ids) + len(g) <= n_dev:
            dev_ids.update(g)
        if len(dev_ids) == n_dev:
            break
    if not dev_ids or len(dev_ids) == len(qids):
        raise ValueError(f"no dev split by document: the {len(qids)} queries' positives form one group; "
                         "split by query instead")
    return ([e for e in examples if e.query_id not in dev_ids], [e for e in examples if e.query_id in dev_ids])


def _groups_sharing_positives(examples: Sequence[TrainExample]) -> list[list[str]]:
    """Query ids grouped by shared positives (connected components; union-find), each group sorted, in
    order of its first query id, so the seeded shuffle alone decides the split."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in examples:
        q = find("q:" + e.query_id)
        for d in e.positives:
            parent[find("d:" + d)] = q = find(q)
    members: dict[str, list[str]] = {}
    for qid in sorted({e.query_id for e in examples}):
        members.setdefault(find("q:" + qid), []).append(qid)
    return sorted(members.values())


def qrels_of(examples: Sequence[TrainExample]) -> dict[str, dict[str, int]]:
    """{query id: {positive id: 1}} for evaluating a dev split."""
    out: dict[str, dict[str, int]] = {}
    for e in examples:
        out.setdefault(e.query_id, {}).update({d: 1 for d in e.positives})
    return out


def queries_of(examples: Sequence[TrainExample]) -> dict[str, str]:
    return {e.query_id: e.query for e in examples}


def merge_negatives(examples: Sequence[TrainExample], mined: Mapping[str, Sequence[str]]) -> list[TrainExample]:
    """Append mined negatives (query id -> doc ids) to examples, never adding one of the query's positives."""
    out = []
    for e in examples:
        extra = [d for d in mined.get(e.query_id, ()) if d not in e.positives and d not in e.negatives]
        out.append(TrainExample(e.query_id, e.query, e.positives, tuple(e.negatives) + tuple(extra)))
    return out
