"""The filter language: parsing, errors with positions, and three translations that agree.

``Filter.matches`` is the reference; ``to_sql`` is checked against it by executing the SQL on
an in-memory SQLite table over random metadata, for random filters (a seeded property test).
``to_milvus`` is checked on worked examples (it is executed against Milvus Lite by the Milvus
backend's tests).
"""

from __future__ import annotations

import json
import random
import re
import sqlite3

import pytest

from twotower.indexing.filters import (
    MAX_DEPTH,
    MAX_TERMS,
    Filter,
    FilterError,
    as_filter,
    metadata_fields,
    parse_filter,
)


def sql_matches(flt: Filter, metas: list[dict]) -> list[bool]:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE docs (n INTEGER PRIMARY KEY, metadata TEXT NOT NULL)")
    conn.executemany("INSERT INTO docs VALUES (?, ?)",  # stored as the document store does
                     [(i, json.dumps(m, ensure_ascii=False)) for i, m in enumerate(metas)])
    where, params = flt.to_sql()
    hits = {r[0] for r in conn.execute(f"SELECT n FROM docs WHERE {where}", params)}
    return [i in hits for i in range(len(metas))]


# ---------------------------------------------------------------------------- worked examples
DOCS = [
    {"lang": "en", "year": 2012, "src": {"name": "pubmed"}, "published": "2020-03-01", "ok": True},
    {"lang": "de", "year": 2009.5, "src": {"name": "arxiv"}, "published": "2019-12-31T23:00:00Z", "ok": False},
    {"lang": "en", "year": "2015", "published": "2020-01-01T08:00:00Z"},  # year stored as a string
    {"year": None, "src": "flat"},
    {},
]


WORKED = [
        ('lang == "en"', [1, 0, 1, 0, 0]),
        ("lang != 'en'", [0, 1, 0, 0, 0]),  # a missing field is unknown: no match for != either
        ('not (lang == "en")', [0, 1, 0, 0, 0]),  # ... nor for not() of it (three-valued logic)
        ("year >= 2010", [1, 0, 0, 0, 0]),  # the string "2015" is not a number
        ("not (year >= 2010)", [0, 1, 0, 0, 0]),  # ... and order across kinds is unknown
        ("year != 2012", [0, 1, 1, 0, 0]),  # equality across kinds is false: != is true; null is unknown
        ("year < 2010.0", [0, 1, 0, 0, 0]),
        ('year == "2015"', [0, 0, 1, 0, 0]),
        ('src.name in ["pubmed", "x"]', [1, 0, 0, 0, 0]),
        ('src.name not in ["pubmed"]', [0, 1, 0, 0, 0]),  # src "flat" has no name: unknown
        ('src == "flat"', [0, 0, 0, 1, 0]),
        ('src != "flat"', [1, 1, 0, 0, 0]),  # an object is present and not equal
        ("ok == true", [1, 0, 0, 0, 0]),
        ("ok != true", [0, 1, 0, 0, 0]),
        ("ok == 1", [1, 0, 0, 0, 0]),  # booleans are the numbers 1 and 0
        ("ok < 1", [0, 1, 0, 0, 0]),
        ('published >= "2020-01-01"', [1, 0, 1, 0, 0]),  # date-only literal = midnight
        ('published < "2020-01-01"', [0, 1, 0, 0, 0]),
        ('lang == "en" and year >= 2010 or lang == "de"', [1, 1, 0, 0, 0]),  # and binds tighter
        ('lang == "en" and (year >= 2010 or lang == "de")', [1, 0, 0, 0, 0]),
        ("not lang == 'en' and year < 2010", [0, 1, 0, 0, 0]),  # not binds tighter than and
        ('not (lang == "xx" or year >= 2010)', [0, 1, 0, 0, 0]),  # F or unknown = unknown
        ('not (lang == "de" and year >= 2010)', [1, 1, 1, 0, 0]),  # F and unknown = F
        ("year in []", [0, 0, 0, 0, 0]),
        ("not (year in [])", [1, 1, 1, 1, 1]),
        ('LANG == "en"', [0, 0, 0, 0, 0]),  # field names are case-sensitive...
        ('lang == "en" AND NOT ok == false', [1, 0, 0, 0, 0]),  # ... keywords are not
]


