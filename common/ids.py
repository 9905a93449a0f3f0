"""Document ids as a caller hands them to a method that takes several: one rule for every such method.

Why a shared helper: a ``str`` is itself an iterable of strings, so ``delete("ab")`` deleted the documents
"a" and "b", and ``delete("4983")`` removed "4", "9", "8" and "3" (data loss, without a word). The index
(`twotower.indexing.IndexStore`, `DocStore`) and the pipeline (`twotower.retrieval.SearchPipeline`) refuse
a bare string the same way; neither may import the other, so the rule lives here.
"""

from __future__ import annotations

from collections.abc import Iterable


def id_list(ids: Iterable[str | int], method: str) -> list[str]:
    """`ids` as the index stores them, in order: a list of strings.

    An integer is its decimal text (a corpus's ``{"_id": 77}`` is stored as "77", so ``get([77])`` finds it);
    a bare ``str``, ``bytes`` or anything but an iterable of ids is refused, naming `method` (the caller's
    method, as the user wrote it), since iterating a string would read each character as an id.

    Example:
        >>> id_list(["a", 7], "get")
        ['a', '7']
        >>> id_list("ab", "delete")
        Traceback (most recent call last):
        ...
        TypeError: delete takes a list of ids; wrap a single id in a list: delete(['ab'])
    """
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
        single = f": {method}([{ids!r}])" if isinstance(ids, str) else ""
        raise TypeError(f"{method} takes a list of ids; wrap a single id in a list{single}")
    out = []
    for i, doc_id in enumerate(ids):
        if type(doc_id) is not str:  # the fast path for the usual list of strings skips the checks below
            if isinstance(doc_id, int) and not isinstance(doc_id, bool):
                doc_id = str(doc_id)
            elif not isinstance(doc_id, str):
                raise TypeError(f"{method}: id {i} is {type(doc_id).__name__}; ids are strings (or integers)")
        out.append(doc_id)
    return out
