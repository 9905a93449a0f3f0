"""`twotower tokenizer train`: learn a BERT WordPiece vocabulary from text files.

Example:
    twotower tokenizer train --input corpus.txt.gz more.jsonl --vocab-size 16000 --out tok/
"""

from __future__ import annotations

import argparse
import os

from twotower.cli.checks import input_file, positive
from twotower.cli.help_format import DefaultsHelpFormatter


def register(subparsers) -> None:
    p = subparsers.add_parser("tokenizer", help="train a WordPiece tokenizer", description=__doc__.splitlines()[0])
    actions = p.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    t = actions.add_parser("train", help="learn a WordPiece vocabulary",
                           description="Learn a WordPiece vocabulary; writes tokenizer.json, vocab.txt, "
                                       "tokenizer_config.json and special_tokens_map.json to --out.",
                           formatter_class=DefaultsHelpFormatter)
    t.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help=".txt / .txt.gz (one text a line) or .jsonl(.gz) with a 'text' field")
    t.add_argument("--vocab-size", type=int, required=True, metavar="N")
    t.add_argument("--out", required=True, metavar="DIR")
    t.add_argument("--no-lowercase", action="store_true", help="keep case (a cased vocabulary)")
    t.add_argument("--min-frequency", type=int, default=2, help="drop merges seen fewer times")
    t.add_argument("--limit-alphabet", type=int, default=1000, help="most frequent characters kept")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=train)

    def _usage(args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=_usage)


def train(args: argparse.Namespace) -> int:
    from twotower.cli import CLIError
    from twotower.encoder.core.tokenizer import SPECIAL_TOKENS, Tokenizer, iter_text_files

    for path in args.input:  # fail before training, not from inside the Rust trainer's iterator
        input_file("--input", path)
    if args.vocab_size <= len(SPECIAL_TOKENS):
        raise CLIError(f"--vocab-size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {args.vocab_size}")
    positive("--min-frequency", args.min_frequency)
    positive("--limit-alphabet", args.limit_alphabet)  # 0 read as "saw no text"; < 0 overflowed
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CLIError(f"--out {args.out} exists and is not a directory")

    texts = iter_text_files(args.input)
    try:
        first = next(texts)
    except StopIteration:
        raise CLIError(f"no text in {' '.join(args.input)}") from None

    def stream():
        yield first
        yield from texts

    tok = Tokenizer.train(iterator=stream(), vocab_size=args.vocab_size, lowercase=not args.no_lowercase,
                          min_frequency=args.min_frequency, limit_alphabet=args.limit_alphabet,
                          progress=not args.no_progress)
    tok.save_pretrained(args.out)
    print(f"wrote {args.out} (vocabulary {tok.vocab_size}, lowercase={tok.lowercase}, "
          f"fingerprint {tok.fingerprint()})")
    return 0
