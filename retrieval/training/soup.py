"""A model soup of rerankers: the weights of several fine-tuning runs averaged into one reranker.

Why: on SciFact the same reranker recipe run with three seeds moved test nDCG@10 by up to 0.028, and its
gain over the hybrid on claims with unseen evidence from -0.026 to +0.013 (docs/results.md): one run's
draws decide as much as most recipe changes. Runs fine-tuned from the same pretrained weights stay in one
basin of the loss, so the uniform average of their weights is itself a model, often as good as their
ensemble and better than the typical run (Wortsman et al. 2022, "Model soups"), at the query-time cost of
one. The soup is scored on the dev split the runs share and gets its own interpolation weights, as a
trained checkpoint does, so `SearchPipeline` uses it like any reranker.

The runs must agree on what makes their dev split, their architecture and how they read documents: the
data, the dev split (train them with the same ``--dev-seed``), the starting model, the first stage dev
reranks, the windows. They differ in their seeds (the draws of training) or in training settings.

Example:
    >>> result = soup_rerankers(["runs/rr-s0", "runs/rr-s1", "runs/rr-s2"], "runs/rr-soup")  # doctest: +SKIP
    >>> result.dev_ndcg10, result.interpolated_ndcg10, result.alpha  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from twotower.common.paths import (
    a_few,
    beside_earlier_refusal,
    foreign_entries,
    not_ours_refusal,
    working_directory_refusal,
)
from twotower.encoder.training.run_log import RunLog
from twotower.indexing.integrity import file_sha256
from twotower.retrieval.export import TRAINING_ARGS, write_model_dir, write_training_args
from twotower.retrieval.interpolation import ALPHA_FILE, read_first_stage_alphas

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
# Settings the runs must share: they make the dev split the soup is scored on, the start, and how documents
# are read (the windows as they were resolved are in config.json, compared whole). Everything else (seed,
# steps, learning rate, losses, negatives) may differ.
SHARED = ("pairs", "corpus", "split", "dev_fraction", "dev_size", "dev_by", "model", "first_stage", "teacher",
          "dev_rerank_k", "max_length", "head_pooling")


@dataclass
class SoupResult:
    directory: str
    dev_ndcg10: float  # the soup alone over the first stage's top-k
    interpolated_ndcg10: float  # at `alpha`
    alpha: float
    first_stage_ndcg10: float
    alphas_by_first_stage: dict[str, float] = field(default_factory=dict)
    ingredients: list[dict] = field(default_factory=list)  # per run: checkpoint, seed, step, its dev scores


def checkpoint_of(run: str) -> str:
    """A reranker run directory's best checkpoint (``run/best``), or `run` itself when it is a checkpoint."""
    for path in (run, os.path.join(run, "best")):
        if os.path.isfile(os.path.join(path, TRAINING_ARGS)) and os.path.isfile(os.path.join(path, WEIGHTS)):
            if _read_json(os.path.join(path, TRAINING_ARGS)).get("dev_ndcg@10") is None and \
                    not os.path.isfile(os.path.join(path, ALPHA_FILE)):
                # `--save-last`'s last/: what trained it is recorded (training_args.json), but it was never
                # scored on dev, so the soup would have nothing to report beside its own scores
                raise ValueError(f"{run}: the final weights of a run (--save-last's last/), never scored on dev; a "
                                 "soup averages checkpoints chosen on dev: give the run's directory (its best/)")
            return path
    raise ValueError(f"{run}: not a reranker run (no best/{TRAINING_ARGS}) nor a checkpoint trained by twotower "
                     f"(no {TRAINING_ARGS} and {WEIGHTS}); give the --out directory of `twotower train reranker`")


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def dev_split_seed(args: dict) -> int:
    """The seed a run carved its dev split with (`TrainSettings.dev_split_seed`; runs before ``dev_seed``: seed)."""
    return args["dev_seed"] if args.get("dev_seed") is not None else args["seed"]


