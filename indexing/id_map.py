"""Two-way map between string document ids and the int64 labels FAISS stores.

Labels are handed out sequentially and never reused, so a label stays unambiguous in
old search results, in tombstone sets and across saves; a removed id's slot holds
``None``. The map is persisted as the plain list ``ids_by_label``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from twotower.indexing.search_result import MISSING_ID


class IdMap:
    """``id -> label`` and ``label -> id`` for one vector index."""

    def __init__(self, ids_by_label: Sequence[str | None] = ()) -> None:
        self._id_by_label: list[str | None] = list(ids_by_label)
        self._label_of = {i: lab for lab, i in enumerate(self._id_by_label) if i is not None}
        if len(self._label_of) != sum(i is not None for i in self._id_by_label):
            raise ValueError("IdMap: an id appears under two labels")
        self._lookup: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        """Number of live ids."""
        return len(self._label_of)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._label_of

    @property
    def next_label(self) -> int:
        return len(self._id_by_label)

    def ids(self) -> list[str]:
        """Live ids in label (= insertion) order."""
        return [i for i in self._id_by_label if i is not None]

    def live_labels(self) -> np.ndarray:
        """Sorted labels of the live ids.  # (n,) int64"""
        return np.array(sorted(self._label_of.values()), dtype=np.int64)

    def labels(self, ids: Iterable[str]) -> np.ndarray:
        """Labels of ``ids`` (all must be present, else KeyError).  # (n,) int64"""
        return np.array([self._label_of[i] for i in ids], dtype=np.int64)

    def labels_present(self, ids: Iterable[str]) -> np.ndarray:
        """Sorted labels of those ``ids`` that are present (others skipped).  # (n,) int64"""
        get = self._label_of.get
        out = np.fromiter((lab for lab in map(get, ids) if lab is not None), dtype=np.int64)
        out.sort()
        return out

    def assign(self, ids: Sequence[str]) -> np.ndarray:
        """Give new ids fresh labels (caller guarantees they are absent).  # (n,) int64"""
        start = len(self._id_by_label)
        self._id_by_label.extend(ids)
        self._label_of.update(zip(ids, range(start, start + len(ids))))
        self._lookup = None
        return np.arange(start, start + len(ids), dtype=np.int64)

    def release(self, ids: Sequence[str]) -> np.ndarray:
        """Forget present ids; returns their labels.  # (n,) int64"""
        labels = self.labels(ids)
        for i, lab in zip(ids, labels.tolist()):
            del self._label_of[i]
            self._id_by_label[lab] = None
        self._lookup = None
        return labels

    def state(self) -> list[str | None]:
        """JSON-able form (the ``ids_by_label`` list)."""
        return list(self._id_by_label)

    def lookup(self) -> tuple[np.ndarray, np.ndarray]:
        """``(names, alive)`` indexed by label, cached until the next change.

        ``names`` is an object array of ids (``""`` for released labels) and ``alive`` a bool
        array, so a (Q, k) label matrix maps to ids with one fancy-indexing step.
        """
        if self._lookup is None:
            ids = self._id_by_label or [None]
            names = np.array([MISSING_ID if i is None else i for i in ids], dtype=object)
            alive = np.array([i is not None for i in ids], dtype=bool)
            self._lookup = (names, alive)
        return self._lookup
