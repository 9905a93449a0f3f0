"""Readers and writers for evaluation data; every malformed line raises ``DataError`` naming ``path:line``."""

from twotower.eval.io.beir import (
    BeirDataset,
    BeirDocument,
    available_splits,
    iter_beir_corpus,
    iter_beir_queries,
    load_beir,
    read_beir_corpus,
    read_beir_qrels,
    read_beir_queries,
    write_beir_corpus,
    write_beir_qrels,
    write_beir_queries,
)
from twotower.eval.io.conll import TaggedSentence, read_conll, write_conll
from twotower.eval.io.msmarco import (
    iter_id_text_tsv,
    iter_msmarco_triples,
    read_id_text_tsv,
    read_msmarco_qrels,
    read_msmarco_run,
    write_msmarco_run,
)
from twotower.eval.io.qrels import detect_qrels_format, read_qrels
from twotower.eval.io.squad import (
    SquadExample,
    read_squad,
    read_squad_predictions,
    squad_references,
    write_squad_predictions,
)
from twotower.eval.io.trec import read_trec_qrels, read_trec_run, write_trec_qrels, write_trec_run
from twotower.eval.io.tsv import LabeledExample, read_classification_tsv, write_classification_tsv

__all__ = [
    "BeirDataset",
    "BeirDocument",
    "LabeledExample",
    "SquadExample",
    "TaggedSentence",
    "available_splits",
    "detect_qrels_format",
    "iter_beir_corpus",
    "iter_beir_queries",
    "iter_id_text_tsv",
    "iter_msmarco_triples",
    "load_beir",
    "read_beir_corpus",
    "read_beir_qrels",
    "read_beir_queries",
    "read_classification_tsv",
    "read_conll",
    "read_id_text_tsv",
    "read_msmarco_qrels",
    "read_msmarco_run",
    "read_qrels",
    "read_squad",
    "read_squad_predictions",
    "read_trec_qrels",
    "read_trec_run",
    "squad_references",
    "write_beir_corpus",
    "write_beir_qrels",
    "write_beir_queries",
    "write_classification_tsv",
    "write_conll",
    "write_msmarco_run",
    "write_squad_predictions",
    "write_trec_qrels",
    "write_trec_run",
]
