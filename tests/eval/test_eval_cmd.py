"""`twotower eval`, run in-process through twotower.cli.main."""

from __future__ import annotations

import json
import shutil
import sys
import types

import numpy as np
import pytest

from tests.common.out_fixtures import adding_a_file
from twotower.cli import main
from twotower.eval import (
    evaluate,
    read_trec_run,
    write_beir_qrels,
    write_beir_queries,
    write_trec_qrels,
    write_trec_run,
)
from twotower.indexing import Manifest


@pytest.fixture
def files(tmp_path):
    qrels = {"1": {"a": 2, "b": 1}, "2": {"c": 1}, "3": {"z": 1}}
    run = {"1": {"b": 3.0, "a": 1.0, "x": 2.0}, "2": {"c": 1.0, "2": 9.0}, "99": {"a": 1.0}}
    write_trec_run(run, tmp_path / "run.trec")
    write_beir_qrels(qrels, tmp_path / "qrels.tsv")
    write_trec_qrels(qrels, tmp_path / "qrels.trec")
    return tmp_path, run, qrels


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_keys_and_values(files, capsys):
    tmp, run, qrels = files
    metrics = "NDCG@10,mrr@10,recall@100,map,p@1,rprec"
    out = _json(
        capsys,
        [
            "eval",
            "--run",
            str(tmp / "run.trec"),
            "--qrels",
            str(tmp / "qrels.tsv"),
            "--metrics",
            metrics,
            "--json",
        ],
    )
    expected = evaluate(run, qrels, metrics)
    for label in metrics.split(","):
        assert out[label] == pytest.approx(expected.means[label])
    assert out["num_queries"] == 3 and out["skipped_unjudged"] == 1 and out["missing_from_run"] == 1
    assert out["drop_self_hits"] is False
    assert list(out["per_query"]) == ["1", "2", "3"]
    for qid, values in expected.per_query.items():
        assert out["per_query"][qid] == pytest.approx(values)
    assert out["mrr@10"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)


def test_trec_qrels_give_the_same_numbers(files, capsys):
    tmp, _, _ = files
    args = ["eval", "--run", str(tmp / "run.trec"), "--json"]
    beir = _json(capsys, [*args, "--qrels", str(tmp / "qrels.tsv")])
    trec = _json(capsys, [*args, "--qrels", str(tmp / "qrels.trec")])
    assert beir == trec


def test_drop_self_hits_flag(files, capsys):
    tmp, _, _ = files
    args = [
        "eval",
        "--run",
        str(tmp / "run.trec"),
        "--qrels",
        str(tmp / "qrels.tsv"),
        "--metrics",
        "mrr@10",
        "--json",
    ]
    kept = _json(capsys, args)
    dropped = _json(capsys, [*args, "--drop-self-hits"])
    assert kept["per_query"]["2"]["mrr@10"] == 0.5  # document "2" is first for query "2"
    assert dropped["per_query"]["2"]["mrr@10"] == 1.0 and dropped["drop_self_hits"] is True


def test_table_output_and_per_query(files, capsys):
    tmp, _, _ = files
    assert (
        main(["eval", "--run", str(tmp / "run.trec"), "--qrels", str(tmp / "qrels.tsv"), "--per-query"]) == 0
    )
    text = capsys.readouterr().out
    for label in ("ndcg@10", "mrr@10", "recall@100", "map"):
        assert label in text
    assert "3 judged (1 absent from the run, scored 0)" in text and "drop_self_hits=off" in text
    assert any(line.split()[0] == "3" for line in text.splitlines() if line.strip())


def test_out_writes_a_report(files, capsys):
    tmp, _, _ = files
    assert (
        main(
            [
                "eval",
                "--run",
                str(tmp / "run.trec"),
                "--qrels",
                str(tmp / "qrels.tsv"),
                "--out",
                str(tmp / "rep"),
            ]
        )
        == 0
    )
    assert (tmp / "rep" / "report.md").is_file() and (tmp / "rep" / "recall_at_k.png").is_file()
    assert (tmp / "rep" / "runs" / "run.trec").is_file()


