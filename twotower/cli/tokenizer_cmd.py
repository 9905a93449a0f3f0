"""twotower tokenizer train: learn a BERT WordPiece vocabulary from text files.

Example:
    twotower tokenizer train --input corpus.txt.gz more.jsonl --vocab-size 16000 --out tok/
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import TYPE_CHECKING

from twotower.cli.checks import input_file, positive
from twotower.cli.help_format import DefaultsHelpFormatter

if TYPE_CHECKING:
    from twotower.encoder.core.tokenizer import Tokenizer


def register(subparsers) -> None:
    p = subparsers.add_parser("tokenizer", help="train a WordPiece tokenizer", description=__doc__.splitlines()[0])
    actions = p.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    t = actions.add_parser("train", help="learn a WordPiece vocabulary",
                           description="Learn a WordPiece vocabulary; writes tokenizer.json, vocab.txt, "
                                       "tokenizer_config.json and special_tokens_map.json to --out.",
                           formatter_class=DefaultsHelpFormatter)
    t.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help=".txt / .txt.gz (one text a line) or .jsonl(.gz) with a 'text' field")
    t.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="tokens in the vocabulary, special tokens included (the alphabet, up to --limit-alphabet "
                        "characters, is always kept, so it may come out larger; a corpus with fewer pieces gives "
                        "fewer)")
    t.add_argument("--out", required=True, metavar="DIR",
                   help="a new or empty directory, or (with --overwrite) one an earlier `tokenizer train` wrote")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the tokenizer --out already holds (a model or other files are never replaced)")
    t.add_argument("--no-lowercase", action="store_true", help="keep case (a cased vocabulary)")
    t.add_argument("--min-frequency", type=int, default=2, metavar="N", help="drop merges seen fewer than N times")
    t.add_argument("--limit-alphabet", type=int, default=1000, metavar="N",
                   help="keep the N most frequent characters as the initial alphabet")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=train)

    def _usage(args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=_usage)


def train(args: argparse.Namespace) -> int:
    from twotower.cli import CLIError
    from twotower.encoder.core.tokenizer import SPECIAL_TOKENS, Tokenizer, iter_text_files
    from twotower.retrieval.export import write_model_dir

    for path in args.input:  # fail before training, not from inside the Rust trainer's iterator
        input_file("--input", path)
    if args.vocab_size <= len(SPECIAL_TOKENS):
        raise CLIError(f"--vocab-size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {args.vocab_size}")
    positive("--min-frequency", args.min_frequency)
    positive("--limit-alphabet", args.limit_alphabet)  # 0 read as "saw no text"; < 0 overflowed
    _check_out(args.out, args.overwrite)

    texts = iter_text_files(args.input)
    try:
        first = next(texts)
    except StopIteration:
        raise CLIError(f"no text in {' '.join(args.input)}") from None

    chars: set[str] = set()  # every character of the text, to say which ones --limit-alphabet left out

    def stream():
        for text in itertools.chain([first], texts):
            chars.update(text)
            yield text

    tok = Tokenizer.train(iterator=stream(), vocab_size=args.vocab_size, lowercase=not args.no_lowercase,
                          min_frequency=args.min_frequency, limit_alphabet=args.limit_alphabet,
                          progress=not args.no_progress)
    _check_out(args.out, args.overwrite)  # again: a file saved into --out while the tokenizer trained goes with it
    # the four files are one unit: built in a sibling folder, then swapped in, so a failure leaves --out as it was
    write_model_dir(os.path.normpath(args.out), tok.save_pretrained)
    note = _size_note(tok, args.vocab_size, args.min_frequency, args.limit_alphabet, _left_out(tok, chars))
    print(f"wrote {args.out} (vocabulary {tok.vocab_size}{note}, lowercase={tok.lowercase}, fingerprint "
          f"{tok.fingerprint()})")
    return 0


# Files that make a directory a model (weights, its config, a sentence-transformers or two-tower layout):
# a tokenizer written there would replace the one the model's embedding table was trained with.
_MODEL_FILES = ("config.json", "modules.json", "dual_encoder.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _check_out(out: str, overwrite: bool) -> None:
    """``--out`` must be new, empty, or (with --overwrite) a tokenizer an earlier run of this command wrote.

    Why: the four files were written one by one into whatever --out was, so `--out clf_model` swapped a
    fine-tuned model's vocabulary for a new one (its predictions silently degraded), and an unrelated
    directory got tokenizer files mixed into it. A model or other files are refused even with --overwrite:
    replacing the directory as a unit would delete them.
    """
    from twotower.cli import CLIError
    from twotower.common.paths import (
        beside_earlier_refusal,
        foreign_entries,
        not_ours_refusal,
        working_directory_refusal,
    )
    from twotower.encoder.core.tokenizer import TOKENIZER_FILES

    if not os.path.exists(out):
        return
    if problem := working_directory_refusal(out, f"--out {out}", "the tokenizer", "--out tok"):
        raise CLIError(problem)
    if not os.path.isdir(out):
        raise CLIError(f"--out {out}: a file; give a new or empty directory")
    names = sorted(os.listdir(out))
    others = foreign_entries(out, TOKENIZER_FILES)  # the one rule of what a command may replace (a_few names them)
    if not others:
        if names and not overwrite:
            raise CLIError(f"--out {out} already holds a tokenizer; pass --overwrite to replace it, "
                           "or give another --out")
        return
    model = [n for n in others if n in _MODEL_FILES or n.endswith(_WEIGHT_SUFFIXES)]
    if model:
        raise CLIError(f"--out {out}: a model directory (it has {model[0]}); a new tokenizer there would no longer "
                       "match the model's embeddings; give a new or empty directory")
    if len(others) < len(names):  # some of the tokenizer's files beside the user's: --overwrite would remove them
        raise CLIError(beside_earlier_refusal(f"--out {out}", "an earlier tokenizer", others))
    raise CLIError(not_ours_refusal(f"--out {out}", others, "a tokenizer"))


def _single_pieces(tok: Tokenizer) -> list[str]:
    """The vocabulary's single-character pieces, alone or as ``##`` continuations (special tokens aside)."""
    from twotower.encoder.core.tokenizer import SPECIAL_TOKENS

    return [t for t in tok.get_vocab() if t not in SPECIAL_TOKENS and (len(t) == 1 or (len(t) == 3 and t[:2] == "##"))]


