"""The package arrows of DESIGN.md, checked on the source: imports point one way only."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = {"encoder", "indexing", "retrieval", "eval"}

# package (or sub-package) -> our packages it may import
ALLOWED = {
    "encoder": {"encoder"},
    "indexing": {"indexing"},
    "eval/metrics": {"eval"},
}


def _imported_packages(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & OURS


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}"
    bad = {}
    for f in files:
        extra = _imported_packages(f) - ALLOWED[package]
        if extra:
            bad[str(f.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"{package} must not import {bad}"


def test_eval_metrics_import_no_other_module_of_eval() -> None:
    """twotower.eval.metrics is pure numpy: within eval it may only import eval.metrics itself."""
    for f in sorted((ROOT / "eval" / "metrics").rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("eval") and not node.module.startswith("twotower.eval.metrics"):
                    pytest.fail(f"{f.relative_to(ROOT)} imports {node.module}")
