"""Shared data and reference implementations for the indexing tests."""

from __future__ import annotations

import numpy as np


def clustered(n: int, dim: int, *, clusters: int = 16, seed: int = 0, spread: float = 0.35) -> np.ndarray:
    """Gaussian blobs (n, dim) float32: realistic for ANN (neighbours share a cluster)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim))
    labels = rng.integers(clusters, size=n)
    return (centers[labels] + spread * rng.normal(size=(n, dim))).astype(np.float32)


def brute_force(
    data: np.ndarray, ids: list[str], queries: np.ndarray, k: int, metric: str
) -> tuple[list[list[str]], np.ndarray]:
    """Exact top-k with numpy, scores higher-is-better like VectorIndex."""
    x = data.astype(np.float64)
    q = queries.astype(np.float64)
    if metric == "cosine":
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
    if metric == "l2":
        scores = -((q[:, None, :] - x[None, :, :]) ** 2).sum(-1)  # (Q, N)
    else:
        scores = q @ x.T  # (Q, N)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [[ids[j] for j in row] for row in order], np.take_along_axis(scores, order, 1)


def recall_at_k(found: list[list[str]], truth: list[list[str]]) -> float:
    hits = sum(len(set(f) & set(t)) for f, t in zip(found, truth))
    return hits / sum(len(t) for t in truth)


def run_read_only(directory, script: str, **kwargs):
    """Run the shell `script` where `directory` is mounted read-only (EROFS for every user, root included).

    Why a mount namespace: chmod does not stop root, and tests must not need root; an unprivileged user
    namespace (``unshare -rm``) may bind-mount a directory read-only for its own processes. Skips the test
    where ``unshare`` is missing or user namespaces are disabled.
    """
    import shlex
    import shutil
    import subprocess

    import pytest

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to mount a directory read-only")
    d = shlex.quote(str(directory))
    mount = f"mount --bind {d} {d} && mount -o remount,ro,bind {d} {d} && ! touch {d}/.probe 2>/dev/null"
    if subprocess.run([unshare, "-rm", "sh", "-c", mount], capture_output=True).returncode:
        pytest.skip("cannot mount a directory read-only here (user namespaces disabled?)")
    return subprocess.run([unshare, "-rm", "sh", "-c", f"{mount} && {script}"], capture_output=True, text=True,
                          **kwargs)
