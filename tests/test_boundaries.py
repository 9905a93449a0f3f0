"""The package arrows of docs/architecture.md ("Packages and their import arrows"), checked on the source: imports point one way only."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD_TOP_LEVEL = {"encoder", "indexing", "retrieval", "eval", "common"}

# folder (relative to the repository) -> the units of ours its modules may import.
# A unit is what follows `twotower.`: the most specific of the names below that prefixes the import.
ALLOWED = {
    "common": {"common"},
    "encoder": {"common", "encoder"},
    "indexing": {"common", "indexing"},
    "eval/metrics": {"eval.metrics"},
    "eval/io": {"common", "eval.io", "eval.metrics"},  # run readers rank with the metrics' tie order
    "eval": {"common", "eval", "eval.io", "eval.metrics", "encoder"},
    "retrieval": {"common", "encoder", "indexing", "eval.io", "eval.metrics", "retrieval"},
    "retrieval/training": {"common", "encoder", "indexing", "eval", "eval.io", "eval.metrics", "retrieval",
                           "retrieval.training"},
}
UNITS = ("eval.metrics", "eval.io", "retrieval.training", "common", "encoder", "indexing", "eval", "retrieval",
         "cli", "serve")


def unit_of(module: str) -> str | None:
    """'twotower.retrieval.training.mining' -> 'retrieval.training'; the app package itself -> 'twotower'."""
    if module == "twotower":
        return "twotower"
    if not module.startswith("twotower."):
        return None
    rest = module[len("twotower."):]
    for unit in UNITS:
        if rest == unit or rest.startswith(unit + "."):
            return unit
    return "twotower"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from twotower.eval import io`
    return found


def _owner(path: pathlib.Path) -> str:
    """The most specific folder of ALLOWED that holds `path`."""
    rel = path.relative_to(ROOT).as_posix()
    return max((f for f in ALLOWED if rel.startswith(f + "/")), key=len)


def test_unit_of() -> None:
    assert unit_of("twotower.retrieval.training.mining") == "retrieval.training"
    assert unit_of("twotower.retrieval.pipeline") == "retrieval"
    assert unit_of("twotower.eval.io.beir") == "eval.io"
    assert unit_of("twotower.cli") == "cli"
    assert unit_of("twotower") == "twotower"
    assert unit_of("torch.nn") is None


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_one_way(folder: str) -> None:
    files = [f for f in sorted((ROOT / folder).rglob("*.py")) if _owner(f) == folder]
    assert files, f"no sources under {folder}"
    bad = {}
    for f in files:
        units = {unit_of(m) for m in _imports(f)} - {None}
        # `from twotower.eval import io` names a module: its unit is the longer one, so drop the parent's
        extra = {u for u in units - ALLOWED[folder] if not any(a.startswith(u + ".") for a in ALLOWED[folder])}
        if extra:
            bad[str(f.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"{folder} must not import {bad}"


def test_no_module_imports_the_old_top_level_names() -> None:
    """Everything imports through the one `twotower` namespace; `import encoder` would break outside the repo."""
    bad = []
    for folder in ("common", "encoder", "indexing", "retrieval", "eval", "twotower", "tests", "benchmarks", "scripts"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            for m in _imports(f):
                if m.split(".")[0] in OLD_TOP_LEVEL:
                    bad.append(f"{f.relative_to(ROOT)}: {m}")
    assert not bad, bad


def test_the_library_never_imports_the_app() -> None:
    for folder in ("common", "encoder", "indexing", "retrieval", "eval"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            units = {unit_of(m) for m in _imports(f)}
            assert not units & {"cli", "serve", "twotower"}, f"{f.relative_to(ROOT)} imports the application layer"


def test_benchmarks_import_the_library_not_the_cli() -> None:
    for f in sorted((ROOT / "benchmarks").rglob("*.py")):
        units = {unit_of(m) for m in _imports(f)}
        assert "cli" not in units, f"{f.relative_to(ROOT)} imports twotower.cli"