def check_compatible(checkpoints: Sequence[str]) -> list[dict]:
    """Each checkpoint's training args, after checking the runs share `SHARED`, the dev split and the config."""
    if len(checkpoints) < 2:
        raise ValueError(f"a soup needs at least two runs, got {len(checkpoints)}")
    # the same weights twice (one run named twice, a copy, a rerun of the same seed) count twice in the mean:
    # allowed (a soup of a run with itself is that run, scored again), but said, since it is rarely meant
    seen: dict[str, str] = {}
    for c in checkpoints:
        weights = file_sha256(os.path.join(c, WEIGHTS))
        if weights in seen:
            same = "is given twice" if os.path.realpath(c) == os.path.realpath(seen[weights]) else \
                f"holds the same weights as {seen[weights]}"
            logger.warning("%s %s: its weights count twice in the soup (runs of other --seed values differ)",
                           c, same)
        seen[weights] = c
    args = [_read_json(os.path.join(c, TRAINING_ARGS)) for c in checkpoints]
    configs = [_read_json(os.path.join(c, "config.json")) for c in checkpoints]
    first = checkpoints[0]
    for c, a, conf in zip(checkpoints[1:], args[1:], configs[1:]):
        for key in SHARED:
            if a.get(key) != args[0].get(key):
                raise ValueError(f"{first} and {c} differ in {key} ({args[0].get(key)!r} vs {a.get(key)!r}); "
                                 f"a soup averages runs of the same data, start and reading")
        if dev_split_seed(a) != dev_split_seed(args[0]):
            raise ValueError(f"{first} and {c} carved different dev splits (dev seed {dev_split_seed(args[0])} vs "
                             f"{dev_split_seed(a)}): train them with the same --dev-seed, so the soup is scored "
                             "on queries none of them trained on")
        if conf != configs[0]:
            diff = sorted(k for k in set(conf) | set(configs[0]) if conf.get(k) != configs[0].get(k))
            raise ValueError(f"{first} and {c} have different config.json ({', '.join(diff)})")
    return args


def average_weights(paths: Sequence[str]) -> dict[str, torch.Tensor]:
    """The uniform average of safetensors files with the same tensors (names, shapes, dtypes).

    A tensor equal in every file (a frozen embedding matrix) is kept as it is, bit for bit, so a soup of runs
    that froze part of the base still matches the base there (`twotower.retrieval.default_reranker` packs
    only what differs). Others are averaged in float32 and cast back.
    """
    from twotower.encoder.core.checkpoint import load_safetensors

    states = [load_safetensors(p, remedy="train that run again, or leave it out of the soup") for p in paths]
    names = set(states[0])
    out: dict[str, torch.Tensor] = {}
    for p, state in zip(paths[1:], states[1:]):
        if set(state) != names:
            extra, missing = sorted(set(state) - names), sorted(names - set(state))
            raise ValueError(f"{p} and {paths[0]} hold different tensors (only in {p}: {extra[:3]}; "
                             f"missing: {missing[:3]})")
    for name in sorted(names):
        tensors = [s[name] for s in states]
        for p, t in zip(paths[1:], tensors[1:]):
            if t.shape != tensors[0].shape or t.dtype != tensors[0].dtype:
                raise ValueError(f"{p}: tensor {name} is {tuple(t.shape)} {t.dtype}, "
                                 f"{paths[0]} has {tuple(tensors[0].shape)} {tensors[0].dtype}")
        if all(torch.equal(tensors[0], t) for t in tensors[1:]):
            out[name] = tensors[0]
        elif not tensors[0].is_floating_point():
            raise ValueError(f"{name} is {tensors[0].dtype} and differs between runs; only floating tensors average")
        else:
            out[name] = torch.stack([t.float() for t in tensors]).mean(dim=0).to(tensors[0].dtype)  # (*shape)
    return out


