"""twotower index build|add|delete|info|check: create, maintain and verify a search index directory.

build encodes a BEIR corpus.jsonl ({_id, title, text}) with the dual
encoder (default all-MiniLM-L6-v2) into a new index directory: SQLite documents
+ FAISS vectors (+ BM25 with --bm25).  It is resumable: rerun the same
command after an interruption and finished embedding shards are reused.  Under
torchrun --nproc_per_node N -m twotower index build ... the encoding is
split across the N processes.
"""  # plain text, not reStructuredText: it is `twotower index --help`'s description

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from twotower.cli import CLIError
from twotower.cli.checks import (
    BATCH_HELP,
    encoder_directory,
    index_directory,
    input_file,
    positive,
    reranker_directory,
)
from twotower.cli.help_format import DefaultsHelpFormatter
from twotower.common.errors import flags_need
from twotower.common.file_lock import LOCK_WAIT_S, check_lock_wait
from twotower.common.paths import working_directory_refusal

if TYPE_CHECKING:
    from twotower.indexing import IndexStore
    from twotower.retrieval.build import OutAppearedError

NOTHING_COMMITTED = "nothing was committed; {index} is as it was"  # what Ctrl-C leaves, unless the commit was made

ON_EMPTY_HELP = ("document with blank text and title (nothing to search): stop with an error (default), or leave it "
                 "out, counted in a warning")
LOCK_WAIT_HELP = ("seconds to wait while another process writes to the index (`twotower serve`, another `index add` "
                  f"or `delete`) before giving up, as the server waits for them (default {LOCK_WAIT_S:g})")
