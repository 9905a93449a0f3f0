"""One SearchPipeline shared by threads (issue 19, item 3), as a service shares it among requests.

Four real threads search the same pipeline while a real writer process commits to its index
and a fifth thread refreshes the pipeline's store: no call may fail, every hit carries its
text, and results equal those of the same query searched alone.
"""

from __future__ import annotations

import threading

from tests.indexing.procs import run_threads, run_with_refresher, start_writer, stop_writer
from tests.retrieval.pipeline_fixtures import sentences, tiny_model_dir, toy_docs, write_corpus
from twotower.retrieval import DualEncoder, SearchPipeline


def test_threads_share_one_pipeline(tmp_path):
    encoder = DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)
    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(80))
    SearchPipeline.build(corpus, tmp_path / "idx", encoder, metric="cosine", progress=False).close()
    pipe = SearchPipeline.load(tmp_path / "idx", encoder)
    queries = sentences(8, seed=9)
    alone = [[h.id for h in pipe.search(q, k=5)] for q in queries]  # before any writer: the reference

    errors: list[str] = []
    counts = {"searches": 0, "missing_text": 0, "refreshes": 0, "same": 0}
    lock = threading.Lock()
    done = threading.Event()

    def search_loop(t: int) -> None:
        i = t
        while not done.is_set():
            try:
                hits = pipe.search(queries[i % len(queries)], k=5)
                with lock:
                    counts["searches"] += 1
                    counts["missing_text"] += sum(h.text is None for h in hits)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
                return
            i += 1

    # phase 1: no writer: concurrent answers equal the answers searched alone
    def check_same(t: int) -> None:
        try:
            for i, q in enumerate(queries):
                if [h.id for h in pipe.search(q, k=5)] == alone[i]:
                    with lock:
                        counts["same"] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    run_threads([lambda t=t: check_same(t) for t in range(4)])
    assert errors == [], errors[:3]
    assert counts["same"] == 4 * len(queries)

    # phase 2: a writer commits and a thread refreshes while 4 threads search
    proc, stop = start_writer(tmp_path, tmp_path / "idx", encoder.dim)

    counts["refreshes"] = run_with_refresher(pipe.store, [lambda t=t: search_loop(t) for t in range(4)], done, errors,
                                             pause=0.02)
    commits, _ = stop_writer(proc, stop)
    pipe.close()
    assert errors == [], errors[:3]
    assert counts["missing_text"] == 0
    assert counts["searches"] > 20 and counts["refreshes"] > 5 and commits > 5, (counts, commits)
