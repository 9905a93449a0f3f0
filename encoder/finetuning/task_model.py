"""A fine-tuned model that predicts: head + tokenizer + TaskInfo, saved as one HF-format directory.

``TaskModel.from_pretrained(dir)`` restores everything needed to predict (head
type, label map, maximum length, QA window and threshold settings) from the
directory alone; ``TaskModel.from_encoder(dir, info)`` puts a fresh head on any
BERT-family encoder (ours, all-MiniLM-L6-v2, an MLM checkpoint) to fine-tune.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from twotower.common.atomic import TMP_MARKER, atomic_replace_dir, atomic_write_text
from twotower.common.device import autocast, resolve_bf16
from twotower.common.malloc import steady_thresholds_for, trim_free_heap_for
from twotower.encoder.core.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_vocab_fits,
    load_into,
    read_weights,
    save_pretrained,
    split_prefix,
)
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.encode import default_batch_tokens, length_batches
from twotower.encoder.core.heads import ARCHITECTURES, build_head
from twotower.encoder.core.tokenizer import Tokenizer
from twotower.encoder.finetuning.tasks import Featurized, Task, TaskInfo, get_task, pad

logger = logging.getLogger(__name__)

TASK_KEY = "twotower_task"
# Keys a base checkpoint may carry from an earlier head; a new head writes its own.
_HEAD_KEYS = ("num_labels", "id2label", "label2id", TASK_KEY, "problem_type", "finetuning_task", "classifier_pooling")


def read_config(directory: str) -> tuple[EncoderConfig, dict[str, Any], list[str]]:
    """(encoder config, twotower_task dict or {}, architectures) of a model directory."""
    path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    task = d.pop(TASK_KEY, None) or {}
    return EncoderConfig.from_dict(d, source=path), task, list(d.get("architectures") or [])


def _labels_from(config: EncoderConfig, source: str) -> list[str]:
    id2label = config.extra.get("id2label") or {}
    try:
        pairs = sorted((int(k), str(v)) for k, v in id2label.items())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: id2label keys must be integers") from exc
    if [k for k, _ in pairs] != list(range(len(pairs))):
        raise ValueError(f"{source}: id2label ids must be 0..n-1, got {[k for k, _ in pairs]}")
    return [v for _, v in pairs]


def batch_order(lengths: np.ndarray, batch_size: int, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Row indices grouped into batches of similar length.

    Without ``rng``: sorted by length (prediction; minimal padding).  With it:
    shuffled, then sorted within chunks of 50 batches and the batches shuffled
    again, so training order stays random while padding stays small.
    """
    n = len(lengths)
    if rng is None:
        order = np.argsort(lengths, kind="stable")
        return [order[i:i + batch_size] for i in range(0, n, batch_size)]
    perm = rng.permutation(n)
    chunk = batch_size * 50
    batches = []
    for a in range(0, n, chunk):
        part = perm[a:a + chunk]
        part = part[np.argsort(lengths[part], kind="stable")]
        batches += [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def model_inputs(feats: Featurized, idx: Sequence[int], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Padded (B, T) input_ids / token_type_ids / attention_mask of rows ``idx``."""
    ids = pad([feats.input_ids[i] for i in idx], pad_id)
    types = pad([feats.token_type_ids[i] for i in idx], 0)
    mask = pad([[1] * len(feats.input_ids[i]) for i in idx], 0)
    return {"input_ids": ids.to(device), "token_type_ids": types.to(device), "attention_mask": mask.to(device)}


def prediction_batches(lengths: np.ndarray, batch_size: int | None, device: torch.device) -> list[np.ndarray]:
    """Row indices a forward for prediction: ``batch_size`` rows of similar length, or with None as many
    length-sorted rows as fit in the encoder's token budget (`encode.default_batch_tokens`), longest first.

    Why a budget: a fixed count of long rows makes activations above glibc's largest mmap threshold (64 reviews of
    512 tokens: 200 MB of fp32 feed-forward output), which are mapped and page-faulted in afresh every forward;
    `benchmarks/task_predict_speed.py` measures the two ways.
    """
    if batch_size is not None and batch_size < 1:  # 0 failed inside range(); -1 made no batch, every output None
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    if batch_size is not None:
        return batch_order(lengths, batch_size)
    return length_batches(np.asarray(lengths), None, default_batch_tokens(device))


@torch.no_grad()
def run_rows(
    model: torch.nn.Module, feats: Featurized, pad_id: int, device: torch.device, batch_size: int | None = None,
    bf16: bool = False, stage: str = "forward", progress: bool = False, desc: str = "predict",
) -> list[torch.Tensor]:
    """Run ``model.forward`` (logits) or ``model.encode`` (features) over every row; results unpadded, float32.

    batch_size: rows a forward; None: by token budget (`prediction_batches`).
    Per row: (C,) / (H,) for classification, (T_k, C) / (T_k, 2) / (T_k, H) for token-level heads.
    """
    lengths = feats.lengths()
    batches = prediction_batches(lengths, batch_size, device)
    was_training = model.training
    model.eval()
    steady_thresholds_for(device)  # a forward's freed activations stay in the heap (common/malloc.py)
    fn = model.forward if stage == "forward" else model.encode
    out: list[torch.Tensor | None] = [None] * len(feats)
    try:
        for idx in tqdm(batches, desc=desc, disable=not progress, leave=False):
            with autocast(device, bf16):
                y = fn(**model_inputs(feats, idx, pad_id, device))
            y = y.float().cpu()
            for j, i in enumerate(idx):
                out[i] = y[j] if y.dim() == 2 else y[j, :lengths[i]].clone()
    finally:
        model.train(was_training)
        trim_free_heap_for(device)  # free pages left in the heap's holes go back (common/malloc.py)
    return out  # type: ignore[return-value]


class TaskModel:
    """Head + tokenizer + TaskInfo. ``predict(examples)`` returns one prediction per example."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, info: TaskInfo,
                 device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.info = info
        self.task: Task = get_task(info.head)

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_encoder(cls, directory: str, info: TaskInfo, device: torch.device | str = "cpu",
                     dropout: float | None = None, seed: int = 0, pooling: str | None = None) -> TaskModel:
        """A new, randomly initialised ``info.head`` on the encoder weights of any BERT-family directory.

        ``pooling``: the classification head's "cls" (default) or "mean" (see encoder.heads).
        """
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"model directory not found: {directory}")
        config, _, _ = read_config(directory)
        config = dataclasses.replace(config, extra={k: v for k, v in config.extra.items() if k not in _HEAD_KEYS})
        tokenizer = Tokenizer.from_pretrained(directory)
        check_vocab_fits(directory, tokenizer, config)
        num_labels = 2 if info.head == "qa" else len(info.labels)
        model = build_head(info.head, config, num_labels, dropout, pooling)
        enc, _ = split_prefix(read_weights(directory))
        own = model.bert.state_dict()
        if "pooler.dense.weight" in own and "pooler.dense.weight" not in enc:
            logger.warning("%s has no pooler weights: the classification pooler starts random", directory)
            model.fresh_pooler = True  # drawn with the head from `seed`, not from the global RNG
        load_into(model.bert, {k: v for k, v in enc.items() if k in own}, os.path.join(directory, WEIGHTS_NAME),
                  allow_missing=("pooler.",))
        model.reset_head(seed)
        return cls(model, tokenizer, info, device)

    @classmethod
    def from_pretrained(cls, directory: str, device: torch.device | str = "cpu") -> TaskModel:
        """Load a task checkpoint (ours, or an HF BertFor{SequenceClassification,TokenClassification,QuestionAnswering})."""
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"model directory not found: {directory}")
        config, task, archs = read_config(directory)
        head = task.get("head")
        if head is None:
            by_arch = {a: h for h, a in ARCHITECTURES.items()}
            head = next((by_arch[a] for a in archs if a in by_arch), None)
        if head is None:
            raise ValueError(f"{directory} is not a fine-tuned task model (architectures={archs}); "
                             "fine-tune it first with `twotower finetune`")
        tokenizer = Tokenizer.from_pretrained(directory)
        check_vocab_fits(directory, tokenizer, config)
        labels = [] if head == "qa" else _labels_from(config, os.path.join(directory, CONFIG_NAME))
        known = {f.name for f in dataclasses.fields(TaskInfo)} - {"head", "labels"}
        info = TaskInfo(head=head, labels=labels, **{k: v for k, v in task.items() if k in known})
        if "max_length" not in task:
            info.max_length = tokenizer.model_max_length
        model = build_head(head, config, 2 if head == "qa" else len(labels))
        enc, rest = split_prefix(read_weights(directory))
        state = {f"bert.{k}": v for k, v in enc.items()} | rest
        load_into(model, state, os.path.join(directory, WEIGHTS_NAME))
        return cls(model.eval(), tokenizer, info, device)

    # ---- saving ------------------------------------------------------------------------------------
    def save(self, directory: str, extra_files: dict[str, str] | None = None,
             also: Callable[[str], None] | None = None) -> None:
        """Write the whole directory atomically (built beside it, then swapped in).

        extra_files: ``{name: text}`` written into it too, so they are swapped in with the checkpoint
        (fine-tuning's report).
        also: called with the directory being built, to write more into it before the swap (fine-tuning's
        training state, which must belong to the same moment as the checkpoint).
        """
        config: EncoderConfig = self.model.config
        extra = {k: v for k, v in config.extra.items() if k not in _HEAD_KEYS and k != "_name_or_path"}
        head_cfg: dict[str, Any] = {TASK_KEY: self.info.to_dict()}
        if self.info.head == "qa":
            head_cfg["num_labels"] = 2
        else:
            head_cfg["num_labels"] = len(self.info.labels)
            head_cfg["id2label"] = {str(i): label for i, label in enumerate(self.info.labels)}
            head_cfg["label2id"] = {label: i for i, label in enumerate(self.info.labels)}
            if getattr(self.model, "pooling", "cls") != "cls":
                head_cfg["classifier_pooling"] = self.model.pooling
        self.tokenizer.model_max_length = self.info.max_length
        # built beside `directory` under a temporary name (`TMP_MARKER`), which the run's next start sweeps
        # (`sweep_temporaries(..., of=)`) after a kill mid-save
        target = os.path.abspath(directory)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        build = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}{TMP_MARKER}{os.getpid()}")
        shutil.rmtree(build, ignore_errors=True)  # left by a killed save of an earlier process with this id
        try:
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            save_pretrained(build, dataclasses.replace(config, extra=extra), state, self.tokenizer,
                            architectures=[ARCHITECTURES[self.info.head]], config_extra=head_cfg)
            for name, text in (extra_files or {}).items():
                atomic_write_text(os.path.join(build, name), text)  # durable before the swap
            if also is not None:
                also(build)
            atomic_replace_dir(build, target)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise

    # ---- prediction --------------------------------------------------------------------------------
    def featurize(self, examples: Sequence, with_targets: bool = False) -> Featurized:
        self.task.check(examples, self.info.labels if with_targets else None, with_targets)
        return self.task.featurize(self.tokenizer, examples, self.info, with_targets)

    def outputs(self, feats: Featurized, batch_size: int | None = None, bf16: bool | str = False,
                progress: bool = False) -> list[np.ndarray]:
        """Unpadded logits per row (see ``run_rows``)."""
        use_bf16 = resolve_bf16(bf16, self.device)
        rows = run_rows(self.model, feats, self.tokenizer.pad_id, self.device, batch_size, use_bf16,
                        progress=progress)
        return [r.numpy() for r in rows]

    def predict(self, examples: Sequence, batch_size: int | None = None, bf16: bool | str = False,
                progress: bool = False, notes: list[str] | None = None) -> list:
        """One prediction per example: ClassPrediction, TagPrediction or QAPrediction.

        batch_size: model rows a forward; None (default): length-sorted rows by token budget, as the encoders
        batch (`prediction_batches`).

        notes: a list to append what the caller should tell the user about how the inputs were read
        (texts cut at ``max_length``, sentences read in windows, words read as [UNK]; `Task.notes`).
        """
        if not examples:
            return []
        feats = self.featurize(examples)
        if notes is not None:
            notes += self.task.notes(feats, self.info)
        return self.task.decode(examples, feats, self.outputs(feats, batch_size, bf16, progress), self.info)