T = TypeVar("T")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("index", help="build, update and inspect a search index",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="index_command", metavar="ACTION")

    b = sub.add_parser("build", help="encode a corpus.jsonl into a new index directory",
                       formatter_class=DefaultsHelpFormatter)
    b.add_argument("--corpus", required=True, help="BEIR corpus.jsonl(.gz): one {_id, title, text} per line")
    b.add_argument("--out", required=True, help="index directory to create (must not exist or be empty)")
    b.add_argument("--model", help='dual encoder / HF BERT directory, or "default": all-MiniLM-L6-v2 (the default)')
    b.add_argument("--factory", help="FAISS index-factory string, e.g. Flat, HNSW32, IVF1024,PQ48 (default: auto); "
                                     "with --backend milvus the Milvus index type FLAT (default), IVF_FLAT or HNSW")
    b.add_argument("--metric", choices=["cosine", "ip", "l2"], help="default: cosine for normalised models, else ip")
    b.add_argument("--bm25", action="store_true", help="also build a BM25 index (needed for --hybrid and --bm25 search)")
    b.add_argument("--reranker", help='cross-encoder directory, or "default" (the reranker twotower ships), '
                                      "recorded as the index's default reranker")
    b.add_argument("--on-duplicate", choices=["error", "skip", "replace"], default="error",
                   help="repeated _id: stop with an error (default), keep the first, or keep the last")
    b.add_argument("--on-empty", choices=["error", "skip"], default="error", help=ON_EMPTY_HELP)
    b.add_argument("--batch-size", type=int, help=BATCH_HELP)
    b.add_argument("--shard-size", type=int, default=8192,
                   help="documents per embedding shard, the unit of resume and of torchrun splitting")
    b.add_argument("--keep-shards", action="store_true", help="keep OUT.build/ (the .npy shards) after success")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.add_argument("--passages", action="store_true",
                   help="split documents longer than --passage-window tokens into overlapping passages; searches "
                        "rank documents by their best passage (without it, text past the model's maximum is cut)")
    b.add_argument("--passage-window", type=int, metavar="TOKENS",
                   help="with --passages: tokens per passage (default 128; at most the model's maximum less 2)")
    b.add_argument("--passage-stride", type=int, metavar="TOKENS",
                   help="with --passages: tokens from one passage's start to the next's (default 3/4 of the window)")
    b.add_argument("--backend", choices=["faiss", "milvus"], default="faiss",
                   help="where the vectors live: FAISS files in OUT (default) or a Milvus collection")
    b.add_argument("--milvus-uri", metavar="URI",
                   help="with --backend milvus: a Milvus Lite file (./vectors.db) or a server (http://host:19530)")
    b.add_argument("--collection", metavar="NAME",
                   help="with --backend milvus: the collection to create (default: twotower_<OUT name>)")
    b.set_defaults(func=run_build, torchrun=True, interrupted="the finished shards are kept in {out}.build/; run the same "
                                                "command again to resume")

    a = sub.add_parser("add", help="encode and add documents to an index", formatter_class=DefaultsHelpFormatter)
    a.add_argument("--index", required=True, help="index directory")
    a.add_argument("--corpus", required=True, help="corpus.jsonl(.gz) with the new documents")
    a.add_argument("--model", help="the index's model directory if it has moved (default: from the manifest)")
    a.add_argument("--on-duplicate", choices=["error", "skip", "replace"], default="error",
                   help="id already in the index or repeated: error (default), skip, or replace")
    a.add_argument("--on-empty", choices=["error", "skip"], default="error", help=ON_EMPTY_HELP)
    a.add_argument("--batch-size", type=int, help=BATCH_HELP)
    a.add_argument("--no-progress", action="store_true", help="no progress bars")
    a.add_argument("--lock-wait", type=float, default=LOCK_WAIT_S, metavar="SECONDS", help=LOCK_WAIT_HELP)
    a.set_defaults(func=run_add, interrupted=NOTHING_COMMITTED)

    d = sub.add_parser("delete", help="delete documents by id (unknown ids are reported, exit status 1)",
                       formatter_class=DefaultsHelpFormatter)
    d.add_argument("--index", required=True, help="index directory")
    d.add_argument("ids", nargs="*", metavar="ID", help="document ids")
    d.add_argument("--ids-file", help="file with one id per line")
    d.add_argument("--lock-wait", type=float, default=LOCK_WAIT_S, metavar="SECONDS", help=LOCK_WAIT_HELP)
    d.set_defaults(func=run_delete, interrupted=NOTHING_COMMITTED)

    i = sub.add_parser("info", help="describe an index: size, model, FAISS type, versions",
                       formatter_class=DefaultsHelpFormatter)
    i.add_argument("--index", required=True, help="index directory")
    i.add_argument("--json", action="store_true", help="print the full description as JSON")
    i.set_defaults(func=run_info)

    c = sub.add_parser("check", help="verify every file of an index against its checksums (exit 2 if damaged, 3 if "
                                     "its Milvus Lite file is in use by another process)",
                       formatter_class=DefaultsHelpFormatter)
    c.add_argument("index", metavar="DIR", help="index directory")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=run_check)


def _new_index_directory(out: str, corpus: str) -> None:
    """``--out`` must be new or an empty directory; say which of the other cases it is, and what to do."""
    from twotower.indexing.store import occupant

    kind = occupant(out)
    if kind is not None:
        raise CLIError(_out_occupied(out, kind, corpus))


def _out_occupied(out: str, kind: str, corpus: str) -> str:
    """The message for an ``--out`` that holds something (`occupant`'s `kind`), in flags.

    Why here, not the library's message: that one speaks Python (``SearchPipeline.load(...).add``), and the
    build checks again under its lock, where `OutOccupiedError` reaches this command.
    """
    why = {
        "file": "a file; give the name of a new directory for the index",
        "index": f"already an index; add the documents to it with `twotower index add --index {out} --corpus "
                 f"{corpus}`, or remove it first",
        "empty index": "an empty index, at generation 0 (nothing was ever committed to it); remove the directory, "
                       "or choose another --out",
        "empty milvus index": "an empty index, at generation 0, whose vectors go to a Milvus collection; choose "
                              "another --out (removing the directory would leave its staged rows in the "
                              "collection, which a new index then refuses)",
        "being written": "an index another writer holds open and is writing its first commit to; leave it to that "
                         "writer and choose another --out",
        "directory": "a directory that is not empty; give a new or empty directory for the index",
    }[kind]
    return f"--out {out}: {why}"


