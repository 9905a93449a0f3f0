"""What a command tells its user about the reranker weight it applies, shared by `search` and `eval`.

A weight suits the first stage it was chosen over (`twotower.retrieval.interpolation`); a reranker
trained without ``--teacher`` chose it over BM25's ranking, and these commands rank with dense
(or the hybrid). Saying so on stderr keeps the ranking the user asked for and the JSON/TREC output clean.
"""

from __future__ import annotations

import sys


def _shown(stage: str) -> str:
    return "/".join("BM25" if name == "bm25" else name for name in stage.split("/"))


def weight_origin_note(pipe, hybrid: bool, bm25: bool = False) -> str | None:
    """A one-line note when the stored weight a search applies was chosen over another first stage, else None."""
    from twotower.retrieval.interpolation import first_stage_name

    want = first_stage_name(hybrid, bm25)
    chosen = pipe.rerank_alpha_chosen_over(hybrid, bm25=bm25)
    if chosen is None or chosen == want:
        return None
    how = ("`twotower train reranker` without --teacher chooses it over BM25's ranking" if bm25 else
           "`twotower train reranker --teacher INDEX` chooses it over your index's ranking")
    return (f"note: the reranker's weight {pipe.rerank_alpha(None, hybrid=hybrid, bm25=bm25):g} was chosen over "
            f"{_shown(chosen)}'s ranking of its dev queries, and this search's first stage is {_shown(want)}; "
            f"--rerank-alpha overrides it, and {how}")


def print_weight_origin(pipe, hybrid: bool, bm25: bool = False) -> None:
    """`weight_origin_note` on stderr, when there is one."""
    note = weight_origin_note(pipe, hybrid, bm25)
    if note:
        print(note, file=sys.stderr)
