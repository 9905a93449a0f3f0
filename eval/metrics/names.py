"""Metric names as strings: ``ndcg@10``, ``mrr@10``, ``recall@100``, ``p@5``, ``map``, ``map@100``, ``rprec``.

One small parser instead of a registry: every retrieval metric is a family
name plus an optional cutoff, and the label the user typed is kept verbatim so
that reports and ``--json`` keys read exactly as written on the command line.

trec_eval equivalents (for reading papers and checking against pytrec_eval):

=============  ==========================  ==================================
our name       trec_eval measure           note
=============  ==========================  ==================================
``ndcg@k``     ``ndcg_cut.k``              graded gains, ``ndcg`` = no cutoff
``mrr@k``      ``recip_rank`` on top k     trec_eval has no cutoff; we apply it
``recall@k``   ``recall.k``                ``recall`` = no cutoff
``p@k``        ``P.k``                     always divides by k
``map``        ``map``
``map@k``      ``map_cut.k``               divides by all relevant, not min(k, R)
``rprec``      ``Rprec``
=============  ==========================  ==================================
"""

from __future__ import annotations

import re
from typing import NamedTuple

# family -> (canonical family, cutoff allowed, cutoff required)
_FAMILIES: dict[str, tuple[str, bool, bool]] = {
    "ndcg": ("ndcg", True, False),
    "mrr": ("mrr", True, False),
    "rr": ("mrr", True, False),
    "recip_rank": ("mrr", True, False),
    "recall": ("recall", True, False),
    "r": ("recall", True, True),
    "p": ("p", True, True),
    "precision": ("p", True, True),
    "map": ("map", True, False),
    "ap": ("map", True, False),
    "rprec": ("rprec", False, False),
    "r-prec": ("rprec", False, False),
    "r-precision": ("rprec", False, False),
}

KNOWN_METRICS = "ndcg[@k], mrr[@k], recall[@k], p@k, map[@k], rprec"

_PATTERN = re.compile(r"^\s*([a-z_\-]+)\s*(?:[@._]\s*(\d+))?\s*$")


class MetricSpec(NamedTuple):
    """A parsed metric: ``family`` in {ndcg, mrr, recall, p, map, rprec}, ``k`` or None, ``label`` as typed."""

    family: str
    k: int | None
    label: str

    @property
    def canonical(self) -> str:
        """Lower-case name with the cutoff, e.g. ``ndcg@10`` for ``NDCG@10``."""
        return self.family if self.k is None else f"{self.family}@{self.k}"


def parse_metric(name: str) -> MetricSpec:
    """Parse one metric name such as ``"ndcg@10"`` or ``"MAP"``.

    ``@`` is the separator we write; ``.`` and ``_`` are accepted too so that
    trec_eval spellings like ``ndcg_cut.10`` are not needed but ``P.5`` works.

    Raises:
        ValueError: unknown family, a cutoff that is not a positive integer,
            or a family that needs a cutoff (``p``) given without one.
    """
    label = name.strip()
    match = _PATTERN.match(label.lower())
    if not match or match.group(1) not in _FAMILIES:
        head = re.match(r"^\s*([a-z_\-]+?)\s*@", label.lower())
        if head and head.group(1) in _FAMILIES:  # `ndcg@-1`, `recall@1e9`: the family is right, the cutoff not
            raise ValueError(f"metric {name!r}: the cutoff must be a positive integer, e.g. {head.group(1)}@10")
        raise ValueError(f"unknown metric {name!r}; known: {KNOWN_METRICS}")
    family, allows_k, needs_k = _FAMILIES[match.group(1)]
    k = int(match.group(2)) if match.group(2) is not None else None
    if k is not None and not allows_k:
        raise ValueError(f"metric {name!r} takes no cutoff")
    if k is None and needs_k:
        raise ValueError(f"metric {name!r} needs a cutoff, e.g. {match.group(1)}@10")
    if k is not None and k <= 0:
        raise ValueError(f"metric {name!r}: cutoff must be a positive integer")
    return MetricSpec(family, k, label)


def parse_metrics(names: str | list[str] | tuple[str, ...]) -> list[MetricSpec]:
    """Parse a comma-separated string or a list of names; a metric named twice (``ndcg@10,NDCG@010``) is kept
    once, under its first spelling, in order."""
    items = names.split(",") if isinstance(names, str) else list(names)
    specs: list[MetricSpec] = []
    seen: set[str] = set()
    for item in items:
        if not item.strip():
            continue
        spec = parse_metric(item)
        if spec.canonical not in seen:
            seen.add(spec.canonical)
            specs.append(spec)
    if not specs:
        raise ValueError(f"no metric given; known: {KNOWN_METRICS}")
    return specs