def _out_appeared(exc: OutAppearedError) -> str:
    """The message for an ``--out`` someone created while the build ran, with the two ways on.

    Why spelled out: the build found ``--out`` free, spent its time encoding, and only the final rename
    found the directory; the user needs to hear that their files are intact and the encoding is not lost.
    """
    return (f"--out {exc.out}: appeared while the index was being built; nothing in it was touched, and the "
            f"encoded shards are kept in {exc.work_dir}: remove {exc.out} (or move it away) and rerun the same "
            f"command, which resumes from them; or choose another --out and rename {exc.work_dir} to that name "
            "plus .build before rerunning, to resume there")


@contextlib.contextmanager
def _interrupt_tells_the_commit(args: argparse.Namespace, store: IndexStore) -> Iterator[None]:
    """On Ctrl-C, make the interrupt message (``args.interrupted``) say whether `store` committed the change.

    Why: a Ctrl-C just after the commit point (while the manifest or BM25 cache was being written, or the
    summary printed) said "nothing was committed" of an index that was at the new generation with the change.
    """
    try:
        yield
    except KeyboardInterrupt:
        if store.last_commit is not None:
            args.interrupted = f"the change was committed: {{index}} is at generation {store.last_commit} with it"
        raise


def run_build(args: argparse.Namespace) -> int:
    positive("--batch-size", args.batch_size)
    positive("--shard-size", args.shard_size)
    if args.backend == "faiss":
        # (indexing.milvus imports pymilvus only to connect)
        from twotower.indexing.milvus import milvus_flags_without_milvus

        if problem := milvus_flags_without_milvus(args.milvus_uri, args.collection):
            raise CLIError(problem)
    if args.collection is not None:  # --collection "" meant the default collection
        from twotower.indexing.milvus import check_collection_name

        try:
            check_collection_name(args.collection)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    if args.backend == "milvus" and not args.milvus_uri:
        raise CLIError("--backend milvus needs --milvus-uri (a Milvus Lite file such as ./vectors.db, or "
                       "http://host:19530)")
    if not args.passages and (problem := flags_need({"--passage-window": args.passage_window,
                                                     "--passage-stride": args.passage_stride}, "--passages")):
        raise CLIError(problem)
    input_file("--corpus", args.corpus, inside="corpus.jsonl")
    if problem := working_directory_refusal(args.out, f"--out {args.out}", "the index", "--out my-index"):
        raise CLIError(problem)
    _new_index_directory(args.out, args.corpus)
    if args.model:
        args.model = encoder_directory("--model", args.model, dual=True)
    if args.reranker:
        reranker_directory("--reranker", args.reranker)
    from twotower.indexing import IndexLockedError
    from twotower.indexing.vector_index import FactoryError
    from twotower.retrieval.build import DiskFullError, OutAppearedError, OutOccupiedError
    from twotower.retrieval.pipeline import SearchPipeline

    try:
        pipe = SearchPipeline.build(
            args.corpus, args.out, args.model, reranker=args.reranker, factory=args.factory, metric=args.metric,
            bm25=args.bm25, on_duplicate=args.on_duplicate, on_empty=args.on_empty, batch_size=args.batch_size,
            shard_size=args.shard_size, progress=not args.no_progress, keep_shards=args.keep_shards,
            backend=args.backend, milvus_uri=args.milvus_uri, collection=args.collection,
            passages=args.passages, passage_window=args.passage_window, passage_stride=args.passage_stride,
        )
    except OutAppearedError as exc:
        raise CLIError(_out_appeared(exc)) from None
    except OutOccupiedError as exc:  # appeared before the build's lock was taken
        raise CLIError(_out_occupied(exc.out, exc.kind, args.corpus)) from None
    except (FileExistsError, IndexLockedError, DiskFullError) as exc:  # another build, no room: one line, exit 2
        raise CLIError(str(exc)) from None
    except FactoryError as exc:  # found before the encoding
        raise CLIError(f"--factory: {exc}") from None
    except ValueError as exc:  # a --passage-window the model cannot read whole
        if "--passage-" in str(exc):
            raise CLIError(str(exc)) from None
        raise
    if pipe is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    with pipe:
        info = pipe.info()
        n, rows = info["documents"], info["passages"]
        split = f" ({rows:,} passage{'s' * (rows != 1)})" if info.get("passage_settings") else ""
        print(f"built {args.out}: {n:,} document{'s' * (n != 1)}{split}, dim {info['dim']}, {info['factory']} "
              f"({info['metric']}){', BM25' if info['bm25'] else ''}")
    return 0


