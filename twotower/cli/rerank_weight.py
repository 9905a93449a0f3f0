"""What a command tells its user about the reranker weight it applies, shared by `search` and `eval`.

A weight suits the first stage it was chosen over (`twotower.retrieval.interpolation`); a reranker
trained without ``--teacher`` chose it over BM25's ranking, and these commands rank with dense
(or the hybrid). Saying so on stderr keeps the ranking the user asked for and the JSON/TREC output clean.
"""

from __future__ import annotations

import sys


def weight_origin_note(pipe, hybrid: bool) -> str | None:
    """A one-line note when the stored weight a search applies was chosen over another first stage, else None."""
    want = "hybrid" if hybrid else "dense"
    chosen = pipe.rerank_alpha_chosen_over(hybrid)
    if chosen is None or chosen == want:
        return None
    shown = "/".join("BM25" if name == "bm25" else name for name in chosen.split("/"))
    return (f"note: the reranker's weight {pipe.rerank_alpha(None, hybrid=hybrid):g} was chosen over {shown}'s "
            f"ranking of its dev queries, and this search's first stage is {want}; --rerank-alpha overrides it, "
            "and `twotower train reranker --teacher INDEX` chooses it over your index's ranking")


def print_weight_origin(pipe, hybrid: bool) -> None:
    """`weight_origin_note` on stderr, when there is one."""
    note = weight_origin_note(pipe, hybrid)
    if note:
        print(note, file=sys.stderr)
