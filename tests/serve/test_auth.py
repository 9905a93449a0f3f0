"""Access: writes need the token and are refused read-only; with a token set, reads need it too."""

from __future__ import annotations

import pytest

from tests.serve.serve_fixtures import AUTH, TOKEN, client, stats
from twotower.serve.auth import TOKEN_ENV, load_token

DOC = {"documents": [{"_id": "auth-1", "text": "green tea leaf"}]}
READS = [("GET", "/search?q=tea", None), ("POST", "/search", {"queries": ["tea"]}), ("GET", "/documents/d1", None),
         ("GET", "/stats", None)]
WRITES = [("POST", "/documents", DOC), ("DELETE", "/documents", {"ids": ["d1"]})]


def _req(c, method, path, body, headers=None):
    return c.request(method, path, json=body, headers=headers or {})


def test_without_a_token_reads_are_open_and_writes_refused(index_dir):
    with client(index_dir) as c:
        for method, path, body in READS:
            assert _req(c, method, path, body).status_code == 200, path
        for method, path, body in WRITES:
            r = _req(c, method, path, body)
            assert r.status_code == 403 and TOKEN_ENV in r.json()["message"], r.text
        assert stats(c)["documents"] == 40


def test_with_a_token_every_read_and_write_needs_it(index_dir):
    with client(index_dir, token=TOKEN) as c:
        for method, path, body in READS + WRITES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                            {"Authorization": TOKEN}):
                r = _req(c, method, path, body, headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer" and r.json()["field"] == "Authorization"
        assert stats(c, AUTH)["documents"] == 40  # the refused writes changed nothing
        for method, path, body in READS:
            assert _req(c, method, path, body, AUTH).status_code == 200, path
        assert _req(c, "POST", "/documents", DOC, AUTH).status_code == 200
        assert _req(c, "DELETE", "/documents", {"ids": ["auth-1"]}, AUTH).status_code == 200
        health = c.get("/health")  # public, and tells the page a token is needed
        assert health.status_code == 200 and health.json()["auth_required"] is True
        assert c.get("/").status_code == 200


def test_read_only_refuses_writes_even_with_the_token(index_dir):
    with client(index_dir, token=TOKEN, read_only=True) as c:
        for method, path, body in WRITES:
            r = _req(c, method, path, body, AUTH)
            assert r.status_code == 403 and "--read-only" in r.json()["message"]
            assert _req(c, method, path, body).status_code == 401  # no token: 401 first
        s = stats(c, AUTH)
        assert (s["documents"], s["writes"]) == (40, 0)
        assert c.get("/health").json()["writable"] is False
        # the token still guards reads (`serve --read-only --token-file F`: a read-only service for token holders)
        assert c.get("/search", params={"q": "tea"}).status_code == 401
        assert c.get("/search", params={"q": "tea"}, headers=AUTH).status_code == 200


def test_load_token(tmp_path):
    f = tmp_path / "token"
    f.write_text("  abc123 \nsecond line ignored\n")
    assert load_token(str(f), {}) == "abc123"
    assert load_token(None, {TOKEN_ENV: " xyz "}) == "xyz"
    assert load_token(str(f), {TOKEN_ENV: "xyz"}) == "abc123"  # the file wins
    assert load_token(None, {}) is None and load_token(None, {TOKEN_ENV: "  "}) is None
    f.write_text("\n")
    with pytest.raises(ValueError, match="--token-file.*empty"):
        load_token(str(f), {})
    with pytest.raises(FileNotFoundError, match="--token-file"):
        load_token(str(tmp_path / "absent"), {})
