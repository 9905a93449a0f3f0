"""Checks of command-line arguments shared by several commands, each failing in the user's words.

The library's own errors name its Python API (``IndexStore.create(..., bm25=True)``,
``config file not found: DIR/config.json``); a person at the command line needs the
flag they typed and the command that fixes it, so these run before anything loads.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Container, Sequence

from twotower.cli import CLIError

MODEL_CONFIG = "config.json"  # every model directory we load (HF layout) has one


# Every inference command's --batch-size: what None (the flag not given) means.
BATCH_HELP = ("texts per forward pass (default: length-sorted batches of about 2,048 tokens on a CPU, 65,536 on a "
              "GPU; faster than a fixed count)")


def positive(flag: str, value: int | None) -> None:
    """A count flag (``-k``, ``--batch-size``, ``--threads``) must be at least 1; None is a flag not given."""
    if value is not None and value < 1:
        raise CLIError(f"{flag} must be >= 1, got {value}")


def input_file(flag: str, path: str, inside: str | None = None) -> str:
    """``path``, a file the command reads; a missing path or a directory is an error naming `flag`.

    inside: the file a directory given here most likely holds (a BEIR directory's ``corpus.jsonl``),
    named in the error when it is there (`--corpus data/scifact` said "corpus file not found").
    """
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise CLIError(f"{flag} {path}: file not found")
    hint = ""
    for name in (inside, f"{inside}.gz") if inside else ():
        if os.path.isfile(os.path.join(path, name)):
            hint = f"; give the file inside it: {flag} {os.path.join(path, name)}"
            break
    raise CLIError(f"{flag} {path}: a directory, not a file{hint}")


def index_directory(flag: str, path: str) -> str:
    """``path`` if it is an index directory (one holding ``manifest.json``), else a CLIError naming ``flag``.

    Why one check: seven commands read ``--index`` and said it four ways ("index directory not found:
    X", "X: no such index directory", "X/manifest.json: manifest not found"), and a file or a model
    directory given as the index was reported as missing. Each case here says what the path is instead.
    """
    from twotower.indexing.manifest import MANIFEST_NAME

    if not os.path.exists(path):
        unfinished = f"{path.rstrip(os.sep)}.build"  # where an interrupted `index build --out path` left its shards
        hint = (f"; {unfinished} holds an unfinished build: rerun the same `twotower index build` to finish it"
                if os.path.isdir(unfinished) else "")
        raise CLIError(f"{flag} {path}: no such directory{hint}")
    if not os.path.isdir(path):
        hint = f"; to index it: `twotower index build --corpus {path} --out DIR`" if ".jsonl" in path else ""
        raise CLIError(f"{flag} {path}: a file, not an index directory{hint}")
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return path
    if os.path.isfile(os.path.join(path, MODEL_CONFIG)):
        raise CLIError(f"{flag} {path}: a model directory, not an index; build an index with it: "
                       f"`twotower index build --model {path} --corpus CORPUS --out DIR`")
    out = "DIR" if os.listdir(path) else path  # build writes into an empty directory only
    raise CLIError(f"{flag} {path}: not an index directory (no {MANIFEST_NAME}); build one with "
                   f"`twotower index build --corpus CORPUS --out {out}`")


def output_file(flag: str, path: str | None, example: str,
                inputs: Sequence[tuple[str, str | None]] = ()) -> str | None:
    """``path``, a file the command writes (atomically, once its work is done); a directory there is an error
    now, naming `flag`. Why: it was a traceback (IsADirectoryError) after the work, e.g. after `embed` had
    encoded the whole input. example: a file name to suggest inside the directory.

    inputs: the command's ``(flag, path)`` inputs (a file, or a directory whose files it reads): an output that
    is one of them is refused (`train mine --out corpus.jsonl` replaced the corpus it had just read).
    """
    if path is None:
        return path
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path}: a directory; give a file name, such as {flag} {os.path.join(path, example)}")
    parent_is_a_file(flag, path)
    if os.path.exists(path):
        for in_flag, given in inputs:
            if not given or not os.path.exists(given):
                continue
            files = [os.path.join(d, f) for d, _, names in os.walk(given) for f in names] if os.path.isdir(given) \
                else [given]
            if any(os.path.samefile(path, f) for f in files):
                raise CLIError(f"{flag} {path}: that is the input {in_flag} {given} reads; give another file")
    return path


def parent_is_a_file(flag: str, path: str) -> None:
    """A CLIError naming `flag` when a directory on the way to `path` is an ordinary file. Why: the command did its
    work and then failed creating the directory, with a FileExistsError traceback."""
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise CLIError(f"{flag} {path}: {parent} is a file, not a directory")


def model_directory(flag: str, path: str, dual: bool = False) -> str:
    """``path`` if it is a model directory (one holding ``config.json``), else a CLIError naming ``flag``.

    dual: a dual encoder is wanted, so a directory of separate towers (``dual_encoder.json`` naming its
    query and document sub-directories, as ``train dual --separate-towers`` writes) is one too, and a
    reranker is refused. Why: a cross-encoder loads as an encoder without complaint and embeds text into
    vectors its training never shaped, so an index built with it ranks by noise; the shipped reranker's data
    directory said only "no tokenizer". A checkpoint a kill left moved aside mid-save is put back first.
    """
    from twotower.common.atomic import recover_replaced_dir

    recover_replaced_dir(path)
    if not os.path.isdir(path):
        raise CLIError(f"{flag} {path}: no such directory")
    names = [MODEL_CONFIG]
    if dual:
        from twotower.retrieval.dual_encoder import DUAL_CONFIG_NAME

        names.append(DUAL_CONFIG_NAME)
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        best = os.path.join(path, "best")
        if any(os.path.isfile(os.path.join(best, n)) for n in names):  # a training run's --out, not its checkpoint
            raise CLIError(f"{flag} {path}: a training run's directory, not a model; its best checkpoint is {best}")
        raise CLIError(f"{flag} {path}: not a model directory (it has no {' or '.join(names)})")
    if dual:
        from twotower.retrieval.default_reranker import DIRECTORY as SHIPPED_DIR
        from twotower.retrieval.default_reranker import NAME as SHIPPED

        shipped = os.path.realpath(path) == os.path.realpath(SHIPPED_DIR)
        if shipped or is_reranker(path):
            what = f"the reranker twotower ships (--reranker {SHIPPED})" if shipped else "a reranker (cross-encoder)"
            raise CLIError(f"{flag} {path}: {what}, which scores query-document pairs; {flag} takes a model that "
                           f"embeds text: a dual-encoder or encoder directory, or {flag} default")
    return path


def encoder_directory(flag: str, value: str, dual: bool = False) -> str:
    """``--model``: a model directory (checked as `model_directory`), or "default", the embedded all-MiniLM-L6-v2
    as a directory. Why: ``finetune --model default`` meant it, while ``index build``, ``embed``, ``train dual``
    and ``train mine`` answered "--model default: no such directory"."""
    if value != "default":
        return model_directory(flag, value, dual=dual)
    named_default_note(flag, value, "the embedded all-MiniLM-L6-v2")
    from twotower.retrieval.manifest import default_model_dir

    try:
        return default_model_dir()
    except FileNotFoundError as e:
        raise CLIError(f"{flag} default: {e}") from None


def device_option(value: str | None) -> str | None:
    """``--device`` checked before any model loads: a device torch names and this machine has.

    Why: ``--device cuda`` on a CPU build of torch failed at the first tensor moved, as torch's
    ``AssertionError: Torch not compiled with CUDA enabled``, and ``--device gpu`` as a list of 25 device
    types; a user needs to hear which flag is wrong and what to give.
    """
    if value is None or value == "cpu":  # always there; embed and answer default to it, and need no torch import
        return value                      # before their own cheap checks
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device {value}: not a device torch knows; give cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(f"--device {value}: this machine's torch ({torch.__version__}) sees no CUDA GPU; give "
                           "--device cpu, or leave --device out")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {value}: there are {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise CLIError(f"--device {value}: MPS is not available here; give --device cpu")
    return value


def max_length_fits(flag: str, value: int | None, model_dir: str) -> None:
    """A given ``--max-length`` must fit the model's position table (its config.json's max_position_embeddings).

    Why: the encoders and the cross-encoder cap the length at the positions, so `--max-length 1000` trained
    and encoded at 512 without a word. Not given (None), the command's default is capped as before.
    """
    positions = _model_config(model_dir).get("max_position_embeddings")
    if value is None or not isinstance(positions, int):
        return  # no readable config: loading the model says what is wrong with the directory
    if value > positions:
        raise CLIError(f"{flag} {value}: the model in {model_dir} reads at most {positions} tokens")


def _model_config(path: str) -> dict:
    """A model directory's config.json ({} when it is missing, unreadable or not an object)."""
    import json

    try:
        with open(os.path.join(path, MODEL_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def architectures(path: str) -> list[str]:
    """The ``architectures`` a model directory's config.json names ([] when it names none or cannot be read)."""
    names = _model_config(path).get("architectures") or []
    return [str(n) for n in names] if isinstance(names, list) else []


def is_reranker(path: str, names: list[str] | None = None) -> bool:
    """Whether a model directory's config names a sequence-classification head (a cross-encoder).
    names: its `architectures`, when already read."""
    return any(n.endswith("ForSequenceClassification") for n in (architectures(path) if names is None else names))


def reranker_directory(flag: str, value: str, head: bool = True) -> str:
    """``value`` if it is "default" (the shipped reranker) or a model directory, else a CLIError naming ``flag``.

    head: the directory must be a reranker (a relevance head), not a plain or dual encoder; checked from
    its config.json's ``architectures`` when it names any. Why: searching with an encoder as ``--reranker``
    failed deep in loading, in the Python API's words. ``train reranker --model`` takes either (head=False).
    The name wins over a directory called ``default`` in the working directory; the user is told so, and
    how to name the directory instead (``./default``), rather than left to wonder which one ranked.
    """
    from twotower.retrieval.default_reranker import NAME as SHIPPED

    if value != SHIPPED:
        model_directory(flag, value)
        names = architectures(value)
        if head and names and not is_reranker(value, names):
            raise CLIError(f"{flag} {value}: not a reranker: its {MODEL_CONFIG} names {names[0]}, an encoder without "
                           f"a relevance head; give a directory made by `twotower train reranker`, or {flag} "
                           f"{SHIPPED} for the one twotower ships")
        return value
    named_default_note(flag, SHIPPED, "the reranker twotower ships")
    return value


def named_default_note(flag: str, name: str, what: str) -> None:
    """Tell the user that ``flag name`` means `what`, not the directory ``name/`` in the working directory, when
    there is one, and how to name that directory instead: the name wins, rather than leaving them to wonder."""
    if os.path.isdir(name):
        print(f"note: {flag} {name} is {what}, not the directory {name}/ here; give {flag} ./{name} for that one",
              file=sys.stderr)


def refuse_reranker_with_no_rerank(reranker: str | None, no_rerank: bool) -> None:
    """``--reranker DIR --no-rerank`` (search, answer): the reranker would load and never run."""
    if reranker and no_rerank:
        raise CLIError("--reranker names a reranker, but --no-rerank turns reranking off; give one of them")


BM25_HELP = "recall by BM25 alone, without running the query encoder (index built with --bm25)"


def require_bm25(index: str, flag: str = "--hybrid") -> None:
    """Refuse `flag` (``--hybrid``, ``--bm25``) on an index built without BM25, saying how to build one that has it."""
    from twotower.indexing import Manifest
    from twotower.indexing.manifest import MANIFEST_NAME

    if Manifest.read(os.path.join(index, MANIFEST_NAME)).bm25 is None:
        raise CLIError(f"{flag}: the index {index} was built without BM25; rebuild it with "
                       f"`twotower index build --bm25 --corpus CORPUS --out DIR`, or search without {flag}")


def first_stage_flags(hybrid: bool, bm25: bool, index: str, exclusive: bool = True) -> None:
    """``--hybrid`` and ``--bm25``: either only on an index with BM25, and not both where they choose one recall
    (search, answer; `eval` takes both as two systems: ``exclusive=False``)."""
    from twotower.retrieval.interpolation import both_recalls

    if exclusive and hybrid and bm25:
        raise CLIError(both_recalls("--bm25", "--hybrid"))
    if hybrid or bm25:
        require_bm25(index, "--hybrid" if hybrid else "--bm25")


def filter_option(text: str | None, command: str):
    """``--filter`` parsed before anything is loaded; a syntax error names the option and the column.

    command: the subcommand ("search", "answer"), so the caret lines up under the error prefix.
    """
    if text is None:
        return None
    from twotower.indexing.filters import FilterError, parse_filter

    try:
        return parse_filter(text)
    except FilterError as e:
        raise CLIError(str(e.renamed("--filter", indent=len(error_prefix(command))))) from None


def error_prefix(command: str) -> str:
    """How twotower.cli.main prints a CLIError of `command` (``twotower search: error: ``)."""
    return f"twotower {command}: error: "


def searchable_queries(path: str, only: Container[str] | None = None) -> list[tuple[int, str, str]]:
    """``(line, query id, text)`` of a queries file, BEIR ``queries.jsonl`` or ``qid<TAB>text`` (eval's readers),
    every query (or every one whose id is in `only`) checked searchable (`query_problem`).

    Why one function for ``search --queries`` and ``eval --dataset``: a query that cannot be searched is a
    line of a file, so it is named the way the readers name a bad line, ``FILE:LINE: query 'q7' is empty``,
    and by its id; it said ``FILE: query q7 is empty``, which left the user to search the file for the id.

    Raises:
        DataError (a ValueError) naming the file and line.
    """
    from twotower.common.errors import DataError
    from twotower.common.lines import is_json_lines, query_problem
    from twotower.eval.io.beir import iter_beir_queries
    from twotower.eval.io.msmarco import iter_id_text_tsv

    rows = list(iter_beir_queries(path) if is_json_lines(path) else iter_id_text_tsv(path))
    for line, qid, text in rows:
        if (only is None or qid in only) and (problem := query_problem(text, f"query {qid!r}")):
            raise DataError(path, line, problem, field="text")
    return rows


def argument_text_problem(text: str, name: str) -> str | None:
    """Why a query typed on the command line cannot be searched, or None (`query_problem`'s rules, in shell words).

    Python reads a command-line byte that is not UTF-8 as a lone surrogate U+DC80-U+DCFF (surrogateescape):
    `query_problem` called that "an unpaired \\u escape", which nobody typed. Here it is the byte it was.
    """
    from twotower.common.lines import query_problem

    bad = next((ch for ch in text if "\udc80" <= ch <= "\udcff"), None)
    if bad is not None:
        return (f"{name} holds the byte 0x{ord(bad) - 0xDC00:02X}, which is not UTF-8 text "
                "(is the terminal's encoding UTF-8?)")
    return query_problem(text, name)
