"""CoNLL-style token tagging files: ``token<TAB>tag`` per line, a blank line between sentences.

What counts as a sentence break: an empty line, a whitespace-only line (the
WNUT-17 training file separates sentences with a lone tab), or a
``-DOCSTART-`` line (CoNLL-2003).  With several columns (CoNLL-2003 has
``token POS chunk NER``) the first is the token and ``tag_column`` (default:
the last) is the tag.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

from twotower.common.atomic import atomic_open
from twotower.common.errors import DataError
from twotower.common.lines import numbered_lines


class TaggedSentence(NamedTuple):
    tokens: list[str]
    tags: list[str]


def read_conll(path: str | os.PathLike[str], tag_column: int = -1) -> list[TaggedSentence]:
    """Read sentences of ``(tokens, tags)``.

    Columns are split on tabs when the line has one, else on whitespace.

    Raises:
        DataError: a token line with fewer than 2 columns, or without the requested tag column.
    """
    sentences: list[TaggedSentence] = []
    tokens: list[str] = []
    tags: list[str] = []
    for number, line in numbered_lines(path):
        if not line.strip() or line.startswith("-DOCSTART-"):
            if tokens:
                sentences.append(TaggedSentence(tokens, tags))
                tokens, tags = [], []
            continue
        fields = line.split("\t") if "\t" in line else line.split()
        if len(fields) < 2:
            raise DataError(path, number, "expected 'token<TAB>tag', found a single column")
        try:
            tag = fields[tag_column].strip()
        except IndexError:
            raise DataError(path, number, f"no column {tag_column} (line has {len(fields)})") from None
        token = fields[0]
        if not token or not tag:
            raise DataError(path, number, "empty token or tag")
        tokens.append(token)
        tags.append(tag)
    if tokens:
        sentences.append(TaggedSentence(tokens, tags))
    return sentences


def write_conll(sentences: Iterable[TaggedSentence], path: str | os.PathLike[str]) -> None:
    """Write ``token<TAB>tag`` lines with a blank line after each sentence, atomically."""
    with atomic_open(path) as handle:
        for s, sentence in enumerate(sentences):
            if len(sentence.tokens) != len(sentence.tags):
                raise ValueError(f"sentence {s}: {len(sentence.tokens)} tokens but {len(sentence.tags)} tags")
            for token, tag in zip(sentence.tokens, sentence.tags):
                if any(ch in "\t\n" for ch in token + tag) or not token or not tag:
                    raise ValueError(
                        f"sentence {s}: token {token!r} / tag {tag!r} is empty or holds a tab/newline"
                    )
                handle.write(f"{token}\t{tag}\n")
            handle.write("\n")