def _interpolated(checkpoint: str, step: int | None) -> float | None:
    """The checkpoint's best interpolated dev nDCG@10: from its weight curve, else its run's log at `step`
    (checkpoints trained before the curve was kept beside the hybrid's), else None."""
    path = os.path.join(checkpoint, ALPHA_FILE)
    curve = _read_json(path).get("dev_ndcg@10_by_alpha", {}) if os.path.isfile(path) else {}
    if curve:
        return max(curve.values())
    log = RunLog(os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "train_log.jsonl"), enabled=False)
    return next((r.get("interpolated_ndcg10") for r in log.read() if r.get("event") == "eval" and r.get("step") == step),
                None)


def _ingredient(checkpoint: str, args: dict) -> dict:
    return {"checkpoint": os.path.abspath(checkpoint), "seed": args.get("seed"), "step": args.get("step"),
            "dev_ndcg@10": args.get("dev_ndcg@10"),
            "interpolated_dev_ndcg@10": _interpolated(checkpoint, args.get("step"))}


def _soup_names(checkpoint: str) -> set[str]:
    """What a soup directory holds: its first checkpoint's files (config, tokenizer), the weights, args and weight
    chosen, and any tokenizer file (an earlier soup of runs that wrote other tokenizer files is still a soup)."""
    from twotower.encoder.core.tokenizer import TOKENIZER_FILES

    return {*os.listdir(checkpoint), *TOKENIZER_FILES, "config.json", WEIGHTS, TRAINING_ARGS, ALPHA_FILE}


def _check_out(out: str, runs: Sequence[str], checkpoints: Sequence[str], overwrite: bool) -> None:
    """`out` must be new, empty, or an earlier soup (with `overwrite`), and hold none of the runs averaged.

    Why: the soup replaced whatever directory `out` was: the user's files, an input run's log and negatives
    (``--out rr0``), an input run's best checkpoint (``--out rrA/best``), all with exit 0; and an earlier soup
    beside the user's own files (a README, an eval folder) was replaced with them. The working directory is
    refused: replacing it would leave the shell in a removed directory.
    """

    if problem := working_directory_refusal(out, f"--out {out}", "the soup", "--out soup"):
        raise ValueError(problem)
    real = os.path.realpath(out)
    for run, checkpoint in zip(runs, checkpoints):
        for path in {os.path.realpath(run), os.path.realpath(checkpoint)}:
            if path == real or path.startswith(real + os.sep):
                raise ValueError(f"--out {out}: it holds {run}, a run this soup averages; give another --out")
    if not os.path.isdir(out) or not os.listdir(out):
        return
    args_path = os.path.join(out, TRAINING_ARGS)
    earlier = os.path.isfile(args_path) and "soup_of" in _read_json(args_path)
    if not earlier:
        raise ValueError(not_ours_refusal(f"--out {out}", sorted(os.listdir(out)), "a soup"))
    theirs = foreign_entries(out, _soup_names(checkpoints[0]))
    if theirs:
        raise ValueError(beside_earlier_refusal(f"--out {out}", "an earlier soup", theirs))
    if not overwrite:
        raise ValueError(f"--out {out} holds an earlier soup; pass --overwrite to replace it, or give another --out")


