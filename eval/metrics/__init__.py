"""Evaluation metrics, pure numpy: no import from encoder/, indexing/ or retrieval/.

Retrieval metrics follow trec_eval (checked against pytrec_eval); QA follows
the official SQuAD scripts; tagging follows conlleval/seqeval; classification
and correlation follow scikit-learn / scipy conventions.
"""

from twotower.eval.metrics.classification import (
    ClassificationReport,
    accuracy,
    classification_report,
    confusion_matrix,
    misclassified,
)
from twotower.eval.metrics.correlation import CorrelationResult, average_ranks, pearson, spearman
from twotower.eval.metrics.distributions import betainc, student_t_ppf, student_t_sf, student_t_two_sided_p
from twotower.eval.metrics.language_model import (
    MLMAccumulator,
    log_softmax,
    mlm_accuracy,
    mlm_counts,
    mlm_perplexity,
    perplexity,
)
from twotower.eval.metrics.names import KNOWN_METRICS, MetricSpec, parse_metric, parse_metrics
from twotower.eval.metrics.qa import (
    exact_match,
    normalize_answer,
    squad_v1_scores,
    squad_v2_raw_scores,
    squad_v2_scores,
    token_f1,
    token_f1_v2,
)
from twotower.eval.metrics.ranking import query_metrics, rank_documents, recall_curve
from twotower.eval.metrics.retrieval import (
    DEFAULT_METRICS,
    Qrels,
    RetrievalEvaluation,
    Run,
    evaluate,
    mean_recall_curve,
    ranked_relevance,
)
from twotower.eval.metrics.significance import (
    SignificanceResult,
    paired_randomization_test,
    paired_t_interval,
    paired_t_test,
)
from twotower.eval.metrics.tagging import TaggingReport, get_entities, tagging_report

__all__ = [
    "DEFAULT_METRICS",
    "KNOWN_METRICS",
    "ClassificationReport",
    "CorrelationResult",
    "MLMAccumulator",
    "MetricSpec",
    "Qrels",
    "RetrievalEvaluation",
    "Run",
    "SignificanceResult",
    "TaggingReport",
    "accuracy",
    "average_ranks",
    "betainc",
    "classification_report",
    "confusion_matrix",
    "evaluate",
    "exact_match",
    "get_entities",
    "log_softmax",
    "mean_recall_curve",
    "misclassified",
    "mlm_accuracy",
    "mlm_counts",
    "mlm_perplexity",
    "normalize_answer",
    "paired_randomization_test",
    "paired_t_interval",
    "paired_t_test",
    "parse_metric",
    "parse_metrics",
    "pearson",
    "perplexity",
    "query_metrics",
    "rank_documents",
    "ranked_relevance",
    "recall_curve",
    "spearman",
    "squad_v1_scores",
    "squad_v2_raw_scores",
    "squad_v2_scores",
    "student_t_ppf",
    "student_t_sf",
    "student_t_two_sided_p",
    "tagging_report",
    "token_f1",
    "token_f1_v2",
]