@pytest.mark.parametrize("text, expected", WORKED)
def test_worked_examples_python_and_sql(text, expected):
    flt = parse_filter(text)
    assert [flt.matches(d) for d in DOCS] == [bool(e) for e in expected]
    assert sql_matches(flt, DOCS) == [bool(e) for e in expected]


@pytest.mark.parametrize(
    "text, milvus",
    [
        ('lang == "en"', 'metadata["lang"] == "en"'),
        ("year >= 2010 and year < 2020.5", '(metadata["year"] >= 2010 and metadata["year"] < 2020.5)'),
        ('src.name in ["a", \'b\'] or ok == true',
         '((metadata["src"]["name"] == "a" or metadata["src"]["name"] == "b") or metadata["ok"] == true)'),
        ("x in []", '(exists metadata["x"] and not (exists metadata["x"]))'),
        ('not (lang != "en")', 'not (metadata["lang"] != "en")'),
        ('lang not in ["en"]', 'not (metadata["lang"] == "en")'),
        (r'title == "say \"hi\"\n"', r'metadata["title"] == "say \"hi\"\n"'),
        ('published >= "2020-01-01T00:00:00Z"', 'metadata["published"] >= "2020-01-01T00:00:00Z"'),
    ],
)
def test_to_milvus_worked_examples(text, milvus):
    assert parse_filter(text).to_milvus() == milvus
    assert parse_filter(text).to_milvus("meta") == milvus.replace("metadata[", "meta[")


def test_literals_and_fields():
    flt = parse_filter("a == -3 and b == 2.5e3 and c == 'it\\'s' and d.e.f == false")
    assert flt.fields() == {"a", "b", "c", "d.e.f"}
    assert flt.matches({"a": -3, "b": 2500, "c": "it's", "d": {"e": {"f": False}}})
    assert flt.matches({"a": -3, "b": 2500, "c": "it's", "d": {"e": {"f": 0}}})  # false is the number 0
    assert not flt.matches({"a": -3, "b": 2500, "c": "it's", "d": {"e": {"f": "false"}}})
    assert parse_filter("x == 1").matches({"x": 1.0})
    assert str(flt).startswith("a == -3")
    assert parse_filter("a == 1") == parse_filter("  a==1 ")


def test_quoted_keys_name_what_a_name_cannot():
    """Keys that are not names (``pub-date``, ``é``, ``a b``) or are keywords were stored but could not be
    filtered on; back-quoted, they run the same in Python, SQLite and Milvus."""
    docs = [{"pub-date": "2021-05-01", "in": 1, "src": {"or": "x"}, "é t": 2}, {"pub-date": "2019-01-01"}, {}]
    for text, expected in [
        ('`pub-date` >= "2020-01-01"', [1, 0, 0]),
        ("`in` == 1 and src.`or` == 'x'", [1, 0, 0]),
        ("`src`.`or` in ['x']", [1, 0, 0]),
        ("`é t` > 1", [1, 0, 0]),
        ("not (`pub-date` < '2020')", [1, 0, 0]),
    ]:
        flt = parse_filter(text)
        assert [flt.matches(d) for d in docs] == [bool(e) for e in expected], text
        assert sql_matches(flt, docs) == [bool(e) for e in expected], text
    flt = parse_filter("src.`or` == 'x' and `pub-date` != '' and `year` == 1")
    assert flt.fields() == {"src.or", "pub-date", "year"}
    assert flt.to_milvus() == '(metadata["src"]["or"] == "x" and metadata["pub-date"] != "" and metadata["year"] == 1)'
    assert parse_filter("`year` == 1") == parse_filter("year == 1")