def _left_out(tok: Tokenizer, chars: set[str]) -> int:
    """How many characters of the text (as the tokenizer normalises them) the vocabulary has no piece for:
    those --limit-alphabet left out, which become [UNK]."""
    alphabet = {t[-1] for t in _single_pieces(tok)}
    normalize = tok._tok.normalizer.normalize_str
    return len({n for c in chars for n in normalize(c) if not n.isspace() and n not in alphabet})


def _size_note(tok: Tokenizer, asked: int, min_frequency: int, limit_alphabet: int, left_out: int) -> str:
    """Why the learned vocabulary is not the --vocab-size asked for ("" when it is).

    The WordPiece trainer always keeps the special tokens and every character of the corpus (alone and
    as a ``##`` continuation), however small the size asked; and it stops early when the corpus has no
    more pieces to merge. Either way it said nothing, and "vocabulary 42" after --vocab-size 6 read as a bug.
    """
    from twotower.encoder.core.tokenizer import SPECIAL_TOKENS

    # Characters past --limit-alphabet are not kept: "all of the corpus's characters are kept" was false there.
    unk = (f"; the {left_out} rarer characters past --limit-alphabet {limit_alphabet} have no piece and become "
           "[UNK]" if left_out else "")
    size = tok.vocab_size
    if size == asked:
        return f" ({unk[2:]})" if unk else ""
    if size > asked:
        pieces = _single_pieces(tok)
        chars = len(pieces)
        kept = (f"{len({t[-1] for t in pieces})} most frequent characters (--limit-alphabet), as {chars} "
                "single-character pieces," if left_out else f"{chars} single-character pieces")
        return f" (asked for {asked}: the {len(SPECIAL_TOKENS)} special tokens and the corpus's {kept} are always kept{unk})"
    seen = f" seen {min_frequency} or more times, --min-frequency {min_frequency}" if min_frequency > 1 else ""
    return f" (asked for {asked}: the corpus has no more distinct pieces{seen}{unk})"
