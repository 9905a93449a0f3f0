"""Reranker training on several ranks: 2 ranks with batch b train like one process with batch 2b.

Each rank trains on its slice of a global batch drawn alike on every rank, and the gradients are averaged over
the ranks (`twotower.common.distributed.average_gradients`). Before, every rank ran the whole training alone,
on batches of b, which gave the one-process run with batch b.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch

from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
from twotower.retrieval.training.train_reranker import RerankerTrainConfig, train_reranker


def _no_dropout_model() -> str:
    """The tiny reranker start without dropout, so that ranks and one process draw nothing at random."""
    directory = os.path.join(tempfile.mkdtemp(prefix="twotower-nodrop-"), "tiny")
    shutil.copytree(tiny_model_dir(0.2), directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


def _settings(model: str, out: str, batch_size: int, **kw) -> dict:
    # mined by BM25 (on rank 0 alone), distilled from a dense teacher that also gives the dev first stage (and
    # the hybrid weight), documents read as windows chosen by the model: every part a rank could get wrong
    base = dict(model=model, pairs=tiny_beir_dir(), out=out, group_size=4, batch_size=batch_size, max_length=48,
                lr=2e-3, progress=False, dev_fraction=0.25, dev_rerank_k=10, bf16=False, max_steps=3, eval_every=3,
                eval_at_start=False, save_last=True, teacher=tiny_model_dir(), passage_window=8, device="cpu")
    return {**base, **kw}


def _worker(rank_id: int, world: int, init_file: str, settings: dict) -> None:
    import torch.distributed as dist

    from twotower.common.distributed import DistInfo, cleanup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_id, world_size=world)
    train_reranker(RerankerTrainConfig(**settings))
    cleanup(DistInfo(world, rank_id, rank_id))


def _weights(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def _steps(out: str) -> list[dict]:
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["event"] == "step"]


@pytest.mark.parametrize("loss", ["listwise", "pointwise"])
def test_two_ranks_with_batch_b_train_like_one_process_with_batch_2b(tmp_path, loss):
    import torch.multiprocessing as mp

    model, world, b = _no_dropout_model(), 2, 3
    extra = {} if loss == "listwise" else {"loss": "pointwise", "mine": None, "teacher": None}
    ranks_out, one_out = str(tmp_path / "ranks"), str(tmp_path / "one")
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), _settings(model, ranks_out, b, **extra)), nprocs=world,
             join=True)
    train_reranker(RerankerTrainConfig(**_settings(model, one_out, world * b, **extra)))

    got, ref = _weights(os.path.join(ranks_out, "last")), _weights(os.path.join(one_out, "last"))
    start = {f"bert.{k}": v for k, v in _weights(model).items()}
    moved = max(float((ref[k] - v).abs().max()) for k, v in start.items())
    assert moved > 1e-3  # the steps changed the weights by far more than the tolerance below
    assert got.keys() == ref.keys()
    for name in ref:
        # In exact arithmetic these get no gradient (attention's softmax ignores a key bias; a listwise softmax
        # ignores a shift of all a group's scores), so theirs is rounding noise, which Adam scales up to steps.
        if name.endswith("attention.self.key.bias") or (name == "classifier.bias" and loss == "listwise"):
            continue
        torch.testing.assert_close(got[name], ref[name], atol=2e-5, rtol=1e-4, msg=name)
    # rank 0 logged each step once, with the global batch's loss (the mean of the ranks') and logit spread
    steps, ref_steps = _steps(ranks_out), _steps(one_out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r, q in zip(steps, ref_steps):
        for key in ("loss", "logit_std", "label_loss", "distill_kl", "grad_norm"):
            assert (key in r) == (key in q)
            if key in r:
                assert r[key] == pytest.approx(q[key], rel=1e-4, abs=1e-5), key
    if loss == "listwise":
        assert "distill_kl" in steps[0]
        assert os.path.isfile(os.path.join(ranks_out, "negatives.jsonl"))
