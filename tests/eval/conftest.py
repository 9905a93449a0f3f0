"""Fixtures for the eval tests: where the real datasets live (skip when they are not there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# ../shared/data relative to the repository root, unless TWOTOWER_DATA points elsewhere.
DATA_DIR = Path(
    os.environ.get("TWOTOWER_DATA", Path(__file__).resolve().parents[2].parent / "shared" / "data")
)


@pytest.fixture
def data_dir():
    """Factory: ``data_dir("beir-scifact")`` returns the folder or skips the test when it is absent."""

    def get(name: str) -> Path:
        folder = DATA_DIR / name
        if not folder.is_dir():
            pytest.skip(f"dataset folder {folder} not present")
        return folder

    return get
