"""Metadata filters: a small expression language over a document's JSON ``metadata``.

Why a language of our own (and not SQL or Python): a filter arrives from a command line or
an HTTP request, so it must be parsed, never evaluated; and one filter has to run in three
places with the same answer — in Python (``Filter.matches``, the reference semantics), in
the document store's SQLite (``Filter.to_sql``) and in Milvus (``Filter.to_milvus``). The
syntax follows Milvus's boolean expressions so users of a vector database feel at home::

    lang == "en" and year >= 2010
    source.name in ["pubmed", 'arxiv'] or not (retracted == true)
    published >= "2020-01-01" and published < "2021-01-01"

Grammar (``not`` binds tighter than ``and``, which binds tighter than ``or``)::

    expr       := and_expr ("or" and_expr)*
    and_expr   := not_expr ("and" not_expr)*
    not_expr   := "not" not_expr | "(" expr ")" | comparison
    comparison := field ("==" | "!=" | "<" | "<=" | ">" | ">=") literal
                | field ["not"] "in" "[" [literal ("," literal)* [","]] "]"
    field      := key ("." key)*            key := a letter (any script) or "_", then letters, digits, "_" | "`" any text but ` . " \\ "`"
    literal    := number | string | "true" | "false"

Keywords are lower- or upper-case (``and``/``AND``); strings are double- or single-quoted with
backslash escapes (``\\" \\' \\\\ \\n \\t \\r``); numbers are integers or decimals in ASCII digits (``-3``, ``2.5e3``).
A dotted field names nested metadata (``source.name`` is ``metadata["source"]["name"]``). A key that is
not a name, or is a keyword, is back-quoted: `` `pub-date` >= "2020" ``, `` source.`in` == 1 ``.

Semantics (the same in all three translations; they are SQL's and Milvus's for JSON values):

* Three-valued logic. A comparison on a missing field or a JSON ``null`` is *unknown*, and so
  is an order comparison (``<`` ``<=`` ``>`` ``>=``) between values of different kinds;
  ``not`` of unknown is unknown, ``and``/``or`` follow Kleene's tables, and a document
  matches only when the whole filter is true. So ``not (lang == "en")`` and ``lang != "en"``
  both match only documents that have a ``lang``.
* Kinds: numbers (integers and decimals compare with each other; ``true`` and ``false`` are
  the numbers 1 and 0, as in SQLite's and Milvus's JSON) and strings. ``==`` is true when the
  stored value has the literal's kind and is equal, false for any other present value (a
  list, an object, another kind); ``!=`` is its negation.
* Order: numbers by value, strings by code point (the order of their UTF-8 bytes, which is
  SQLite's and Milvus's); a boolean literal has no order (refused).
* Dates: a string literal that is an ISO-8601 date or date-time (``"2020-01-01"``,
  ``"2020-01-01T12:30:00Z"``) must be a valid one, and is compared with the stored strings
  in string order. ISO-8601 strings of one form (same precision, same time-zone notation,
  e.g. all UTC with ``Z``) sort lexicographically in chronological order, so store dates in
  one such form. A date-only literal against stored date-times means midnight at the start of
  that day for the order operators (``published >= "2020-01-01"`` includes
  ``"2020-01-01T08:00:00Z"``); ``==`` compares the strings exactly.
* ``f in [a, b]`` is ``f == a or f == b`` (``in []`` is false); ``f not in [...]`` is
  ``not (f in [...])``.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any

__all__ = ["Filter", "FilterError", "as_filter", "parse_filter"]

Literal = bool | int | float | str

_INT64 = (-(2**63), 2**63 - 1)
# A filter arrives from HTTP clients too, so its size is bounded where it is parsed: SQLite refuses an
# expression more than 1,000 nodes deep and overflows its parser stack at about 45 nested NOTs, and the
# parser here recurses once per level. Elasticsearch bounds a query's clauses the same way (1,024).
MAX_DEPTH = 16  # nested parentheses and `not`s
MAX_TERMS = 1024  # comparisons, an `in` list counting one per value
_MAX_KNOWN_LISTED = 30  # known fields named in an "unknown field" error
_KEYWORDS = {"and", "or", "not", "in", "true", "false"}
_ORDER_OPS = ("<", "<=", ">", ">=")
_OPS = ("==", "!=") + _ORDER_OPS
_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone one is no text: refused, and shown as U+FFFD
_ISO_DATE = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})"
    r"(?:[T ](\d{2}):(\d{2})(?::(\d{2})(?:\.\d{1,9})?)?(?:Z|[+-]\d{2}:?\d{2})?)?$"
)


class FilterError(ValueError):
    """A filter that does not parse, or names an unknown field.

    ``str(e)`` is one line naming the option (``where``, ``filter`` by default), the problem,
    the 1-based column and the filter text, then a caret line under the column::

        filter: unexpected ')' at column 14: year >= 2010 )
                                                          ^

    ``renamed(where, indent)`` gives the same error under the name the user typed (``--filter``),
    with the caret moved right by ``indent`` for a message printed after a prefix of that width.
    ``line`` is the first line alone (for a JSON error body, with ``column`` beside it).
    """

    def __init__(self, problem: str, text: str, column: int, *, where: str = "filter",
                 detail: str = "", indent: int = 0) -> None:
        self.problem = problem
        self.text = text
        self.column = column
        self.where = where
        self.detail = detail
        self.indent = indent
        head = f"{where}: {problem} at column {column}: "
        excerpt, caret = _excerpt(text, column)
        self.line = head + excerpt + (f" ({detail})" if detail else "")
        super().__init__(self.line + "\n" + " " * (indent + len(head) + caret) + "^")

    def renamed(self, where: str, indent: int = 0) -> FilterError:
        return FilterError(self.problem, self.text, self.column, where=where, detail=self.detail, indent=indent)


def _excerpt(text: str, column: int, width: int = 60) -> tuple[str, int]:
    """The filter text (or a window of it around ``column`` when long) and the caret offset in it."""
    flat = _SURROGATE.sub("\ufffd", text.replace("\n", " ").replace("\t", " ").replace("\r", " "))  # printable
    pos = column - 1
    if len(flat) <= width:
        return flat, pos
    start = max(0, min(pos - width // 2, len(flat) - width))
    piece = flat[start : start + width]
    prefix = "..." if start > 0 else ""
    suffix = "..." if start + width < len(flat) else ""
    return prefix + piece + suffix, len(prefix) + pos - start


# ---------------------------------------------------------------------------- tokens
@dataclass(frozen=True)
class _Tok:
    kind: str  # "name" "kw" "num" "str" "op" "(" ")" "[" "]" "," "end"
    value: Any
    col: int  # 1-based column of the first character
    raw: str


# A name: letters of any script, digits and '_', not starting with a digit (`城市`, `année` need no quotes,
# as in Python); numbers are ASCII digits only, so a full-width "２００６" is no number.
_IDENT = re.compile(r"[^\W\d]\w*")
# Characters a quoted key cannot hold: the JSON paths of SQLite and Milvus cannot name them ('"', '\\',
# control characters, which JSON stores escaped), the quote itself, and '.', which no stored key holds.
_UNQUOTABLE = re.compile(r'[`."\\\x00-\x1f\x7f]')
_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_ESCAPES = {'"': '"', "'": "'", "\\": "\\", "n": "\n", "t": "\t", "r": "\r"}


def _tokenize(text: str) -> list[_Tok]:
    if not text.isascii() and (m := _SURROGATE.search(text)):
        raise FilterError(f"lone surrogate {ascii(m.group())} (an unpaired \\u escape), which is not Unicode text",
                          text, m.start() + 1)
    toks: list[_Tok] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        col = i + 1
        if c.isspace():
            i += 1
            continue
        if c in "()[],":
            toks.append(_Tok(c, c, col, c))
            i += 1
            continue
        two = text[i : i + 2]
        if two in ("==", "!=", "<=", ">="):
            toks.append(_Tok("op", two, col, two))
            i += 2
            continue
        if c in "<>":
            toks.append(_Tok("op", c, col, c))
            i += 1
            continue
        if c == "=":
            raise FilterError("'=' is not an operator (use '==' for equality)", text, col)
        if c in "\"'":
            value, i = _read_string(text, i)
            toks.append(_Tok("str", value, col, text[col - 1 : i]))
            continue
        m = _NUMBER.match(text, i)
        if m and (c != "-" or m.end() > i + 1):
            raw = m.group(0)
            end = m.end()
            if end < n and (text[end].isalnum() or text[end] in "_."):
                raise FilterError(f"malformed number {text[i:end + 1]!r}", text, col)
            if m.group(1) or m.group(2):
                value: Any = float(raw)
            else:
                value = int(raw)
                if not _INT64[0] <= value <= _INT64[1]:
                    raise FilterError(f"integer {raw} is out of the 64-bit range", text, col)
            toks.append(_Tok("num", value, col, raw))
            i = end
            continue
        if c == "`" or _IDENT.match(c):
            raw, parts, i = _read_field(text, i)
            low = raw.lower()
            if len(parts) == 1 and raw == parts[0] and low in _KEYWORDS and raw in (low, raw.upper()):
                toks.append(_Tok("kw", low, col, raw))
            else:
                toks.append(_Tok("name", ".".join(parts), col, raw))
            continue
        if two in ("&&", "||") or c == "!":
            word = {"&&": "and", "||": "or"}.get(two, "not")
            raise FilterError(f"unexpected {two if two in ('&&', '||') else c!r} (write '{word}')", text, col)
        raise FilterError(f"unexpected character {c!r}", text, col)
    toks.append(_Tok("end", None, n + 1, ""))
    return toks


def _read_field(text: str, i: int) -> tuple[str, list[str], int]:
    """A field name at ``text[i]``: its raw text, its keys and the index after it.

    Each key is a name (``year``) or, for a metadata key that is not one, back-quoted (`` `pub-date` ``,
    `` `in` ``), as SQL dialects quote identifiers; keys are joined by '.' for nesting.
    """
    start, parts = i, []
    while True:
        col = i + 1
        if i < len(text) and text[i] == "`":
            end = text.find("`", i + 1)
            if end < 0:
                raise FilterError("unterminated `quoted` field name", text, col)
            key = text[i + 1 : end]
            if not key.strip():
                raise FilterError("empty `quoted` field name", text, col)
            if m := _UNQUOTABLE.search(key):
                raise FilterError(f"a filter cannot name a key holding {m.group()!r}", text, col + 1 + m.start())
            parts.append(key)
            i = end + 1
        elif m := _IDENT.match(text, i):
            key = m.group(0)
            dotted = bool(parts) or text[m.end():m.end() + 1] == "."  # a keyword alone is the keyword
            if key.lower() in _KEYWORDS and key in (key.lower(), key.upper()) and dotted:
                raise FilterError(f"{key!r} is a keyword and cannot be part of a field name (quote it: `{key}`)",
                                  text, col)
            parts.append(key)
            i = m.end()
        else:
            raise FilterError(f"malformed field name {text[start:i + 1]!r}", text, start + 1)
        if i < len(text) and text[i] == ".":
            i += 1
            continue
        if i < len(text) and (text[i].isalnum() or text[i] in "_`"):
            raise FilterError(f"malformed field name {text[start:i + 1]!r}", text, start + 1)
        return text[start:i], parts, i


def _known_detail(known: set[str]) -> str:
    """The known fields of an "unknown field" error, as a filter writes them; those a filter cannot name (a
    key holding a back-quote, '"', '\\' or a control character: a quoted key cannot escape them) counted
    apart, since listed they would be a spelling the parser refuses."""
    if not known:
        return "no document in the index has metadata"
    listed = sorted(p for p in known if not any(_UNQUOTABLE.search(k) for k in p.split(".")))
    shown = ", ".join(map(_written, listed[:_MAX_KNOWN_LISTED]))
    if len(listed) > _MAX_KNOWN_LISTED:
        shown += f", ... ({len(listed)} in all)"
    if unnamed := len(known) - len(listed):
        shown = (f"{shown}; {unnamed} more" if listed else f"none a filter can name: {unnamed}") + (
            " whose keys hold a back-quote, a double quote, a backslash or a control character, which a filter "
            "cannot name, even back-quoted")
    return f"known fields: {shown}"


def _written(path: str) -> str:
    """A dotted metadata path as a filter writes it: keys that are not names, or are keywords, back-quoted."""
    return ".".join(k if _IDENT.fullmatch(k) and k.lower() not in _KEYWORDS else f"`{k}`" for k in path.split("."))


def _read_string(text: str, i: int) -> tuple[str, int]:
    quote = text[i]
    out: list[str] = []
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == quote:
            return "".join(out), j + 1
        if c == "\\":
            if j + 1 >= len(text):
                break
            esc = text[j + 1]
            if esc not in _ESCAPES:
                raise FilterError(f"unknown escape '\\{esc}' in a string", text, j + 1)
            out.append(_ESCAPES[esc])
            j += 2
            continue
        out.append(c)
        j += 1
    raise FilterError("unterminated string", text, i + 1)


def _describe(tok: _Tok) -> str:
    return "end of filter" if tok.kind == "end" else repr(tok.raw)


# ---------------------------------------------------------------------------- the tree
@dataclass(frozen=True)
class _Cmp:
    field: str
    op: str  # one of _OPS
    value: Literal
    col: int = _field(compare=False)  # where the field name starts, for errors


@dataclass(frozen=True)
class _In:
    field: str
    values: tuple[Literal, ...]
    col: int = _field(compare=False)


@dataclass(frozen=True)
class _Not:
    arg: _Node


@dataclass(frozen=True)
class _And:
    args: tuple[_Node, ...]


@dataclass(frozen=True)
class _Or:
    args: tuple[_Node, ...]


_Node = _Cmp | _In | _Not | _And | _Or


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokenize(text)
        self.pos = 0
        self.depth = 0  # parentheses and `not`s open around the current token
        self.terms = 0

    def peek(self) -> _Tok:
        return self.toks[self.pos]

    def take(self) -> _Tok:
        tok = self.toks[self.pos]
        self.pos += 1
        return tok

    def error(self, problem: str, tok: _Tok) -> FilterError:
        return FilterError(problem, self.text, tok.col)

    def is_kw(self, word: str) -> bool:
        tok = self.peek()
        return tok.kind == "kw" and tok.value == word

    def parse(self) -> _Node:
        if self.peek().kind == "end":
            raise self.error("empty filter (leave it out to search without one)", self.peek())
        node = self.or_expr()
        tok = self.peek()
        if tok.kind != "end":
            raise self.error(f"unexpected {_describe(tok)}", tok)
        return node

    def or_expr(self) -> _Node:
        args = [self.and_expr()]
        while self.is_kw("or"):
            self.take()
            args.append(self.and_expr())
        return args[0] if len(args) == 1 else _Or(tuple(args))

    def and_expr(self) -> _Node:
        args = [self.not_expr()]
        while self.is_kw("and"):
            self.take()
            args.append(self.not_expr())
        return args[0] if len(args) == 1 else _And(tuple(args))

    def nest(self, tok: _Tok) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"nested more than {MAX_DEPTH} levels deep (parentheses and 'not')", tok)

    def count(self, terms: int, tok: _Tok) -> None:
        self.terms += terms
        if self.terms > MAX_TERMS:
            raise self.error(f"more than {MAX_TERMS} comparisons (each value of an 'in' list counts one)", tok)

    def not_expr(self) -> _Node:
        tok = self.peek()
        if self.is_kw("not"):
            self.take()
            self.nest(tok)
            node: _Node = _Not(self.not_expr())
            self.depth -= 1
            return node
        if tok.kind == "(":
            self.take()
            self.nest(tok)
            if self.peek().kind == ")":
                raise self.error("empty parentheses", self.peek())
            node = self.or_expr()
            close = self.peek()
            if close.kind != ")":
                raise self.error(f"expected ')' to close the '(' at column {tok.col}, got {_describe(close)}",
                                 close)
            self.take()
            self.depth -= 1
            return node
        return self.comparison()

    def comparison(self) -> _Node:
        tok = self.take()
        if tok.kind != "name":
            what = "a field name" if tok.kind != "end" else "a condition"
            raise self.error(f"expected {what}, got {_describe(tok)}", tok)
        op = self.peek()
        negate = False
        if self.is_kw("not"):
            self.take()
            op = self.peek()
            if not self.is_kw("in"):
                raise self.error(f"expected 'in' after 'not', got {_describe(op)}", op)
            negate = True
        if self.is_kw("in"):
            self.take()
            values = self.literal_list()
            self.count(max(1, len(values)), tok)
            node: _Node = _In(tok.value, values, tok.col)
            return _Not(node) if negate else node
        self.count(1, tok)
        if op.kind != "op":
            raise self.error(
                f"expected an operator (==, !=, <, <=, >, >=, in) after field {tok.value!r}, got {_describe(op)}",
                op)
        self.take()
        lit = self.peek()
        value = self.literal(after=op.value)
        if op.value in _ORDER_OPS and isinstance(value, bool):
            raise self.error(f"'{op.value}' needs a number, a string or a date, got {lit.raw}", lit)
        return _Cmp(tok.value, op.value, value, tok.col)

    def literal(self, after: str) -> Literal:
        tok = self.take()
        if tok.kind in ("num", "str"):
            if tok.kind == "str":
                _check_date(tok, self.text)
            return tok.value
        if tok.kind == "kw" and tok.value in ("true", "false"):
            return tok.value == "true"
        if tok.kind == "name":
            raise self.error(f"expected a value after '{after}', got field name {tok.raw!r} "
                             "(quote strings: \"...\")", tok)
        raise self.error(f"expected a value after '{after}', got {_describe(tok)}", tok)

    def literal_list(self) -> tuple[Literal, ...]:
        tok = self.take()
        if tok.kind != "[":
            raise self.error(f"expected '[' after 'in', got {_describe(tok)}", tok)
        values: list[Literal] = []
        while self.peek().kind != "]":
            values.append(self.literal(after="[" if not values else ","))
            sep = self.peek()
            if sep.kind == ",":
                self.take()
            elif sep.kind != "]":
                raise self.error(f"expected ',' or ']' in the list opened at column {tok.col}, "
                                 f"got {_describe(sep)}", sep)
        self.take()
        return tuple(values)


def _check_date(tok: _Tok, text: str) -> None:
    """A string shaped like an ISO date must be a real one (``"2020-02-30"`` is refused)."""
    m = _ISO_DATE.match(tok.value)
    if not m:
        return
    y, mo, d, hh, mi, ss = m.groups()
    try:
        _dt.date(int(y), int(mo), int(d))
        if hh is not None:
            _dt.time(int(hh), int(mi), int(ss or 0))
    except ValueError as e:
        raise FilterError(f"invalid date {tok.raw} ({e})", text, tok.col) from None


def is_iso_date(value: str) -> bool:
    """Whether a string is an ISO-8601 date or date-time as the filter language reads them."""
    return bool(_ISO_DATE.match(value))


# ---------------------------------------------------------------------------- evaluation
# Three-valued (Kleene) logic, as SQL and Milvus evaluate it: None is "unknown".
_MISSING = object()


def _lookup(metadata: Mapping[str, Any], path: str) -> Any:
    value: Any = metadata
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _kind(value: Any) -> str | None:
    """What a value compares as: "num" (booleans are the numbers 1 and 0), "str", or None (lists, objects)."""
    if isinstance(value, (bool, int, float)):
        return "num"
    if isinstance(value, str):
        return "str"
    return None


def _compare(stored: Any, op: str, lit: Literal) -> bool | None:
    if stored is _MISSING or stored is None:
        return None
    same = _kind(stored) is not None and _kind(stored) == _kind(lit)
    if op == "==":
        return same and stored == lit
    if op == "!=":
        return not (same and stored == lit)
    if not same:
        return None
    if op == "<":
        return stored < lit
    if op == "<=":
        return stored <= lit
    if op == ">":
        return stored > lit
    return stored >= lit


def _eval(node: _Node, md: Mapping[str, Any]) -> bool | None:
    if isinstance(node, _Cmp):
        return _compare(_lookup(md, node.field), node.op, node.value)
    if isinstance(node, _In):
        stored = _lookup(md, node.field)
        return _any(_compare(stored, "==", v) for v in node.values)
    if isinstance(node, _Not):
        inner = _eval(node.arg, md)
        return None if inner is None else not inner
    if isinstance(node, _And):
        return _all(_eval(a, md) for a in node.args)
    return _any(_eval(a, md) for a in node.args)


def _any(values: Iterable[bool | None]) -> bool | None:
    out: bool | None = False
    for v in values:
        if v:
            return True
        if v is None:
            out = None
    return out


def _all(values: Iterable[bool | None]) -> bool | None:
    out: bool | None = True
    for v in values:
        if v is False:
            return False
        if v is None:
            out = None
    return out


# ---------------------------------------------------------------------------- SQL
_SQL_TYPES = {"num": "('integer', 'real', 'true', 'false')", "str": "('text')"}  # json_type names per kind


def _json_path(field: str) -> str:
    return "$." + ".".join(f'"{p}"' for p in field.split("."))


def _sql(node: _Node, col: str, params: list[Any]) -> str:
    if isinstance(node, _Cmp):
        return _sql_atom(col, node.field, node.op, node.value, params)
    if isinstance(node, _In):
        return _sql_in(col, node.field, node.values, params) if node.values else "0"
    if isinstance(node, _Not):
        return f"(NOT {_sql(node.arg, col, params)})"
    return _balanced([_sql(a, col, params) for a in node.args], " AND " if isinstance(node, _And) else " OR ")


def _balanced(parts: list[str], joiner: str, flat: int = 16) -> str:
    """``(a OR b OR ...)``, long chains as a tree of halves: SQLite counts a chain as an expression as deep
    as it is long and refuses one deeper than 1,000 (the parameters stay in text order)."""
    if len(parts) <= flat:
        return "(" + joiner.join(parts) + ")"
    mid = len(parts) // 2
    return "(" + _balanced(parts[:mid], joiner, flat) + joiner + _balanced(parts[mid:], joiner, flat) + ")"


def _sql_in(col: str, field: str, values: tuple[Literal, ...], params: list[Any]) -> str:
    """``f in [...]`` as one SQL ``IN`` per kind of value: what ``f == v1 or f == v2 ...`` gives (unknown on a
    missing or null field, else whether the stored value has a value's kind and equals it), in an
    expression whose depth does not grow with the list."""
    path = _json_path(field)
    jt = f"json_type({col}, ?)"
    params.append(path)
    tests = []
    for kind in ("num", "str"):
        same = [int(v) if isinstance(v, bool) else v for v in values if _kind(v) == kind]
        if same:
            params.extend([path, path, *same])
            tests.append(f"({jt} IN {_SQL_TYPES[kind]} AND json_extract({col}, ?) IN ({', '.join('?' * len(same))}))")
    return f"(CASE WHEN IFNULL({jt}, 'null') = 'null' THEN NULL ELSE ({' OR '.join(tests)}) END)"


def _sql_atom(col: str, field: str, op: str, value: Literal, params: list[Any]) -> str:
    """One comparison: 1, 0, or NULL (unknown) exactly where ``_compare`` gives True, False, None.

    json_extract gives 1/0 for JSON true/false, so booleans compare as numbers, as in Milvus.
    """
    path = _json_path(field)
    types = _SQL_TYPES[_kind(value) or "str"]
    lit = int(value) if isinstance(value, bool) else value
    jt = f"json_type({col}, ?)"
    if op in ("==", "!="):
        params.extend([path, path, path, lit])
        test = f"({jt} IN {types} AND json_extract({col}, ?) = ?)"
        if op == "!=":
            test = f"NOT {test}"
        return f"(CASE WHEN IFNULL({jt}, 'null') = 'null' THEN NULL ELSE {test} END)"
    params.extend([path, path, lit])
    return f"(CASE WHEN {jt} IN {types} THEN json_extract({col}, ?) {op} ? END)"


# ---------------------------------------------------------------------------- Milvus
def _milvus_literal(v: Literal) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    return repr(v)


def _milvus(node: _Node, jf: str) -> str:
    if isinstance(node, _Cmp):
        return f"{_milvus_field(jf, node.field)} {node.op} {_milvus_literal(node.value)}"
    if isinstance(node, _In):  # Milvus's own `in` does not take a JSON key: a disjunction of ==
        f = _milvus_field(jf, node.field)
        if not node.values:
            return f"(exists {f} and not (exists {f}))"  # false for every row, like an empty disjunction
        parts = [f"{f} == {_milvus_literal(v)}" for v in node.values]
        return parts[0] if len(parts) == 1 else "(" + " or ".join(parts) + ")"
    if isinstance(node, _Not):
        return f"not ({_milvus(node.arg, jf)})"
    joiner = " and " if isinstance(node, _And) else " or "
    return "(" + joiner.join(_milvus(a, jf) for a in node.args) + ")"


def _milvus_field(jf: str, field: str) -> str:
    return jf + "".join(f'["{p}"]' for p in field.split("."))


# ---------------------------------------------------------------------------- the public object
def _walk(node: _Node) -> Iterable[_Node]:
    yield node
    if isinstance(node, _Not):
        yield from _walk(node.arg)
    elif isinstance(node, (_And, _Or)):
        for a in node.args:
            yield from _walk(a)


class Filter:
    """A parsed filter (``parse_filter``). Immutable; ``str(f)`` is the text it was parsed from."""

    __slots__ = ("text", "_root")

    def __init__(self, text: str, root: _Node) -> None:
        self.text = text
        self._root = root

    def fields(self) -> set[str]:
        """The dotted field paths the filter reads."""
        return {n.field for n in _walk(self._root) if isinstance(n, (_Cmp, _In))}

    def check_fields(self, known: Iterable[str], *, where: str = "filter") -> None:
        """Raise ``FilterError`` at the first field not in ``known`` (the leaf paths of the metadata stored,
        ``metadata_fields``) nor an object holding one of them (``src`` of ``src.name``: ``src != "x"`` is
        true of it, as of any present value)."""
        known = set(known)
        names = known | {".".join(keys[:j]) for keys in (path.split(".") for path in known) for j in range(1, len(keys))}
        for n in _walk(self._root):
            if isinstance(n, (_Cmp, _In)) and n.field not in names:
                raise FilterError(f"unknown field {_written(n.field)!r}", self.text, n.col, where=where,
                                  detail=_known_detail(known))

    def matches(self, metadata: Mapping[str, Any]) -> bool:
        """Whether a document with this metadata passes the filter (true, not unknown: the reference semantics)."""
        return _eval(self._root, metadata) is True

    def to_sql(self, column: str = "metadata") -> tuple[str, list[Any]]:
        """``(where_clause, params)`` over a SQLite JSON text column; the clause is 1, 0 or NULL per row
        (``WHERE`` keeps the rows where it is 1, which are the rows ``matches`` accepts)."""
        params: list[Any] = []
        return _sql(self._root, column, params), params

    def to_milvus(self, json_field: str = "metadata") -> str:
        """A Milvus boolean expression over a JSON field (``metadata["lang"] == "en" and ...``)."""
        return _milvus(self._root, json_field)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Filter({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Filter) and self._root == other._root

    def __hash__(self) -> int:
        return hash(self._root)


def parse_filter(text: str) -> Filter:
    """Parse a filter expression (grammar in the module docstring); ``FilterError`` shows where it fails."""
    if not isinstance(text, str):
        raise TypeError(f"filter must be a string, got {type(text).__name__}")
    return Filter(text, _Parser(text).parse())


def as_filter(value: str | Filter | None, *, where: str = "filter") -> Filter | None:
    """``None`` -> None, a string -> parsed (errors named ``where``), a ``Filter`` -> itself.

    A blank string is refused ("empty filter"), as ``--filter ""`` is: it was read as no filter, so an unset
    variable searched every document without a word. (The HTTP service reads an empty form field as none.)
    """
    if value is None or isinstance(value, Filter):
        return value
    try:
        return parse_filter(value)
    except FilterError as e:
        raise e.renamed(where) from None


def metadata_fields(metadata: Mapping[str, Any], prefix: str = "") -> set[str]:
    """The dotted paths of the leaf values of a metadata object (objects are walked, lists are leaves)."""
    out: set[str] = set()
    for key, value in metadata.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out |= metadata_fields(value, path + ".")
        else:
            out.add(path)
    return out