def test_names_in_any_script_need_no_quotes():
    """`城市 == "北京"` said "unexpected character '城'" (names were ASCII), with no word of back-quotes."""
    docs = [{"城市": "北京", "année": 2001, "ключ": {"под": 1}}, {"城市": "上海", "année": 1999}, {}]
    for text, expected in [('城市 == "北京"', [1, 0, 0]), ("année > 2000 or 城市 == '上海'", [1, 1, 0]),
                           ("ключ.под == 1", [1, 0, 0]), ("_x1 == 1", [0, 0, 0])]:
        flt = parse_filter(text)
        assert [flt.matches(d) for d in docs] == [bool(e) for e in expected], text
        assert sql_matches(flt, docs) == [bool(e) for e in expected], text
    assert parse_filter("城市 == 1") == parse_filter("`城市` == 1")
    assert parse_filter("ключ.под == 1").to_milvus() == 'metadata["ключ"]["под"] == 1'
    assert parse_filter("année == 1").fields() == {"année"}


def test_metadata_fields_are_leaf_paths():
    assert metadata_fields({"a": 1, "b": {"c": "x", "d": {"e": [1]}}, "f": {}}) == {"a", "b.c", "b.d.e", "f"}


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "text, problem, column",
    [
        ("year >= 2010 )", "unexpected ')'", 14),
        ("", "empty filter", 1),
        ("year >=", "expected a value after '>='", 8),
        ("year", "expected an operator", 5),
        ("lang = 'en'", "use '=='", 6),
        ("lang == en", "got field name 'en'", 9),
        ("(year >= 1", "expected ')' to close the '(' at column 1", 11),
        ("lang == 'en", "unterminated string", 9),
        ("x in 1", "expected '[' after 'in'", 6),
        ("x in [1 2]", "expected ',' or ']'", 9),
        ("x < true", "'<' needs a number, a string or a date", 5),
        ("d >= '2020-02-30'", "invalid date", 6),
        ("x == 99999999999999999999", "out of the 64-bit range", 6),
        ("a == 1 && b == 2", "write 'and'", 8),
        ("a == 1 and", "expected a condition", 11),
        ("a == 1 $", "unexpected character '$'", 8),
        ("in == 1", "expected a field name, got 'in'", 1),
        ("x == 'a\\q'", "unknown escape", 8),
        ("src.in == 1", "'in' is a keyword and cannot be part of a field name (quote it: `in`)", 5),
        ("pub-date == 1", "unexpected character '-'", 4),
        ("year >= ２００６", "unexpected character '２'", 9),  # numbers are ASCII digits; it read 2006
        ("1abc == 1", "malformed number '1a'", 1),
        ("`pub-date == 1", "unterminated `quoted` field name", 1),
        ("`` == 1", "empty `quoted` field name", 1),
        ('`a"b` == 1', "a filter cannot name a key holding '\"'", 3),
        ("`a.b` == 1", "a filter cannot name a key holding '.'", 3),
        ("a.`b`c == 1", "malformed field name", 1),
        ("a. == 1", "malformed field name 'a. '", 1),
    ],
)
def test_errors_name_problem_and_column(text, problem, column):
    with pytest.raises(FilterError) as info:
        parse_filter(text)
    e = info.value
    assert problem in e.problem and e.column == column
    first, caret = str(e).split("\n")
    assert first.startswith(f"filter: {e.problem} at column {column}: ")
    # the caret sits under the column in the excerpt
    assert caret.index("^") == len(first) - len(text) + column - 1


def test_error_message_format_and_rename():
    with pytest.raises(FilterError) as info:
        parse_filter("year >= 2010 )")
    assert str(info.value).split("\n")[0] == "filter: unexpected ')' at column 14: year >= 2010 )"
    assert str(info.value.renamed("--filter")).startswith("--filter: unexpected ')' at column 14")
    with pytest.raises(FilterError, match="^--filter: "):
        as_filter("a ==", where="--filter")