def lock_wait(seconds: float) -> None:
    try:
        check_lock_wait(seconds, "--lock-wait")
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _open_writer(args: argparse.Namespace, open_writer: Callable[[], T]) -> T:
    """`open_writer()`, waiting up to ``--lock-wait`` seconds for another process's write lock on ``--index``.

    Why: `twotower serve` holds the lock for the length of each write, and it waits for ours
    (`twotower.indexing.store.wait_for_lock`); `index add` failed at once, though a retry a second later worked.
    """
    from twotower.indexing import IndexLockedError, IndexNotWritableError
    from twotower.indexing.store import wait_for_lock

    try:
        return wait_for_lock(open_writer, args.lock_wait)
    except IndexNotWritableError as exc:
        raise CLIError(f"--index {exc}") from None
    except IndexLockedError as exc:
        raise CLIError(f"--index {exc} (a `twotower serve` writing to it, or another `twotower index add` or "
                       f"`delete`) for longer than --lock-wait {args.lock_wait:g} s; nothing was written: retry "
                       "once that write is done, or give a longer --lock-wait") from None


def run_add(args: argparse.Namespace) -> int:
    positive("--batch-size", args.batch_size)
    index_directory("--index", args.index)
    input_file("--corpus", args.corpus, inside="corpus.jsonl")
    if args.model:
        args.model = encoder_directory("--model", args.model, dual=True)
    from twotower.retrieval.pipeline import SearchPipeline

    lock_wait(args.lock_wait)
    pipe = _open_writer(args, lambda: SearchPipeline.load(args.index, args.model, readonly=False,
                                                          use_default_reranker=False))
    with _interrupt_tells_the_commit(args, pipe.store), pipe:
        before = len(pipe)
        n = pipe.add(args.corpus, on_duplicate=args.on_duplicate, on_empty=args.on_empty, batch_size=args.batch_size,
                     progress=not args.no_progress)
        new = len(pipe) - before  # `n` counts replaced documents too
        replaced = n - new
        if not replaced:
            done = f"added {new:,} document{'s' * (new != 1)} to"
        elif not new:
            done = f"replaced {replaced:,} document{'s' * (replaced != 1)} in"
        else:
            done = f"added {new:,} document{'s' * (new != 1)} and replaced {replaced:,} in"
        print(f"{done} {args.index} (now {len(pipe):,})")
    return 0