def soup_rerankers(runs: Sequence[str], out: str, progress: bool = True, overwrite: bool = False) -> SoupResult:
    """Average the best checkpoints of `runs` into the reranker directory `out`, scored on their shared dev split.

    The directory is written whole and swapped in (`write_model_dir`); a failure leaves `out` as it was.
    """
    from safetensors.torch import save_file

    from twotower.common.device import default_device
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.training.alpha import choose_alpha
    from twotower.retrieval.training.dev_eval import dev_metrics, rerank_run
    from twotower.retrieval.training.train_reranker import (
        RerankerTrainConfig,
        Teacher,
        first_stage_run,
        hybrid_alpha,
        load_reranker_data,
        reranker_documents,
        write_dev_alpha,
    )
    from twotower.retrieval.training.training_data import carve_dev, qrels_of, queries_of
    from twotower.retrieval.training.training_run import TrainingRun

    checkpoints = [checkpoint_of(r) for r in runs]
    args = check_compatible(checkpoints)
    if os.path.isfile(out):
        raise ValueError(f"--out {out} is a file; give a directory")
    _check_out(out, runs, checkpoints, overwrite)
    known = {f.name for f in fields(RerankerTrainConfig)}
    settings = {k: v for k, v in args[0].items() if k in known}
    settings["mine_ranks"] = tuple(settings.get("mine_ranks") or (1, 100))
    # a run that was resumed says so in its args; the soup's own run (its log and summary) is never a resume
    cfg = RerankerTrainConfig(**{**settings, "out": out, "progress": progress, "resume": False})

    found: dict = {}

    def fill(tmp: str) -> None:
        for name in os.listdir(checkpoints[0]):  # config and tokenizer; weights, args and weights chosen anew
            src = os.path.join(checkpoints[0], name)
            if name not in (WEIGHTS, TRAINING_ARGS, ALPHA_FILE) and os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, name))
        save_file(average_weights([os.path.join(c, WEIGHTS) for c in checkpoints]), os.path.join(tmp, WEIGHTS),
                  metadata={"format": "pt"})

        device = torch.device(cfg.device) if cfg.device else default_device()
        model = CrossEncoder.from_pretrained(tmp, device=device, max_length=cfg.max_length, bf16=cfg.bf16)
        data, _ = load_reranker_data(cfg)
        _, dev = carve_dev(data, cfg)
        corpus = data.corpus
        dense = Teacher(cfg, corpus, device).dense if cfg.first_stage == "dense" else None
        first = first_stage_run(cfg, dev, corpus, cfg.dev_rerank_k, dense=dense)
        docs = reranker_documents(cfg, corpus, model)
        qrels = qrels_of(dev)
        reranked, _ = rerank_run(model, queries_of(dev), first, docs, k=cfg.dev_rerank_k,
                                 batch_size=cfg.eval_batch_size, progress=progress)
        alone = dev_metrics(reranked, qrels)["ndcg@10"]
        alpha, curve = choose_alpha(reranked, first, qrels)
        write_dev_alpha(tmp, cfg, alpha, curve, len(dev))
        if dense is not None:  # the hybrid's weight too, as the trainer stores it
            hybrid_alpha(cfg, tmp, device, dev, corpus, dense, TrainingRun(tmp, enabled=False), known=reranked,
                         docs=docs)
        by_first = read_first_stage_alphas(tmp)  # as stored: {"bm25": ..}, or {"dense": .., "hybrid": ..}
        ingredients = [_ingredient(c, a) for c, a in zip(checkpoints, args)]
        # world_size: the runs' own (--batch-size is per rank), when they agree; none when they differ
        sizes = {a.get("world_size") for a in args}
        write_training_args(tmp, {**args[0], **({} if len(sizes) == 1 else {"world_size": None}), "out": out,
                                  "soup_of": [i["checkpoint"] for i in ingredients], "ingredients": ingredients,
                                  "step": None, "dev_ndcg@10": alone})
        found.update(alone=alone, interpolated=curve[alpha], alpha=alpha, first=curve[0.0], by_first=by_first,
                     ingredients=ingredients)

    def checked_fill(tmp: str) -> None:
        fill(tmp)
        # again just before the swap: a file the user saved into --out while the soup was scored goes with it
        if os.path.isdir(out) and (theirs := foreign_entries(out, _soup_names(checkpoints[0]))):
            raise ValueError(f"--out {out}: files of yours appeared while the soup was made ({a_few(theirs)}); "
                             "nothing was replaced: move them out and run the command again, or give another --out")

    write_model_dir(out, checked_fill)
    return SoupResult(out, found["alone"], found["interpolated"], found["alpha"], found["first"],
                      found["by_first"], found["ingredients"])