def test_long_filter_error_shows_a_window_around_the_column():
    text = " or ".join(f"f{i} == {i}" for i in range(40)) + " )"
    with pytest.raises(FilterError) as info:
        parse_filter(text)
    first, caret = str(info.value).split("\n")
    assert first.endswith("...") is False and "..." in first and len(first) < 140
    assert first[caret.index("^")] == ")"


def test_unknown_field_names_field_and_known_fields():
    flt = parse_filter('lang == "en" and yeer >= 2010')
    flt.check_fields({"lang", "yeer", "x"})
    with pytest.raises(FilterError) as info:
        flt.check_fields({"lang", "year"})
    e = info.value
    assert e.column == 18 and "unknown field 'yeer'" in str(e) and "known fields: lang, year" in str(e)
    with pytest.raises(FilterError, match="no document in the index has metadata"):
        flt.check_fields(set())
    with pytest.raises(FilterError) as info:  # known fields are listed as a filter writes them
        parse_filter("`pub date` == 1").check_fields({"pub-date", "src.in", "lang"})
    assert "unknown field '`pub date`'" in str(info.value)
    assert "known fields: lang, `pub-date`, src.`in`" in str(info.value)


def test_an_object_valued_field_is_a_known_field():
    """`src != "x"` was refused as an unknown field although every document had `src` (an object): the known
    fields are leaf paths, and an object holding one of them is known too (`!=` is true of it, as documented)."""
    metas = [{"src": {"n": 1, "name": "a"}, "lang": "en"}, {"src": {"n": 2}}, {"lang": "fr"}]
    known = set().union(*map(metadata_fields, metas))
    assert known == {"src.n", "src.name", "lang"}
    for text, expected in [('src != "x"', [True, True, False]), ('src == "x"', [False, False, False])]:
        flt = parse_filter(text)
        flt.check_fields(known)
        assert [flt.matches(m) for m in metas] == expected == sql_matches(flt, metas), text
    parse_filter("a.b == 1").check_fields({"a.b.c"})
    for field in ("a", "b", "c", "c.d"):  # every known path's objects, whatever the set's order
        parse_filter(f"{field} != 1").check_fields({"a.x", "b.y", "c.d.e", "lang"})
    with pytest.raises(FilterError, match="unknown field 'sr'"):
        parse_filter("sr == 1").check_fields(known)
    with pytest.raises(FilterError, match="unknown field 'src.na'"):
        parse_filter("src.na == 1").check_fields(known)


def test_known_fields_a_filter_cannot_name_are_counted_not_listed():
    """A key holding a back-quote was listed as ``x` `` (a spelling the parser refuses: a quoted key cannot
    escape it); such fields are now counted apart, saying why."""
    with pytest.raises(FilterError) as info:
        parse_filter("y == 1").check_fields({"x`", "lang", 'a"b.c', "ok"})
    detail = str(info.value).split("\n")[0]
    assert "known fields: lang, ok; 2 more whose keys hold a back-quote, a double quote, a backslash or a " \
           "control character, which a filter cannot name, even back-quoted" in detail
    assert "`x``" not in detail
    with pytest.raises(FilterError, match=r"known fields: none a filter can name: 1 whose keys hold"):
        parse_filter("y == 1").check_fields({"x`"})


