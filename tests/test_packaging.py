"""The wheel is one ``twotower`` package: every library folder inside it under its ``twotower.`` name, the
data files with it, the ``twotower`` command pointing at ``twotower.cli:main``, and nothing else at the top
level (``import encoder`` or ``import eval`` from an installed wheel must fail, not find a stray folder).

The wheel is built from a copy of the build inputs (pyproject.toml, README.md and the package folders), so a
stale ``build/`` from an earlier in-tree build cannot leak deleted modules into it and the test writes nothing
into the repository.  It is installed with ``pip install --target`` and imported in a separate interpreter
whose ``sys.path`` holds that directory first and never the repository (``PYTHONSAFEPATH``, another cwd);
the dependencies (torch, faiss, ...) come from this environment's site-packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# repository folder -> import name, as [tool.setuptools.package-dir] maps them
FOLDERS = {"twotower": "twotower", "common": "twotower/common", "encoder": "twotower/encoder",
           "indexing": "twotower/indexing", "retrieval": "twotower/retrieval", "eval": "twotower/eval"}
TOP_LEVEL_NAMES = ("encoder", "retrieval", "indexing", "eval", "common")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(root / "dist"), "."], cwd=src, check=True, capture_output=True, text=True)
    (built,) = (root / "dist").glob("twotower-*.whl")
    return built


def _dist_info(names: list[str], file: str) -> str:
    (path,) = [n for n in names if n.endswith(f".dist-info/{file}")]
    return path


def test_wheel_has_one_top_level_package_with_every_module_and_data_file(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = zf.read(_dist_info(names, "top_level.txt")).decode().split()
        entry_points = zf.read(_dist_info(names, "entry_points.txt")).decode()
    assert top_level == ["twotower"]
    assert {n.split("/")[0] for n in names} == {"twotower", _dist_info(names, "RECORD").split("/")[0]}
    expected = {f"{FOLDERS[folder]}/{p.relative_to(REPO / folder).as_posix()}"
                for folder in FOLDERS for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts}
    assert expected - set(names) == set(), "modules missing from the wheel (a package not listed in pyproject?)"
    assert {n for n in names if n.endswith(".py")} == expected
    data = {f"twotower/retrieval/data/{name}" for name in _data_files()}
    assert data and data <= set(names)
    assert "[console_scripts]\ntwotower = twotower.cli:main" in entry_points


def _data_files() -> list[str]:
    """The package data of twotower.retrieval, as paths relative to retrieval/data/ (subfolders too)."""
    root = REPO / "retrieval" / "data"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_installed_wheel_imports_as_twotower_only(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    probe = (
        "import importlib, json, os, sys\n"
        "import twotower\n"
        "pipeline = twotower.SearchPipeline\n"
        "from twotower.cli import main\n"
        "missing = []\n"
        f"for name in {TOP_LEVEL_NAMES!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        missing.append(name)\n"
        "data = os.path.join(os.path.dirname(sys.modules['twotower.retrieval'].__file__), 'data')\n"
        "files = sorted(os.path.relpath(os.path.join(d, f), data) for d, _, fs in os.walk(data) for f in fs)\n"
        "print(json.dumps({'twotower': twotower.__file__, 'pipeline': sys.modules[pipeline.__module__].__file__,\n"
        "                  'cli': sys.modules[main.__module__].__file__, 'missing': missing,\n"
        "                  'data': files, 'version': twotower.__version__}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True,
                         text=True)
    got = json.loads(out.stdout)
    for key in ("twotower", "pipeline", "cli"):  # served by the wheel, not by the editable install's finder
        assert Path(got[key]).is_relative_to(site), (key, got[key])
    assert got["missing"] == list(TOP_LEVEL_NAMES)
    assert got["data"] == _data_files()  # the shipped reranker's files included
    version = subprocess.run([sys.executable, "-m", "twotower", "--version"], cwd=tmp_path, env=env, check=True,
                             capture_output=True, text=True)
    assert version.stdout.strip() == f"twotower {got['version']}"