def test_out_is_new_empty_or_an_earlier_report_and_never_an_input(files, capsys):
    """--out: a file there was a traceback; a directory of other files took the report beside them; a run under
    OUT/runs/ was rewritten with another tag; an earlier report's other runs lingered beside the new one."""
    tmp, _, _ = files
    args = ["eval", "--run", str(tmp / "run.trec"), "--qrels", str(tmp / "qrels.tsv"), "--out"]
    (tmp / "afile").write_text("mine\n")
    for out, words in [(tmp / "afile", "a file; give a directory"), (tmp / "afile" / "rep", "is a file, not a"),
                       (tmp, "holds the input --run")]:
        assert main([*args, str(out)]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("x")
    assert main([*args, str(tmp / "mine")]) == 2
    assert "holding other files (notes.txt), not an earlier report" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp / "mine").iterdir()) == ["notes.txt"]
    shutil.copy(tmp / "run.trec", tmp / "old.trec")
    assert main(["eval", "--run", str(tmp / "old.trec"), "--qrels", str(tmp / "qrels.tsv"), "--out",
                 str(tmp / "rep")]) == 0
    assert main([*args, str(tmp / "rep")]) == 0  # an earlier report is replaced whole
    assert sorted(p.name for p in (tmp / "rep" / "runs").iterdir()) == ["run.trec"]
    before = (tmp / "rep" / "runs" / "run.trec").read_bytes()
    assert main(["eval", "--run", str(tmp / "rep" / "runs" / "run.trec"), "--qrels", str(tmp / "qrels.tsv"),
                 "--out", str(tmp / "rep")]) == 2
    assert "holds the input --run" in capsys.readouterr().err
    assert (tmp / "rep" / "runs" / "run.trec").read_bytes() == before