def test_as_filter():
    assert as_filter(None) is None
    for blank in ("", "   "):  # refused as `--filter ""` is: an unset variable searched every document
        with pytest.raises(FilterError, match=r"^filter: empty filter \(leave it out to search without one\)"):
            as_filter(blank)
    f = parse_filter("a == 1")
    assert as_filter(f) is f and as_filter("a == 1") == f
    with pytest.raises(TypeError):
        parse_filter(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- size limits
def _deepest(depth: int) -> str:
    """A filter `depth` levels deep that alternates `not`, `or` and `and` (the SQL nests deepest this way)."""
    text = "year == 4"
    for i in range(depth):
        text = f"not {text}" if i % 3 == 0 else f"(lang == 'en' {'or' if i % 3 == 1 else 'and'} {text})"
    return text


def test_filters_at_the_size_limits_run_in_sqlite_as_in_python():
    """What the limits let through, SQLite runs with the reference semantics. Before the limits, 999 `or`s or
    an `in` list of 999 values broke SQLite's depth limit, 45 nested `not`s its parser stack, and 400
    parentheses Python's recursion: a 500 from the service."""
    metas = [{"year": y, "lang": lang} for y in range(-3, 1200, 7) for lang in ("en", "de")] + [{}, {"year": None}]
    for text in (
        _deepest(MAX_DEPTH),
        "not " * MAX_DEPTH + "year == 4",
        "(" * MAX_DEPTH + "year == 4" + ")" * MAX_DEPTH,
        " or ".join(f"year == {i}" for i in range(MAX_TERMS)),
        " and ".join(f"year != {i}" for i in range(MAX_TERMS)),
        f"year in [{', '.join(str(i) for i in range(MAX_TERMS - 2))}, 'en', true]",
        f"year not in [{', '.join(str(i) for i in range(0, 2 * MAX_TERMS, 2))}]",
    ):
        flt = parse_filter(text)
        expected = [flt.matches(m) for m in metas]
        assert sql_matches(flt, metas) == expected, text[:60]
        assert 0 < sum(expected) < len(metas), text[:60]


@pytest.mark.parametrize("text, problem, column", [
    ("not " * (MAX_DEPTH + 1) + "year == 1", f"nested more than {MAX_DEPTH} levels", 4 * MAX_DEPTH + 1),
    ("(" * (MAX_DEPTH + 1) + "year == 1" + ")" * (MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} levels",
     MAX_DEPTH + 1),
    ("(" * 400 + "year == 1" + ")" * 400, "nested more than", MAX_DEPTH + 1),
    (" or ".join(f"year == {i}" for i in range(MAX_TERMS + 1)), f"more than {MAX_TERMS} comparisons",
     len(" or ".join(f"year == {i}" for i in range(MAX_TERMS))) + 5),
    ("lang == 'en' and year in [" + ", ".join(map(str, range(MAX_TERMS))) + "]", f"more than {MAX_TERMS}", 18),
    ('lang == "a\ud800"', "lone surrogate", 11),
])
def test_filters_beyond_the_limits_are_refused_where_they_cross(text, problem, column):
    if "\\ud800" in text:
        text = text.replace("\\ud800", "\ud800")
    with pytest.raises(FilterError) as info:
        parse_filter(text)
    assert problem in info.value.problem and info.value.column == column


# ---------------------------------------------------------------------------- property: matches == SQL
FIELDS = ["lang", "year", "score", "src.name", "src.rank", "flag", "date", "tags",
          "pub-date", "é t", "src.in"]  # keys a filter names back-quoted


def field_text(path: str) -> str:
    return ".".join(p if re.fullmatch(r"[a-z_]+", p) and p not in ("in", "not", "and", "or") else f"`{p}`"
                    for p in path.split("."))
STRINGS = ["en", "de", "fr", "", "é", "EN", "a'b", 'q"x']
DATES = ["2019-12-31", "2020-01-01", "2020-06-15", "2020-01-01T08:00:00Z", "2021-03-04T00:00:00Z"]


def random_value(rng: random.Random):
    r = rng.random()
    if r < 0.25:
        return rng.randint(-3, 3)
    if r < 0.35:
        return rng.choice([0.5, -1.5, 2.0, 1e10])
    if r < 0.55:
        return rng.choice(STRINGS)
    if r < 0.7:
        return rng.choice(DATES)
    if r < 0.8:
        return rng.random() < 0.5
    if r < 0.87:
        return None
    if r < 0.93:
        return [rng.randint(0, 2)]
    return {"k": 1}


def random_metadata(rng: random.Random) -> dict:
    md: dict = {}
    for f in FIELDS:
        if rng.random() < 0.35:
            continue
        head, _, tail = f.partition(".")
        if tail:
            if not isinstance(md.get(head, {}), dict):
                continue
            if rng.random() < 0.1:
                md[head] = rng.choice(["flat", 3])
                continue
            md.setdefault(head, {})[tail] = random_value(rng)
        else:
            md[f] = random_value(rng)
    return md


def literal_text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v) if "'" in v or v == "" else repr(v)  # both quote styles
    return repr(v)


