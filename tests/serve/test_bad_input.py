"""Bad input: each case is a 4xx JSON error naming the field, and the index is unchanged afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time

import pytest

from tests.serve.serve_fixtures import AUTH, TOKEN, client, hold, live_server, read_answer, stats, wait_until
from twotower.serve.limits import Limits

LIMITS = Limits(max_body_bytes=20_000, max_query_chars=200, max_k=50, max_recall_k=200, max_batch_queries=4,
                max_documents=3, max_ids=3)

# (method, path, query params, JSON body (or raw bytes), status, field, words the message must hold)
SEARCH_CASES = [
    ("GET", "/search", {"q": ""}, None, 400, "q", "empty"),
    ("GET", "/search", {"q": "   \t "}, None, 400, "q", "empty"),
    ("GET", "/search", {}, None, 400, "q", "required"),
    ("GET", "/search", {"q": "tea", "k": 0}, None, 400, "k", "between 1 and 50"),
    ("GET", "/search", {"q": "tea", "k": -3}, None, 400, "k", "between 1 and 50"),
    ("GET", "/search", {"q": "tea", "k": 51}, None, 400, "k", "between 1 and 50"),
    ("GET", "/search", {"q": "tea", "k": "ten"}, None, 400, "k", "integer"),
    ("GET", "/search", {"q": "tea", "k": 10, "recall_k": 5}, None, 400, "recall_k", "between k"),
    ("GET", "/search", {"q": "tea", "recall_k": 201}, None, 400, "recall_k", "200"),
    ("GET", "/search", {"q": "tea", "rerank_k": 0}, None, 400, "rerank_k", "between 1 and recall_k"),
    ("GET", "/search", {"q": "tea", "k": 5, "recall_k": 20, "rerank_k": 21}, None, 400, "rerank_k", "(20)"),
    ("POST", "/search", {}, {"queries": ["tea"], "recall_k": 20, "rerank_k": 30}, 400, "rerank_k", "got 30"),
    ("GET", "/search", {"q": "tea", "colour": "red"}, None, 400, "colour", "unknown parameter"),
    ("GET", "/search", {"q": "tea", "hybrid": "maybe"}, None, 400, "hybrid", "boolean"),
    ("GET", "/search", {"q": "tea", "bm25": "maybe"}, None, 400, "bm25", "boolean"),
    # BM25 alone and BM25 fused with dense recall: one first stage or the other
    ("GET", "/search", {"q": "tea", "hybrid": "true", "bm25": "true"}, None, 400, "bm25", "give one, not both"),
    ("POST", "/search", {}, {"queries": ["tea"], "hybrid": True, "bm25": True}, 400, "bm25",
     "bm25=true recalls by BM25 alone and hybrid=true fuses BM25 with dense recall"),
    ("GET", "/search", {"q": "tea", "rerank": "true"}, None, 400, "rerank", "no reranker"),
    ("GET", "/search", {"q": "tea", "rerank_k": 5}, None, 400, "rerank_k", "but no reranker is loaded"),
    ("POST", "/search", {}, {"queries": ["tea"], "rerank_k": 5}, 400, "rerank_k", "but no reranker is loaded"),
    ("GET", "/search", {"q": "t" * 201}, None, 413, "q", "limit is 200"),
    ("POST", "/search", {}, b'{"queries": ["tea"', 400, "body", "malformed JSON"),
    ("POST", "/search", {}, ["tea"], 400, "body", "object"),
    ("POST", "/search", {}, {}, 400, "queries", "required"),
    ("POST", "/search", {}, {"queries": []}, 400, "queries", "at least one"),
    ("POST", "/search", {}, {"queries": ["tea", " "]}, 400, "queries[1]", "empty"),
    ("POST", "/search", {}, {"queries": ["tea", 3]}, 400, "queries[1]", "string"),
    ("POST", "/search", {}, {"queries": ["a", "b", "c", "d", "e"]}, 413, "queries", "limit is 4"),
    ("POST", "/search", {}, {"queries": ["tea"], "top": 3}, 400, "top", "unknown field"),
    ("POST", "/search", {}, {"queries": ["tea"], "k": 0}, 400, "k", "between 1 and 50"),
    ("POST", "/search", {"k": 3}, {"queries": ["tea"]}, 400, "k", "unknown parameter 'k'; this endpoint takes no query"),
    # repeated parameters: the last one won without a word
    ("GET", "/search", {"q": ["tea", "coffee"]}, None, 400, "q", "given 2 times"),
    ("GET", "/search", {"q": "tea", "k": [1, 3]}, None, 400, "k", "given 2 times"),
    # JSON has types: true is not 1, "3" is not 3 (pydantic's lax mode ran them as such)
    ("POST", "/search", {}, {"queries": ["tea"], "k": True}, 400, "k", "integer"),
    ("POST", "/search", {}, {"queries": ["tea"], "k": "3"}, 400, "k", "integer"),
    ("POST", "/search", {}, {"queries": ["tea"], "hybrid": "yes"}, 400, "hybrid", "boolean"),
    ("POST", "/search", {}, {"queries": ["tea"], "bm25": 1}, 400, "bm25", "boolean"),
    # text that is not text: before, a lone surrogate reached the tokenizer (a 500 for the whole batch) and
    # invisible queries returned arbitrary hits
    ("POST", "/search", {}, b'{"queries": ["tea", "tea \\ud800"]}', 400, "queries[1]", "lone surrogate"),
    ("GET", "/search", {"q": "\x00"}, None, 400, "q", "only control or invisible characters"),
    ("GET", "/search", {"q": "\u200b \u2060"}, None, 400, "q", "only control or invisible characters"),
    ("POST", "/search", {}, b'{"queries": ["tea"], "filter": "lang == \\"\\ud800\\""}', 400, "filter",
     "lone surrogate"),
    # filters too large for SQLite or the parser were a 500
    ("GET", "/search", {"q": "tea", "filter": " or ".join(f"year == {i}" for i in range(1025))}, None, 400,
     "filter", "more than 1024 comparisons"),
    ("GET", "/search", {"q": "tea", "filter": "(" * 400 + "year > 1" + ")" * 400}, None, 400, "filter", "nested"),
    # a repeated key: Python's parser kept the last one, as the query string kept the last parameter
    ("POST", "/search", {}, b'{"queries": ["tea"], "k": 1, "k": 2}', 400, "k", "'k' is given twice"),
    ("GET", "/documents/nope", {}, None, 404, "id", "no document"),
]

WRITE_CASES = [
    ("POST", "/documents", {}, {"documents": [{"text": "no id"}]}, 400, "documents[0]._id", "_id"),
    ("POST", "/documents", {}, {"documents": [{"_id": "x1", "text": "ok"}, {"_id": "x2"}]}, 400,
     "documents[1].text", "text"),
    ("POST", "/documents", {}, {"documents": [{"_id": "x1", "text": 7}]}, 400, "documents[0].text", "text"),
    ("POST", "/documents", {}, {"documents": [{"_id": "x 1", "text": "t"}]}, 400, "documents[0]._id",
     "whitespace"),
    ("POST", "/documents", {}, {"documents": [{"_id": "x1", "title": 3, "text": "t"}]}, 400,
     "documents[0].title", "string"),
    ("POST", "/documents", {}, b'{"documents": [{"_id": "x1", "text": "t \\udc80"}]}', 400, "documents[0].text",
     "lone surrogate"),
    ("POST", "/documents", {}, b'{"documents": [{"_id": "x1", "text": "t", "metadata": {"y": NaN}}]}', 400,
     "documents[0].metadata", "NaN"),
    # metadata keys no filter could name
    ("POST", "/documents", {}, {"documents": [{"_id": "x1", "text": "t", "metadata": {"src": {"c.d": 2}}}]}, 400,
     "documents[0].metadata", "metadata.src has the key 'c.d'"),
    ("POST", "/documents", {}, {"documents": [{"_id": "x1", "text": "t", "": 1}]}, 400, "documents[0].metadata",
     "empty key"),
    ("POST", "/documents", {}, {"documents": [{"_id": "x1", "text": "a"}, {"_id": "x1", "text": "b"}]}, 400,
     "documents[1]._id", "repeats documents[0]"),
    ("POST", "/documents", {}, {"documents": [{"_id": "x1", "text": "new"}, {"_id": "d3", "text": "dup"}]}, 409,
     "documents[1]._id", "replace"),
    ("POST", "/documents", {}, {"documents": []}, 400, "documents", "at least one"),
    ("POST", "/documents", {}, {"documents": [{"_id": f"x{i}", "text": "t"} for i in range(4)]}, 413, "documents",
     "limit is 3"),
    ("POST", "/documents", {}, {"documents": [{"_id": "x1", "text": "t"}], "upsert": True}, 400, "upsert",
     "unknown field"),
    ("POST", "/documents", {}, b'{"documents": [{"_id": "x1", "text": "t"}', 400, "body", "malformed JSON"),
    ("POST", "/documents", {}, {"documents": [{"_id": "x1", "text": "t" * 30_000}]}, 413, "body", "20,000"),
    ("DELETE", "/documents", {}, {"ids": ["d1", "missing-a", "missing-b"]}, 404, "ids", "nothing was deleted"),
    ("DELETE", "/documents", {}, {"ids": []}, 400, "ids", "at least one"),
    ("DELETE", "/documents", {}, {"ids": ["d1", ""]}, 400, "ids[1]", "empty"),
    ("DELETE", "/documents", {}, b'{"ids": ["d1", "\\ud800"]}', 400, "ids[1]", "lone surrogate"),
    ("DELETE", "/documents", {}, {"ids": ["d1", True]}, 400, "ids[1]", "string or an integer"),
    ("DELETE", "/documents", {}, {"ids": [3]}, 404, "ids", "nothing was deleted"),  # as POST reads {"_id": 3}
    ("DELETE", "/documents", {}, {"ids": ["d1", "d2", "d3", "d4"]}, 413, "ids", "limit is 3"),
    ("DELETE", "/documents", {}, {"id": "d1"}, 400, "id", "unknown field"),
    # a repeated key: Python's parser kept the last one
    ("POST", "/documents", {}, b'{"documents": [{"_id": "n1", "text": "a", "text": "b"}]}', 400, "text",
     "given twice"),
    ("DELETE", "/documents", {}, b'{"ids": ["d1"], "ids": ["d2"]}', 400, "ids", "given twice"),
]


def _fingerprint(index: str) -> dict[str, str]:
    """sha256 of every file of the index directory: "unchanged" means byte for byte."""
    out = {}
    for name in sorted(os.listdir(index)):
        path = os.path.join(index, name)
        if os.path.isfile(path) and name != "LOCK" and not name.endswith(("-wal", "-shm")):
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _send(c, method, path, params, body):
    kw = {"params": params, "headers": dict(AUTH)}
    if isinstance(body, bytes):
        kw["content"] = body
        kw["headers"]["content-type"] = "application/json"
    elif body is not None:
        kw["json"] = body
    return c.request(method, path, **kw)


def _check(r, status, field, words):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status"] == status and body["field"] == field, body
    assert words.lower() in body["message"].lower(), body
    assert "Traceback" not in r.text


@pytest.fixture(scope="module")
def shared(index_template):
    with client(index_template, token=TOKEN, limits=LIMITS) as c:
        yield c


@pytest.mark.parametrize("case", SEARCH_CASES, ids=lambda c: f"{c[0]} {c[1]} {c[5]} {c[4]}")
def test_bad_search_input_is_a_4xx_naming_the_field(shared, case):
    method, path, params, body, status, field, words = case
    _check(_send(shared, method, path, params, body), status, field, words)


@pytest.mark.parametrize("query, field", [("q=caf%E9", "q"), ("q=%ED%A0%80", "q"),  # Latin-1; a lone surrogate
                                          ("q=tea&filter=lang+%3D%3D+%22%FF%22", "filter")])
def test_query_parameters_that_are_not_utf8_are_refused(shared, query, field):
    """Starlette reads them with errors="replace": `q=caf%E9` searched "caf\ufffd" and answered 200."""
    _check(shared.get("/search?" + query, headers=AUTH), 400, field, "not UTF-8")
    assert shared.get("/search?q=caf%C3%A9", headers=AUTH).status_code == 200


def test_writes_with_bad_input_leave_the_index_unchanged(index_dir):
    before_files = _fingerprint(index_dir)
    with client(index_dir, token=TOKEN, limits=LIMITS) as c:
        before = stats(c, AUTH)
        for method, path, params, body, status, field, words in WRITE_CASES:
            r = _send(c, method, path, params, body)
            _check(r, status, field, words)
            after = stats(c, AUTH)
            assert (after["generation"], after["documents"]) == (before["generation"], before["documents"]), body
            assert after["writes"] == 0
        # the refusals of known and unknown ids are reported per id
        r = _send(c, "DELETE", "/documents", {}, {"ids": ["d1", "missing-a"]})
        assert r.json()["details"] == {"d1": "not deleted", "missing-a": "not found"}
        r = _send(c, "POST", "/documents", {}, {"documents": [{"_id": "d3", "text": "dup"},
                                                              {"_id": "d4", "text": "dup"}]})
        assert r.json()["details"] == {"d3": "already in the index", "d4": "already in the index"}
        assert c.get("/documents/d1", headers=AUTH).status_code == 200
    assert _fingerprint(index_dir) == before_files


def test_declared_body_size_over_the_limit_is_refused_before_reading(index_dir):
    with client(index_dir, token=TOKEN, limits=LIMITS) as c:
        r = c.post("/documents", content=b"{" + b" " * 25_000 + b"}",
                   headers={**AUTH, "content-type": "application/json"})
        _check(r, 413, "body", "larger than the limit")
        r = c.post("/search", content=b"[]", headers={**AUTH, "content-type": "application/json",
                                                     "content-length": "many"})
        assert r.status_code == 400


def test_streamed_body_over_the_limit_is_refused(index_dir):
    def chunks():
        for _ in range(30):
            yield b" " * 1000

    with client(index_dir, token=TOKEN, limits=LIMITS) as c:
        r = c.post("/documents", content=chunks(), headers={**AUTH, "content-type": "application/json"})
        _check(r, 413, "body", "larger than the limit")


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_closes(index_template):
    """A client sending its body a few bytes a second held its connection (and, after SIGTERM, the server) open for
    as long as it liked. The body must now be complete `body_timeout_s` after the request arrived."""
    with live_server(index_template, body_timeout_s=0.5) as (url, app):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"queries\": [")
            head, body = read_answer(conn)  # a socket timeout here: the server is still waiting for the body
        assert head.startswith(b"HTTP/1.1 408 "), head
        assert b"connection: close" in head.lower()
        err = json.loads(body)
        assert (err["status"], err["error"], err["field"]) == (408, "request_timeout", "body")
        assert "did not arrive within 0.5 s" in err["message"]
        # a body sent at once is unaffected, and so is a search answered after the body deadline has passed
        owner = app.state.service.owner
        release = hold(owner)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            payload = json.dumps({"queries": ["tea"], "k": 2}).encode()
            conn.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            wait_until(lambda: owner._queued_queries == 1, "its body was read: the search waits for the owner")
            time.sleep(0.8)  # past the body deadline, the handler waiting on `receive` for a disconnect
            release.set()
            head, body = read_answer(conn)
        assert head.startswith(b"HTTP/1.1 200 "), head + body
        assert len(json.loads(body)["results"][0]["hits"]) == 2


def test_hybrid_on_an_index_without_bm25(dense_only_template):
    with client(dense_only_template) as c:
        _check(c.get("/search", params={"q": "tea", "hybrid": "true"}), 400, "hybrid", "no BM25")
        assert c.get("/search", params={"q": "tea"}).status_code == 200


def test_bm25_on_an_index_without_bm25(dense_only_template):
    with client(dense_only_template) as c:
        for r in (c.get("/search", params={"q": "tea", "bm25": "true"}),
                  c.post("/search", json={"queries": ["tea"], "bm25": True})):
            _check(r, 400, "bm25", "this index has no BM25 (build it with `twotower index build --bm25`)")
        assert c.get("/search", params={"q": "tea", "bm25": "false"}).json()["bm25"] is False
        assert c.get("/health").json()["bm25"] is False  # the page's BM25-only switch is off


def test_unexpected_errors_are_a_plain_500_without_a_trace(index_template, monkeypatch, caplog):
    from twotower.retrieval.pipeline import SearchPipeline

    def broken(self, *a, **kw):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(SearchPipeline, "search", broken)
    with client(index_template, raise_server_exceptions=False) as c:
        r = c.get("/search", params={"q": "tea"})
        assert r.status_code == 500
        assert r.json() == {"status": 500, "error": "internal", "message": "internal error (the server log has "
                                                                            "the details)"}
        assert "secret" not in r.text and "Traceback" not in r.text
    assert "secret internal detail" in caplog.text  # the server log keeps it


def test_unknown_paths_and_methods_are_json_errors(index_template):
    with client(index_template) as c:
        r = c.get("/nowhere")
        assert r.status_code == 404 and r.json()["error"] == "not_found"
        r = c.put("/search")
        assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"


def test_a_body_that_is_not_json_says_so_in_http_words(index_template):
    """A JSON body sent as text/plain (or with no type) was told "the body must be a JSON object", which it
    was; bytes that are not UTF-8 got FastAPI's "There was an error parsing the body" with no field."""
    with client(index_template) as c:
        for media in ("text/plain", None, "application/x-www-form-urlencoded"):
            r = c.post("/search", content=b'{"queries": ["tea"]}', headers={"content-type": media} if media else {})
            _check(r, 400, "Content-Type", "send the body as JSON, with 'Content-Type: application/json'")
            assert (repr(media) if media else "no Content-Type") in r.json()["message"]
        for media in ("application/json; charset=utf-8", "application/vnd.api+json"):
            assert c.post("/search", content=b'{"queries": ["tea"]}', headers={"content-type": media}).status_code == 200
        r = c.post("/search", content=b'{"queries": ["tea \xff"]}', headers={"content-type": "application/json"})
        _check(r, 400, "body", "could not be read as JSON (it must be UTF-8 text)")


def test_uptime_probes_may_use_head(index_template):
    with client(index_template) as c:
        for path in ("/", "/health", "/docs"):
            r = c.head(path)
            assert r.status_code == 200 and r.content == b"", path
        assert c.head("/search", params={"q": "tea"}).status_code == 405  # a search is not a probe