def run_delete(args: argparse.Namespace) -> int:
    index_directory("--index", args.index)
    ids = list(args.ids)
    if args.ids_file:
        input_file("--ids-file", args.ids_file)
        from twotower.common.lines import numbered_lines  # a bad byte is reported with its line

        ids += [line.strip() for _, line in numbered_lines(args.ids_file) if line.strip()]
    if not ids and args.ids_file:  # it said "give document ids", with the file given
        raise CLIError(f"--ids-file {args.ids_file}: empty (no ids, or only blank lines); nothing to delete")
    if not ids:
        raise CLIError("give document ids to delete (arguments or --ids-file)")
    lock_wait(args.lock_wait)
    from twotower.indexing import IndexStore
    from twotower.retrieval.manifest import pipeline_block
    from twotower.retrieval.passages import document_counts, expand_ids

    # Deleting needs no model: the documents and vectors are removed by id (all passages of a split one).
    store = _open_writer(args, lambda: IndexStore.open(args.index))
    with _interrupt_tells_the_commit(args, store):
        with store:
            pipeline_block(store.manifest.extra, os.path.join(args.index, "manifest.json"))
            rows, missing = expand_ids(store.docstore, ids)
            if rows:
                store.delete(rows)
            store.commit()
            left = document_counts(store.docstore)[0]
        deleted = len(set(ids)) - len(missing)
        print(f"deleted {deleted:,} document{'s' * (deleted != 1)} from {args.index} (now {left:,})")
    if missing:  # an id with a control character (a passage row's \x1f) shown escaped: it is invisible raw
        shown = ", ".join(i if i.isprintable() else ascii(i) for i in missing[:20]) + (" ..." if len(missing) > 20
                                                                                      else "")
        print(f"twotower index delete: {len(missing)} id(s) not in the index: {shown}", file=sys.stderr)
        return 1
    return 0


def run_info(args: argparse.Namespace) -> int:
    index_directory("--index", args.index)
    from twotower.indexing import IndexStore
    from twotower.retrieval.manifest import pipeline_block
    from twotower.retrieval.passages import document_counts

    with IndexStore.open(args.index, readonly=True) as store:
        info = store.info()
        block = pipeline_block(store.manifest.extra, os.path.join(args.index, "manifest.json"))
        info["documents"], info["passages"] = document_counts(store.docstore)
        info["passage_settings"] = block.get("passages")
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    enc = block["encoder"]
    model = enc.get("model") or {}
    rows = [
        ("directory", info["directory"]),
        ("documents", info["documents"]),
        ("passages", f"{info['passages']} (window {info['passage_settings']['window']}, stride "
                     f"{info['passage_settings']['stride']} tokens)" if info["passage_settings"] else "off"),
        ("vectors", f"{info['vectors']} (+{info['tombstones']} tombstones)" if info["tombstones"] else info["vectors"]),
        ("index", f"{info['factory']}, {info['metric']}, dim {info['dim']}"),
        ("backend", "faiss (vector files in the directory)" if info.get("backend", "faiss") == "faiss" else
                    f"milvus, collection {info['milvus']['collection']} at {info['milvus']['uri']}"),
        ("bm25", "no" if not info["bm25"] else "yes" if info["bm25_cache"] else
                 "yes (its cache is missing: rebuilt from the documents at each process's first BM25 search)"),
        ("model", model.get("package") or model.get("path") or "(given at build time, not recorded)"),
        ("encoder", f"fingerprint {enc['fingerprint']}, pooling {enc.get('pooling')}, "
                    f"normalize {enc.get('normalize')}"),
        ("reranker", block.get("reranker") or "none"),
        ("built with", ", ".join(f"{k} {v}" for k, v in (block.get("versions") or {}).items())),
        ("generation", info["generation"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


CHECK_BUSY = 3  # `index check`: the vectors could not be checked now (contention, not damage; docs/cli.md)


def run_check(args: argparse.Namespace) -> int:
    """Exit 0 when every committed file matches its record, 2 (one line per problem, naming the file) if not,
    3 when the vectors could not be checked because another process holds the Milvus Lite file."""
    from twotower.indexing import check_index

    report = check_index(args.index)
    busy = [f"busy: {report.busy}; not checked, not damaged: run it again when that process has stopped"] \
        if report.busy else []
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    for line in report.problems + busy:
        print(f"twotower index check: {line}", file=sys.stderr)
    if not args.json:
        for line in report.notes:
            print(f"twotower index check: note: {line}", file=sys.stderr)
        if report.ok and not busy:
            passages = f" ({report.passages} passages)" if report.passages else ""
            print(f"{args.index}: ok (generation {report.generation}, {report.documents} documents{passages}, "
                  f"{report.segments} vector segment(s), {report.bytes_checked:,} bytes checked)")
    return 2 if not report.ok else CHECK_BUSY if busy else 0