def test_out_names_a_system_after_any_run_file_name(files, capsys):
    """The system's name comes from the run's file name; `_x.txt` and `ü.txt` were refused in internal words."""
    tmp, _, _ = files
    for stem, name in (("_x", "x"), ("ü", "run"), ("a b", "a_b")):
        run = tmp / f"{stem}.txt"
        run.write_bytes((tmp / "run.trec").read_bytes())
        assert main(["eval", "--run", str(run), "--qrels", str(tmp / "qrels.tsv"), "--out", str(tmp / f"o{name}")]) == 0
        assert (tmp / f"o{name}" / "runs" / f"{name}.trec").is_file()
        capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval"], "nothing to do"),
        (["eval", "--run", "RUN"], "--run needs --qrels"),
        (["eval", "--run", "RUN", "--index", "IDX"], "not both"),
        (["eval", "--index", "IDX"], "--index needs --dataset and --out"),
        (["eval", "--run", "RUN", "--qrels", "QRELS", "--metrics", "ndcg@10,bleu"], "--metrics: unknown metric 'bleu'"),
        (["eval", "--run", "RUN", "--qrels", "QRELS", "--metrics", ""], "--metrics: no metric given"),  # was the default
        (["eval", "--run", "missing.trec", "--qrels", "QRELS"], "missing.trec"),
        (["eval", "--run", "TMP", "--qrels", "QRELS"], "--run TMP: a directory, not a file"),  # was "no such file"
        # the --index mode's flags with --run were ignored: the numbers looked like a reranked/hybrid run's
        (["eval", "--run", "RUN", "--qrels", "QRELS", "--hybrid"], "--hybrid sets how --index searches"),
        (["eval", "--run", "RUN", "--qrels", "QRELS", "--reranker", "default", "-k", "5", "--split", "test"],
         "--split, --reranker, -k set how --index searches; --run scores a run that is already made"),
        (["eval", "--run", "RUN", "--qrels", "QRELS", "--dataset", "D", "--batch-size", "8"],
         "--dataset, --batch-size set"),
        (["eval", "--index", "IDX", "--dataset", "D", "--out", "O", "--qrels", "QRELS"], "--qrels goes with --run"),
        (["eval", "--run", "RUN", "--qrels", "QRELS", "--rerank-alpha", "0"], "--rerank-alpha sets how --index"),
    ],
)
def test_bad_input_exits_2_with_a_message(files, capsys, argv, message):
    tmp, _, _ = files
    argv = [a.replace("RUN", str(tmp / "run.trec")).replace("QRELS", str(tmp / "qrels.tsv")).replace("TMP", str(tmp))
            for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("twotower eval: error: ") and message.replace("TMP", str(tmp)) in err, err


def test_malformed_run_names_file_and_line(tmp_path, files, capsys):
    tmp, _, _ = files
    bad = tmp_path / "bad.trec"
    bad.write_text("1 Q0 a 1 1.0 t\n1 Q0 b 2\n")
    assert main(["eval", "--run", str(bad), "--qrels", str(tmp / "qrels.tsv")]) == 2
    assert f"{bad}:2: expected 6 columns" in capsys.readouterr().err
    # an empty run scored every query 0 without a word; qrels with only a header said "the qrels hold no query"
    empty = tmp_path / "empty.trec"
    empty.write_text("")
    assert main(["eval", "--run", str(empty), "--qrels", str(tmp / "qrels.tsv")]) == 2
    assert f"--run {empty}: no results (the file is empty)" in capsys.readouterr().err
    header = tmp_path / "header.tsv"
    header.write_text("query-id\tcorpus-id\tscore\n")
    assert main(["eval", "--run", str(tmp / "run.trec"), "--qrels", str(header)]) == 2
    assert f"--qrels {header}: no judgments" in capsys.readouterr().err


# --- --index mode with a stand-in pipeline ------------------------------------------------------


class _Hit:
    def __init__(self, doc_id, score):
        self.id, self.score = doc_id, score  # retrieval.hit.Hit names the document id `id`


class _FakePipeline:
    """Scores documents by a fixed table; the reranker puts the relevant document first."""

    calls: list = []

    def __init__(self, reranker):
        self.reranker = reranker
        self.closed = False

    @classmethod
    def load(cls, directory, model=None, reranker=None, *, use_default_reranker=True):
        cls.calls.append(("load", directory, reranker, use_default_reranker))
        cls.instance = cls(reranker)
        return cls.instance

    def rerank_alpha(self, override=None, hybrid=False, *, bm25=False):
        return 1.0 if override is None else override

    def rerank_alpha_chosen_over(self, hybrid=False, *, bm25=False):
        return None

    def contains(self, ids):
        return [i not in self.absent for i in ids]

    absent: set = set()  # document ids the stand-in index lacks
    size: int | None = None  # documents in the stand-in index (None: as many as -k asks for)

    def info(self):  # as SearchPipeline.info: the manifest's pipeline block under "extra"
        encoder = {"fingerprint": "0123456789abcdef", "dim": 4, "model": {"path": "/models/enc"}}
        return {"generation": 3, "documents": 11, "extra": {"pipeline": {"format": 1, "encoder": encoder}}}

    def search(self, queries, k=10, recall_k=100, rerank=True, hybrid=False, *, rerank_k=None, rerank_alpha=None,
               fetch_documents=True, progress=False, bm25=False):
        self.calls.append(("search", len(queries), k, recall_k, rerank, hybrid, fetch_documents))
        out = []
        for q in queries:
            target = "d" + q.split()[-1]  # query "find 3" -> relevant doc "d3"
            docs = [f"d{i}" for i in range(k if self.size is None else min(k, self.size))]
            scores = {d: 1.0 / (i + 1) for i, d in enumerate(docs)}
            if rerank:
                scores[target] = 10.0
            elif hybrid:
                scores[target] = 0.75
            out.append([_Hit(d, s) for d, s in sorted(scores.items(), key=lambda kv: -kv[1])[:k]])
        return out

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def beir_dir(tmp_path):
    root = tmp_path / "beir"
    queries = {str(i): f"find {i + 3}" for i in range(7)}
    write_beir_queries({**queries, "extra": "not judged"}, root / "queries.jsonl")
    (root / "corpus.jsonl").write_text('{"_id": "d0", "text": "x"}\n')
    write_beir_qrels({str(i): {f"d{i + 3}": 1} for i in range(7)}, root / "qrels" / "test.tsv")
    return root


def _use_fake_pipeline(monkeypatch) -> None:
    """`_FakePipeline` as ``twotower.retrieval.pipeline`` for the test, with no calls yet: eval's --index mode
    without a model."""
    module = types.ModuleType("twotower.retrieval.pipeline")
    module.SearchPipeline = _FakePipeline
    monkeypatch.setitem(sys.modules, "twotower.retrieval.pipeline", module)
    monkeypatch.setattr(_FakePipeline, "calls", [])


def test_index_mode_writes_a_comparison_report(tmp_path, beir_dir, monkeypatch, capsys):
    _use_fake_pipeline(monkeypatch)
    (tmp_path / "idx").mkdir()
    Manifest(dim=4, metric="ip", factory="Flat", bm25={}).write(tmp_path / "idx" / "manifest.json")  # has BM25
    ce = tmp_path / "ce"
    ce.mkdir()
    (ce / "config.json").write_text("{}")  # the CLI checks that --reranker names a model directory
    argv = [
        "eval",
        "--index",
        str(tmp_path / "idx"),
        "--dataset",
        str(beir_dir),
        "--reranker",
        str(ce),
        "--hybrid",
        "--out",
        str(tmp_path / "rep"),
        "--batch-size",
        "3",
        "-k",
        "20",
        "--no-progress",
        "--json",
    ]
    empty = tmp_path / "beir-empty"  # a judged query with no text: "query 0 is empty", naming no file or id
    shutil.copytree(beir_dir, empty)
    write_beir_queries({str(i): ("" if i == 2 else f"find {i + 3}") for i in range(7)}, empty / "queries.jsonl")
    bad = [*argv[:argv.index("--dataset") + 1], str(empty), *argv[argv.index("--dataset") + 2:]]
    assert main(bad) == 2 and f"error: {empty / 'queries.jsonl'}:3: query '2' is empty\n" in capsys.readouterr().err
    for inside in ("idx", "idx/rep"):  # the report went into the index (before the search: refused first)
        bad = [*argv[:argv.index("--out") + 1], str(tmp_path / inside), *argv[argv.index("--out") + 2:]]
        assert main(bad) == 2 and "inside --index" in capsys.readouterr().err and not _FakePipeline.calls
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == ["manifest.json"]
    assert not _FakePipeline.calls
    assert main(argv) == 0
    means = json.loads(capsys.readouterr().out)
    assert list(means) == ["dense", "hybrid", "hybrid+rerank"]
    assert means["hybrid+rerank"]["mrr@10"] == 1.0
    assert means["hybrid"]["mrr@10"] == 0.5  # 0.75 ranks second after d0 (score 1.0)
    assert means["dense"]["mrr@10"] == pytest.approx(np.mean([1 / (i + 4) for i in range(7)]))
    assert _FakePipeline.calls[0] == ("load", str(tmp_path / "idx"), str(ce), False)
    searches = [c for c in _FakePipeline.calls if c[0] == "search"]
    assert [c[1] for c in searches] == [3, 3, 1] * 3  # 7 judged queries in batches of 3, per system
    assert all(c[2:4] == (20, 100) and c[6] is False for c in searches)
    assert _FakePipeline.instance.closed
    report = json.loads((tmp_path / "rep" / "metrics.json").read_text())
    assert report["settings"]["split"] == "test" and report["settings"]["reranker"] == str(ce)
    assert set(report["significance"]) == {"hybrid", "hybrid+rerank"}
    assert read_trec_run(tmp_path / "rep" / "runs" / "dense.trec")["0"]["d3"] == pytest.approx(1 / 4)


def test_index_mode_without_reranker_does_not_load_the_default_one(tmp_path, beir_dir, monkeypatch, capsys):
    _use_fake_pipeline(monkeypatch)
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "manifest.json").write_text("{}")  # --index is checked to be an index; the fake loads it
    argv = [
        "eval",
        "--index",
        str(tmp_path / "idx"),
        "--dataset",
        str(beir_dir),
        "--out",
        str(tmp_path / "r"),
        "--no-progress",
    ]
    assert main(argv) == 0
    assert _FakePipeline.calls[0][2:] == (None, False)
    assert "== dense" in capsys.readouterr().out


