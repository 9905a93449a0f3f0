"""What a user does to a command's --out while the command runs, for the tests that a swap keeps their files."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def adding_a_file(fn: Callable[..., Any], path: str | os.PathLike, text: str = "mine\n") -> Callable[..., Any]:
    """`fn`, which writes or swaps a command's output, made to write the user's file at `path` first: the
    moment after the command last looked at --out, when that file must survive what `fn` does."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return fn(*args, **kwargs)

    return wrapped