def random_filter(rng: random.Random, depth: int = 0) -> str:
    r = rng.random()
    if depth < 3 and r < 0.3:
        op = rng.choice([" and ", " or ", " AND "])
        return "(" + op.join(random_filter(rng, depth + 1) for _ in range(rng.randint(2, 3))) + ")"
    if depth < 3 and r < 0.4:
        return "not " + random_filter(rng, depth + 1)
    field = field_text(rng.choice(FIELDS))
    if rng.random() < 0.2:
        vals = [random_value(rng) for _ in range(rng.randint(0, 3))]
        vals = [v for v in vals if isinstance(v, (int, float, str))]
        return f"{field} {rng.choice(['in', 'not in'])} [{', '.join(literal_text(v) for v in vals)}]"
    v = random_value(rng)
    while not isinstance(v, (int, float, str)):
        v = random_value(rng)
    ops = ["==", "!="] if isinstance(v, bool) else ["==", "!=", "<", "<=", ">", ">="]
    return f"{field} {rng.choice(ops)} {literal_text(v)}"


def test_property_matches_agrees_with_sql():
    rng = random.Random(1234)
    metas = [random_metadata(rng) for _ in range(300)]
    nonempty = 0
    for _ in range(300):
        text = random_filter(rng)
        flt = parse_filter(text)
        expected = [flt.matches(m) for m in metas]
        assert sql_matches(flt, metas) == expected, text
        nonempty += 0 < sum(expected) < len(metas)
        # the Milvus expression is stable under reparsing the text (same tree, same string)
        assert parse_filter(str(flt)).to_milvus() == flt.to_milvus()
    assert nonempty > 100  # the property was exercised on filters that split the documents


def test_property_to_milvus_agrees_with_matches_in_milvus_lite(tmp_path):
    """The same random filters and metadata, run as Milvus expressions by Milvus Lite (in-process)."""
    pymilvus = pytest.importorskip("pymilvus")
    pytest.importorskip("milvus_lite")
    client = pymilvus.MilvusClient(str(tmp_path / "filters.db"))
    schema = client.create_schema(auto_id=False)
    schema.add_field("pk", pymilvus.DataType.INT64, is_primary=True)
    schema.add_field("v", pymilvus.DataType.FLOAT_VECTOR, dim=2)
    schema.add_field("metadata", pymilvus.DataType.JSON)
    index = client.prepare_index_params()
    index.add_index("v", index_type="FLAT", metric_type="IP")
    client.create_collection("f", schema=schema, index_params=index)
    rng = random.Random(99)
    metas = DOCS + [random_metadata(rng) for _ in range(200)]
    client.insert("f", [{"pk": i, "v": [1.0, 0.0], "metadata": m} for i, m in enumerate(metas)])
    client.load_collection("f")
    texts = [t for t, _ in WORKED] + [random_filter(rng) for _ in range(120)]
    texts += [_deepest(MAX_DEPTH), f"year in [{', '.join(str(i) for i in range(MAX_TERMS))}]"]  # the limits
    try:
        for text in texts:
            flt = parse_filter(text)
            rows = client.query("f", filter=flt.to_milvus(), output_fields=["pk"], limit=len(metas))
            assert sorted(r["pk"] for r in rows) == [i for i, m in enumerate(metas) if flt.matches(m)], text
    finally:
        client.close()