def test_index_mode_checks_paths_first(tmp_path, beir_dir, capsys):
    argv = [
        "eval",
        "--index",
        str(tmp_path / "nope"),
        "--dataset",
        str(beir_dir),
        "--out",
        str(tmp_path / "r"),
    ]
    assert main(argv) == 2
    assert f"--index {tmp_path / 'nope'}: no such directory\n" in capsys.readouterr().err
    argv = [
        "eval",
        "--index",
        str(tmp_path),
        "--dataset",
        str(beir_dir),
        "--split",
        "dev",
        "--out",
        str(tmp_path / "r"),
    ]
    assert main(argv) == 2
    assert "splits found: test" in capsys.readouterr().err


def test_out_holding_a_report_name_beside_other_files_is_refused_and_kept(files, capsys):
    """A report.md of the user's beside their code made --out "an earlier report", and the code went with it."""
    tmp, _, _ = files
    out = tmp / "proj"
    (out / "code").mkdir(parents=True)
    (out / "report.md").write_text("# my notes\n")
    (out / "important.txt").write_text("important\n")
    (out / "code" / "main.py").write_text("print(1)\n")
    args = ["eval", "--run", str(tmp / "run.trec"), "--qrels", str(tmp / "qrels.tsv"), "--out"]
    assert main([*args, str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: a directory holding other files (code, important.txt, report.md), not an earlier " \
           "report" in err
    assert sorted(p.name for p in out.rglob("*")) == ["code", "important.txt", "main.py", "report.md"]
    assert main([*args, str(tmp / "rep")]) == 0  # a report's own directory is replaced: nothing else is there
    (tmp / "rep" / "runs" / "notes.txt").write_text("mine\n")
    assert main([*args, str(tmp / "rep")]) == 2
    assert "(runs/notes.txt)" in capsys.readouterr().err and (tmp / "rep" / "runs" / "notes.txt").is_file()
    (tmp / "rep" / "runs" / "notes.txt").unlink()
    assert main([*args, str(tmp / "rep")]) == 0


def test_out_holding_a_report_md_and_runs_of_the_users_is_no_earlier_report(files, capsys):
    """A report.md of notes beside the user's own runs/*.trec passed for an earlier report, and both were
    deleted: only a metrics.json that lists the systems whose runs runs/ holds marks one."""
    tmp, _, _ = files
    out = tmp / "exp"
    (out / "runs").mkdir(parents=True)
    (out / "report.md").write_text("# notes\n")
    shutil.copy(tmp / "run.trec", out / "runs" / "bm25-tuned.trec")
    args = ["eval", "--run", str(tmp / "run.trec"), "--qrels", str(tmp / "qrels.tsv"), "--out", str(out)]
    assert main(args) == 2
    assert f"--out {out}: a directory holding other files (report.md, runs), not an earlier report" in (
        capsys.readouterr().err)
    (out / "metrics.json").write_text('{"systems": {"other": {}}}\n')  # it lists another system's run
    assert main(args) == 2
    assert "not an earlier report" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == ["bm25-tuned.trec", "metrics.json", "report.md", "runs"]


def test_out_an_earlier_report_the_user_added_files_to_says_so(files, capsys):
    """An earlier report with the user's runs/notes.txt (or a .DS_Store) was called "a directory holding other
    files ... not an earlier report"; it is one, and the files are theirs to move out."""
    tmp, _, _ = files
    args = ["eval", "--run", str(tmp / "run.trec"), "--qrels", str(tmp / "qrels.tsv"), "--out", str(tmp / "rep")]
    assert main(args) == 0
    (tmp / "rep" / "runs" / "notes.txt").write_text("mine\n")
    (tmp / "rep" / ".DS_Store").write_text("finder\n")
    assert main(args) == 2
    assert (f"--out {tmp / 'rep'}: an earlier report and files of yours (.DS_Store, runs/notes.txt), which the "
            "new report would replace whole: move them out, or give another --out") in capsys.readouterr().err
    assert (tmp / "rep" / "runs" / "notes.txt").is_file() and (tmp / "rep" / ".DS_Store").is_file()


def test_out_is_checked_again_just_before_the_report_replaces_it(files, capsys, monkeypatch):
    """--out was checked before the (possibly long) search only: a file the user put there meanwhile went
    with the earlier report when it was replaced."""
    import twotower.eval.report as report

    tmp, _, _ = files
    args = ["eval", "--run", str(tmp / "run.trec"), "--qrels", str(tmp / "qrels.tsv"), "--out", str(tmp / "rep")]
    assert main(args) == 0
    monkeypatch.setattr(report, "write_report", adding_a_file(report.write_report, tmp / "rep" / "later.txt"))
    assert main(args) == 2
    assert "an earlier report and files of yours (later.txt)" in capsys.readouterr().err
    assert (tmp / "rep" / "later.txt").read_text() == "mine\n" and (tmp / "rep" / "metrics.json").is_file()
    assert not [p for p in tmp.iterdir() if ".tmp-" in p.name]  # the new report's staging directory is gone


def test_out_the_current_directory_is_refused_before_any_work(files, capsys, monkeypatch):
    """``--out .`` was a traceback (EBUSY) after the report was written; its swap would also leave the shell in
    the removed directory."""
    tmp, _, _ = files
    (tmp / "empty").mkdir()
    (tmp / "here" / "below").mkdir(parents=True)
    args = ["eval", "--run", str(tmp / "run.trec"), "--qrels", str(tmp / "qrels.tsv"), "--out"]
    monkeypatch.chdir(tmp / "empty")
    assert main([*args, "."]) == 2
    err = capsys.readouterr().err
    assert "--out .: the current directory; the report replaces its directory whole" in err and "Traceback" not in err
    monkeypatch.chdir(tmp / "here" / "below")
    assert main([*args, ".."]) == 2 and "--out ..: one above the current directory" in capsys.readouterr().err
    assert not any((tmp / "empty").iterdir()) and not any((tmp / "here").rglob("*.trec"))


def test_cutoffs_deeper_than_the_run_are_warned_once_and_noted_in_the_report(files, capsys):
    """A run of 3 documents a query reported recall@100 (really recall@3) without a word; the numbers stay."""
    tmp, run, qrels = files
    argv = ["eval", "--run", str(tmp / "run.trec"), "--qrels", str(tmp / "qrels.tsv"), "--json"]
    assert main([*argv, "--metrics", "map,p@3,recall@100,ndcg@10", "--out", str(tmp / "rep")]) == 0
    captured = capsys.readouterr()
    note = ("recall@100, ndcg@10 cut deeper than the deepest list of the run (3 documents): they count only those; "
            "search deeper to score them in full (twotower search -k 100)")
    assert captured.err.count("warning:") == 1 and f"twotower eval: warning: {note}\n" in captured.err
    assert json.loads(captured.out)["recall@100"] == pytest.approx(evaluate(run, qrels, ["recall@100"]).means[
        "recall@100"])
    assert f"- cutoffs deeper than the run: {note}" in (tmp / "rep" / "report.md").read_text()
    assert json.loads((tmp / "rep" / "metrics.json").read_text())["settings"]["cutoffs deeper than the run"] == note
    assert main([*argv, "--metrics", "map,p@3,recall"]) == 0
    assert "warning" not in capsys.readouterr().err  # cutoffs within the run, or none


def test_index_mode_warns_of_cutoffs_deeper_than_k(tmp_path, beir_dir, monkeypatch, capsys):
    _use_fake_pipeline(monkeypatch)
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "manifest.json").write_text("{}")
    assert main(["eval", "--index", str(tmp_path / "idx"), "--dataset", str(beir_dir), "--out", str(tmp_path / "r"),
                 "-k", "5", "--no-progress", "--json"]) == 0
    note = ("ndcg@10, mrr@10, recall@10, recall@100, p@10 cut deeper than the deepest list of the run (5 "
            "documents): they count only those; -k 100 scores them in full")
    assert f"twotower eval: warning: {note}\n" in capsys.readouterr().err
    assert json.loads((tmp_path / "r" / "metrics.json").read_text())["settings"]["cutoffs deeper than the run"] == note


def test_index_mode_says_nothing_of_cutoffs_within_k_of_a_small_index(tmp_path, beir_dir, monkeypatch, capsys):
    """A 6-document index searched with the default -k 100 was told "... -k 100 scores them in full": its lists
    are the whole index, which no flag makes deeper. Only a cutoff beyond -k is said."""
    _use_fake_pipeline(monkeypatch)
    monkeypatch.setattr(_FakePipeline, "size", 6)
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "manifest.json").write_text("{}")
    argv = ["eval", "--index", str(tmp_path / "idx"), "--dataset", str(beir_dir), "--no-progress", "--json"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert "cutoffs deeper than the run" not in json.loads((tmp_path / "r" / "metrics.json").read_text())["settings"]
    assert main([*argv, "--out", str(tmp_path / "r50"), "-k", "50"]) == 0  # recall@100 is beyond -k 50
    note = ("recall@100 cut deeper than the deepest list of the run (6 documents): it counts only those; -k 100 "
            "scores them in full")
    assert f"twotower eval: warning: {note}\n" in capsys.readouterr().err
    assert json.loads((tmp_path / "r50" / "metrics.json").read_text())["settings"]["cutoffs deeper than the run"] == note


def test_index_mode_report_records_the_index_encoder_fusion_and_unreachable_documents(
        tmp_path, beir_dir, monkeypatch, capsys):
    """The report named the index as typed and nothing else: not the encoder, the commit searched, the
    documents in it, the fusion of --hybrid, nor the warning that relevant documents are not in the index."""
    _use_fake_pipeline(monkeypatch)
    monkeypatch.setattr(_FakePipeline, "absent", {"d4"})
    (tmp_path / "idx").mkdir()
    Manifest(dim=4, metric="ip", factory="Flat", bm25={}).write(tmp_path / "idx" / "manifest.json")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--index", "idx", "--dataset", str(beir_dir), "--out", "r", "--hybrid", "--no-progress"]) == 0
    err = capsys.readouterr().err
    settings = json.loads((tmp_path / "r" / "metrics.json").read_text())["settings"]
    assert settings["index"] == str(tmp_path / "idx")
    assert (settings["index generation"], settings["index documents"]) == (3, 11)
    assert (settings["encoder model"], settings["encoder fingerprint"]) == ("/models/enc", "0123456789abcdef")
    assert settings["fusion"] == "rrf (reciprocal-rank fusion of dense and BM25, k=60)"
    warning = settings["relevant documents not in --index"]
    assert warning.startswith("1 of the 7 relevant documents of --split test are not in --index idx (d4)")
    assert f"twotower eval: warning: {warning}\n" in err
    report = (tmp_path / "r" / "report.md").read_text()
    assert f"- index: {tmp_path / 'idx'}\n" in report and "- encoder fingerprint: 0123456789abcdef\n" in report
    assert f"- relevant documents not in --index: {warning}\n" in report
