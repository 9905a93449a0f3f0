"""The search page in a real browser: `twotower serve` in a subprocess, headless Debian Chromium via Selenium.

Types a query, waits for the hits, checks what each shows (title, snippet, final score,
first-stage and reranked rank) and saves a screenshot (``$TWOTOWER_SCREENSHOT_DIR`` keeps a
copy); then the page's own behaviour (one browser for those): a search sent while one runs, errors, the URL,
odd titles and text.  Skipped only where Chromium is absent outside CI; in CI (``CI=true``) it must run:
.ci/run installs ``chromium`` and ``chromium-driver``.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from tests.retrieval.pipeline_fixtures import tiny_model_dir, write_corpus
from tests.serve.serve_fixtures import free_port
from twotower.retrieval.training.demo_reranker import BUNDLED_CORPUS

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
IN_CI = os.environ.get("CI", "").lower() == "true"
QUERY = "vitamin D deficiency and bone fractures"


def _need_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    if missing and not IN_CI:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install chromium chromium-driver); "
                    "CI installs them and runs this test")
    assert not missing, f"CI must have {missing}: .ci/run installs chromium and chromium-driver"


def page_index_docs() -> list[dict]:
    """The 120 bundled abstracts the page's index holds, each with a ``half`` field (0 or 1) to filter on."""
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        return [{**json.loads(line), "half": i % 2} for i, line in enumerate(itertools.islice(f, 120))]


def _ids_with_half(docs: list[dict], half: int) -> list[str]:
    return [d["_id"] for d in docs if d["half"] == half]


@pytest.fixture(scope="module")
def page_index(tmp_path_factory, encoder) -> str:
    """120 real SciFact abstracts (the bundled sample) under the tiny model, with BM25."""
    from twotower.retrieval import SearchPipeline

    root = tmp_path_factory.mktemp("page")
    corpus = write_corpus(str(root / "corpus.jsonl"), page_index_docs())
    SearchPipeline.build(corpus, str(root / "idx"), encoder, metric="cosine", bm25=True, progress=False).close()
    return str(root / "idx")


@pytest.fixture(scope="module")
def server(page_index, reranker_dir, tmp_path_factory):
    """One server for the module's tests over `page_index`: they only search."""
    yield from _serve(page_index, tmp_path_factory.mktemp("serve"), "--reranker", reranker_dir)


def _serve(index: str, tmp_path, *flags: str):
    """`twotower serve` on `index` with the tiny model, in a subprocess; yields its URL once ready."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "twotower", "serve", "--index", index, "--model", tiny_model_dir(), *flags,
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TWOTOWER_TOKEN": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"twotower serve exited: {open(log.name).read()}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server did not become ready: {open(log.name).read()}"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
        log.close()


def _browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-quic", "--window-size=1100,1500", f"--user-data-dir={tmp_path / 'chrome'}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def test_the_page_searches_and_shows_the_ranks(server, tmp_path):
    _need_browser()
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = _browser(tmp_path)
    try:
        driver.get(server + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "documents" in d.find_element(By.ID, "status").text)
        assert "120 documents" in driver.find_element(By.ID, "status").text
        assert driver.find_element(By.ID, "rerank").is_selected()  # a reranker is loaded: on by default
        assert not driver.find_element(By.ID, "aggregate-row").is_displayed()  # documents stored whole
        driver.find_element(By.CSS_SELECTOR, "label.switch:has(#hybrid)").click()
        assert driver.find_element(By.ID, "hybrid").is_selected()
        Select(driver.find_element(By.ID, "recall_k")).select_by_visible_text("20")
        Select(driver.find_element(By.ID, "rerank_k")).select_by_visible_text("5")
        box = driver.find_element(By.ID, "q")
        box.send_keys(QUERY)
        box.send_keys(Keys.ENTER)
        wait.until(ec.presence_of_all_elements_located((By.CSS_SELECTOR, "#results .hit")))
        hits = driver.find_elements(By.CSS_SELECTOR, "#results .hit")
        assert len(hits) == 10
        ranks = [h.find_element(By.CLASS_NAME, "rank").text for h in hits]
        assert ranks == [str(i) for i in range(1, 11)]
        for i, h in enumerate(hits):
            assert h.find_element(By.CLASS_NAME, "title").text.strip()
            assert len(h.find_element(By.CLASS_NAME, "snippet").text) > 40
            chips = h.find_element(By.CLASS_NAME, "scores").text
            assert "score " in chips and "first stage #" in chips and "BM25" in chips
            if i < 5:  # the cross-encoder scored the first stage's top 5 only
                assert "reranked #" in chips and "cross-encoder" in chips, chips
            else:
                assert "not reranked" in chips and "cross-encoder" not in chips, chips
        assert "<mark>" in driver.find_element(By.ID, "results").get_attribute("innerHTML")  # words of the query
        # words are marked in the text and each part escaped: marking the escaped HTML put the query word "amp"
        # inside "&amp;", which then showed as "&amp;"
        html = driver.execute_script("return snippet(arguments[0], queryTerms(arguments[1]))",
                                     "Fish & chips <b>amp</b>", "amp chips")
        assert html == "Fish &amp; <mark>chips</mark> &lt;b&gt;<mark>amp</mark>&lt;/b&gt;"
        summary = driver.find_element(By.ID, "summary").text
        assert "10 hits" in summary and "hybrid" in summary and "reranked" in summary
        # A metadata filter from the box: only the odd documents come back; a field no document has is a 400.
        odd = set(_ids_with_half(page_index_docs(), 1))
        driver.find_element(By.ID, "filter").send_keys("half == 1")
        driver.find_element(By.ID, "go").click()
        def only_odd(d) -> bool:  # the list re-renders when the answer comes: an element can go stale mid-read
            try:
                shown = [h.get_attribute("data-id") for h in d.find_elements(By.CSS_SELECTOR, "#results .hit")]
            except StaleElementReferenceException:
                return False
            return len(shown) == 10 and set(shown) <= odd

        wait.until(only_odd)
        driver.find_element(By.ID, "filter").clear()
        driver.find_element(By.ID, "filter").send_keys("hlaf == 1")
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
        assert "400" in driver.find_element(By.ID, "error").text and "hlaf" in driver.find_element(By.ID, "error").text
        driver.find_element(By.ID, "filter").clear()
        box.send_keys(Keys.ENTER)
        wait.until(lambda d: not d.find_element(By.ID, "error").is_displayed())
        shot = tmp_path / "serve-page.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get("TWOTOWER_SCREENSHOT_DIR"):
            shutil.copy(shot, os.environ["TWOTOWER_SCREENSHOT_DIR"])

        box.clear()
        box.send_keys(" ")
        box.send_keys(Keys.ENTER)
        wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
        assert "type a query" in driver.find_element(By.ID, "error").text
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"
                  and not ("hlaf" in e["message"] and "status of 400" in e["message"])]  # the bad filter, on purpose
        assert not severe, severe
    finally:
        driver.quit()


@pytest.fixture()
def passage_server(tmp_path, encoder):
    from tests.retrieval.test_passages import corpus_docs
    from twotower.retrieval import SearchPipeline

    out = str(tmp_path / "idx")
    SearchPipeline.build(write_corpus(str(tmp_path / "c.jsonl"), corpus_docs()), out, encoder, passages=True,
                         passage_window=16, passage_stride=12, bm25=True, progress=False).close()
    yield from _serve(out, tmp_path)


def test_the_page_over_passages_shows_the_passage_that_ranked_each_document_and_sends_aggregate(passage_server,
                                                                                                tmp_path):
    """The page had no aggregate control, and its snippet began at the first query word of the whole document,
    which in a long document need not be in the passage that ranked it."""
    _need_browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    query = "zorbania tea"
    driver = _browser(tmp_path)
    try:
        driver.get(passage_server + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "documents" in d.find_element(By.ID, "status").text)
        assert driver.find_element(By.ID, "aggregate-row").is_displayed()
        driver.find_element(By.CSS_SELECTOR, "label.switch:has(#hybrid)").click()
        Select(driver.find_element(By.ID, "k")).select_by_visible_text("5")
        Select(driver.find_element(By.ID, "recall_k")).select_by_visible_text("20")
        for how, label in (("max", "best"), ("sum", "sum"), ("first", "first")):
            Select(driver.find_element(By.ID, "aggregate")).select_by_visible_text(label)
            want = httpx.get(passage_server + "/search", params={"q": query, "k": 5, "recall_k": 20, "hybrid": True,
                                                                 "aggregate": how}).json()["hits"]
            driver.execute_script("document.getElementById('results').innerHTML = ''")
            box = driver.find_element(By.ID, "q")
            box.clear()
            box.send_keys(query)
            driver.find_element(By.ID, "go").click()
            wait.until(lambda d, n=len(want): len(d.find_elements(By.CSS_SELECTOR, "#results .hit")) == n)
            shown = driver.find_elements(By.CSS_SELECTOR, "#results .hit")
            assert [h.get_attribute("data-id") for h in shown] == [h["id"] for h in want], how
            for el, hit in zip(shown, want):
                chips = el.find_element(By.CLASS_NAME, "scores").text
                snippet = el.find_element(By.CLASS_NAME, "snippet").text
                if hit["passage"] is None:
                    assert "passage at" not in chips
                    continue
                start, end = hit["passage"]["start"], hit["passage"]["end"]
                assert f"passage at character {start}" in chips
                piece = hit["text"][start:end].strip()
                assert snippet.removeprefix("… ").startswith(piece[:40]), (how, snippet, piece)
        sums = [h["score"] for h in httpx.get(passage_server + "/search", params={
            "q": query, "k": 5, "recall_k": 20, "hybrid": True, "aggregate": "sum"}).json()["hits"]]
        assert sums != [h["score"] for h in httpx.get(passage_server + "/search", params={
            "q": query, "k": 5, "recall_k": 20, "hybrid": True}).json()["hits"]]  # the loop could tell them apart
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        driver.quit()


# ---------------------------------------------------------------------- the page's own behaviour, one browser
SECOND = "gene expression in tumour cells"
# Holds the page's next /search answers back by the given milliseconds each (a slow server, as the page sees it),
# without passing the page's AbortSignal on: a superseded search's answer still arrives, late, and must be dropped.
SLOW_SEARCHES = """
const real = window.fetch;
window.__delays = arguments[0]; window.__signals = []; window.__late = 0;
window.fetch = function (url, opts) {
  if (!String(url).startsWith("/search")) return real(url, opts);
  window.__signals.push(opts && opts.signal);
  const delay = window.__delays.shift();
  if (!delay) return real(url, opts);
  const rest = Object.assign({}, opts);
  delete rest.signal;
  return new Promise((ok) => setTimeout(ok, delay)).then(() => real(url, rest)).finally(() => { window.__late++; });
};
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One Chromium for the tests below (each loads the page afresh)."""
    _need_browser()
    driver = _browser(tmp_path_factory.mktemp("browser"))
    try:
        yield driver
    finally:
        driver.quit()


def _open(driver, url: str) -> None:
    """Load the page at `url` and wait until it has described the index; the browser's log starts afresh."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, 60).until(lambda d: "documents" in d.find_element(By.ID, "status").text)
    driver.get_log("browser")


def _severe(driver) -> list:
    """The browser's errors, less the 4xx answers a test asked for (Chromium logs each failed request)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "status of 4" not in e["message"]]


def _submit(driver, query: str) -> None:
    """Put `query` in the box (as set by a script: the box's maxlength does not apply) and press Enter."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.execute_script("document.getElementById('q').value = arguments[0]", query)
    driver.find_element(By.ID, "q").send_keys(Keys.ENTER)


def _shown(driver) -> list[str] | None:
    """The ids of the hits on the page (None while the list is being replaced)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return [h.get_attribute("data-id") for h in driver.find_elements(By.CSS_SELECTOR, "#results .hit")]
    except StaleElementReferenceException:
        return None


def _api_ids(url: str, q: str, **options) -> list[str]:
    """The hits /search gives for the page's defaults (10 hits, 100 candidates, rerank the top 20) and `options`."""
    params = {"q": q, "k": 10, "recall_k": 100, "hybrid": False, "rerank": True, "rerank_k": 20, **options}
    if not params["rerank"]:
        del params["rerank_k"]
    r = httpx.get(url + "/search", params=params)
    assert r.status_code == 200, r.text
    return [h["id"] for h in r.json()["hits"]]


def test_a_second_search_while_one_runs_replaces_it_and_is_announced(server, browser):
    """The page disabled its button while a search ran, and a browser submits no form on Enter then: a second
    query was dropped, and the first one's hits showed under it when they came."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    want = _api_ids(server, SECOND)
    assert want != _api_ids(server, QUERY)
    driver = browser
    _open(driver, server + "/")
    wait = WebDriverWait(driver, 20, poll_frequency=0.05)
    driver.execute_script(SLOW_SEARCHES, [1500])
    _submit(driver, QUERY)
    _submit(driver, SECOND)  # while the first is held back
    wait.until(lambda d: d.execute_script("return window.__late") == 1)  # the first one's answer came, late
    time.sleep(0.5)  # time enough to (wrongly) show it
    assert _shown(driver) == want
    summary = driver.find_element(By.ID, "summary")
    assert f"10 hits for “{SECOND}”" in summary.text  # it names the query it answers
    assert driver.execute_script("return window.__signals[0].aborted") is True  # the first fetch was cancelled

    # While a search runs the summary says so, and the hits are marked busy; both are announced (a status region).
    assert summary.get_attribute("role") == "status" or summary.get_attribute("aria-live") == "polite"
    results = driver.find_element(By.ID, "results")
    driver.execute_script("window.__delays = [1500]")
    _submit(driver, QUERY)
    wait.until(lambda d: f"searching for “{QUERY}”" in summary.text)
    assert results.get_attribute("aria-busy") == "true"
    wait.until(lambda d: _shown(d) == _api_ids(server, QUERY))
    assert results.get_attribute("aria-busy") == "false" and f"10 hits for “{QUERY}”" in summary.text
    assert not _severe(driver)


def test_an_error_clears_the_hits_and_summary_of_the_query_before(server, browser):
    """An error left the previous query's hits and summary on the page, read as the failed query's."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    _open(driver, server + "/")
    wait = WebDriverWait(driver, 20)
    want = _api_ids(server, QUERY)
    set_filter = "document.getElementById('filter').value = arguments[0]"
    for query, flt, says in ((" ", "", "type a query"), ("\u200b\u200b", "", "400: q holds only"),
                             ("x" * 1001, "", "413: q: the query has 1,001 characters"),
                             (QUERY, "hlaf == 1", "400: filter: unknown field 'hlaf'")):
        driver.execute_script(set_filter, "")
        _submit(driver, QUERY)
        wait.until(lambda d: _shown(d) == want and not d.find_element(By.ID, "error").is_displayed())
        driver.execute_script(set_filter, flt)
        _submit(driver, query)
        wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
        assert says in driver.find_element(By.ID, "error").text
        assert _shown(driver) == [], says
        assert driver.find_element(By.ID, "summary").text == "", says
    assert not _severe(driver)


def test_the_url_holds_the_search_and_going_back_or_loading_it_searches_again(server, browser):
    """The page kept nothing in its URL: a search could not be bookmarked, shared or gone back to."""
    from urllib.parse import parse_qs, urlencode, urlsplit

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = browser
    _open(driver, server + "/")
    wait = WebDriverWait(driver, 20)
    driver.find_element(By.CSS_SELECTOR, "label.switch:has(#hybrid)").click()
    Select(driver.find_element(By.ID, "recall_k")).select_by_visible_text("50")
    Select(driver.find_element(By.ID, "rerank_k")).select_by_visible_text("10")
    driver.find_element(By.ID, "filter").send_keys("half == 1")
    options = {"hybrid": True, "recall_k": 50, "rerank_k": 10, "filter": "half == 1"}
    first, second = _api_ids(server, QUERY, **options), _api_ids(server, SECOND, **options)
    _submit(driver, QUERY)
    wait.until(lambda d: _shown(d) == first)
    url = driver.current_url
    assert parse_qs(urlsplit(url).query) == {"q": [QUERY], "k": ["10"], "recall_k": ["50"], "hybrid": ["true"],
                                             "bm25": ["false"], "rerank": ["true"], "rerank_k": ["10"],
                                             "filter": ["half == 1"]}
    _submit(driver, SECOND)
    wait.until(lambda d: _shown(d) == second)
    assert parse_qs(urlsplit(driver.current_url).query)["q"] == [SECOND]
    driver.back()
    wait.until(lambda d: _shown(d) == first)
    assert driver.current_url == url and driver.find_element(By.ID, "q").get_attribute("value") == QUERY

    # A fresh page at a URL: its options in the controls, and its hits.
    _open(driver, server + "/?" + urlencode({"q": SECOND, "k": 5, "recall_k": 20, "hybrid": "false",
                                             "rerank": "false"}))
    wait.until(lambda d: _shown(d) == _api_ids(server, SECOND, k=5, recall_k=20, rerank=False))
    assert driver.find_element(By.ID, "q").get_attribute("value") == SECOND
    assert not any(driver.find_element(By.ID, name).is_selected() for name in ("hybrid", "bm25", "rerank"))
    assert Select(driver.find_element(By.ID, "k")).first_selected_option.text == "5"
    assert not driver.find_element(By.ID, "rerank_k").is_enabled()  # means nothing without the reranker
    assert driver.find_element(By.ID, "filter").get_attribute("value") == ""
    # A changed option searches again, and the URL follows.
    driver.find_element(By.CSS_SELECTOR, "label.switch:has(#rerank)").click()
    wait.until(lambda d: _shown(d) == _api_ids(server, SECOND, k=5, recall_k=20))
    assert parse_qs(urlsplit(driver.current_url).query)["rerank"] == ["true"]
    assert "token" not in driver.current_url
    assert not _severe(driver)


def _sent_searches(driver) -> list[dict]:
    """The query parameters of each /search the page has fetched, in order."""
    from urllib.parse import parse_qs, urlsplit

    urls = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    return [parse_qs(urlsplit(u).query) for u in urls if urlsplit(u).path == "/search"]


def test_the_bm25_only_switch_excludes_hybrid_and_searches_by_bm25_alone(server, browser):
    """The page recalled densely or by hybrid fusion only.  "BM25 only" sends bm25=true; it and Hybrid exclude
    each other (turning one on turns the other off), and each change searches again."""
    from urllib.parse import parse_qs, urlencode, urlsplit

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    _open(driver, server + "/")
    wait = WebDriverWait(driver, 20)
    bm25, hybrid = driver.find_element(By.ID, "bm25"), driver.find_element(By.ID, "hybrid")
    bm25_label = driver.find_element(By.CSS_SELECTOR, "label.switch:has(#bm25)")
    assert bm25_label.text.strip() == "BM25 only" and bm25.is_enabled() and not bm25.is_selected()
    lexical, fused = _api_ids(server, QUERY, bm25=True), _api_ids(server, QUERY, hybrid=True)
    assert lexical != fused and lexical != _api_ids(server, QUERY)  # the test can tell the three apart

    driver.find_element(By.CSS_SELECTOR, "label.switch:has(#hybrid)").click()
    _submit(driver, QUERY)
    wait.until(lambda d: _shown(d) == fused)
    bm25_label.click()  # Hybrid goes off, and the page searches again by BM25 alone
    assert bm25.is_selected() and not hybrid.is_selected()
    wait.until(lambda d: _shown(d) == lexical)
    last = _sent_searches(driver)[-1]
    assert (last["bm25"], last["hybrid"], last["q"]) == (["true"], ["false"], [QUERY])
    assert parse_qs(urlsplit(driver.current_url).query)["bm25"] == ["true"]
    assert "BM25 recall, reranked" in driver.find_element(By.ID, "summary").text
    first_stage = driver.find_element(By.CSS_SELECTOR, "#results .hit .chip.plain")
    assert "BM25 score" in first_stage.get_attribute("title")
    bm25_url = driver.current_url

    driver.find_element(By.CSS_SELECTOR, "label.switch:has(#hybrid)").click()  # and back: BM25 only goes off
    assert hybrid.is_selected() and not bm25.is_selected()
    wait.until(lambda d: _shown(d) == fused)
    last = _sent_searches(driver)[-1]
    assert (last["bm25"], last["hybrid"]) == (["false"], ["true"])
    assert "hybrid (dense + BM25) recall" in driver.find_element(By.ID, "summary").text

    driver.back()  # the BM25 search's URL sets the switches again
    wait.until(lambda d: _shown(d) == lexical)
    assert driver.current_url == bm25_url and bm25.is_selected() and not hybrid.is_selected()
    bm25_label.click()  # off: dense recall
    wait.until(lambda d: _shown(d) == _api_ids(server, QUERY))
    assert not bm25.is_selected() and not hybrid.is_selected()
    assert "dense recall" in driver.find_element(By.ID, "summary").text
    # a hand-written URL asking for both (the service refuses that): the page searches the hybrid, which has BM25 in it
    _open(driver, server + "/?" + urlencode({"q": QUERY, "hybrid": "true", "bm25": "true"}))
    wait.until(lambda d: _shown(d) == fused)
    hybrid, bm25 = driver.find_element(By.ID, "hybrid"), driver.find_element(By.ID, "bm25")
    assert hybrid.is_selected() and not bm25.is_selected()
    assert (_sent_searches(driver)[-1]["hybrid"], _sent_searches(driver)[-1]["bm25"]) == (["true"], ["false"])
    assert not _severe(driver)


@pytest.fixture(scope="module")
def dense_server(tmp_path_factory, encoder):
    """`twotower serve` over an index without BM25 (and no reranker)."""
    from twotower.retrieval import SearchPipeline

    root = tmp_path_factory.mktemp("dense")
    SearchPipeline.build(write_corpus(str(root / "c.jsonl"), page_index_docs()[:8]), str(root / "idx"), encoder,
                         progress=False).close()
    yield from _serve(str(root / "idx"), root)


def test_without_bm25_the_hybrid_and_bm25_only_switches_are_off_and_say_why(dense_server, browser):
    """A URL asking for BM25 over an index without it leaves the switch off and searches densely (not a 400)."""
    from urllib.parse import urlencode

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    _open(driver, dense_server + "/?" + urlencode({"q": QUERY, "bm25": "true"}))
    WebDriverWait(driver, 20).until(lambda d: len(_shown(d) or []) == 8)
    assert "dense recall" in driver.find_element(By.ID, "summary").text
    assert _sent_searches(driver)[-1]["bm25"] == ["false"]
    for name in ("hybrid", "bm25"):
        box = driver.find_element(By.ID, name)
        label = driver.find_element(By.CSS_SELECTOR, f"label.switch:has(#{name})")
        assert not box.is_enabled() and not box.is_selected(), name
        assert label.get_attribute("title") == "this index has no BM25" and "off" in label.get_attribute("class")
    assert not _severe(driver)


LONG_TITLE = "Pneumonoultramicroscopicsilicovolcanoconiosis" * 8
LONG_ID = "doc-" + "0123456789abcdef" * 12
HTML_TEXT = 'markup <b>bold</b> & <img src="/nothing.png" alt="x"> stays text'


def odd_docs() -> list[dict]:
    """Documents the page showed wrongly: an unbroken title and id, emoji before the passage that ranks a
    document, words starting with a non-ASCII letter, HTML in a text; metadata to show and filter on."""
    from tests.retrieval.test_passages import long_text

    return [
        {"_id": LONG_ID, "title": LONG_TITLE, "text": "a plain note about green tea"},
        {"_id": "emoji", "title": "smileys", "text": "🙂 " * 40 + long_text(60, 5) + " zorbania " + long_text(60, 6)},
        {"_id": "oeko", "title": "Wald", "text": "Die Ökologie des Waldes und der Ökosysteme",
         "metadata": {"lang": "de", "year": 2020}},
        {"_id": "html", "title": "markup", "text": HTML_TEXT, "metadata": {"note": "<i>x</i>", "tags": ["a", "b"]}},
    ]


@pytest.fixture(scope="module")
def odd_server(tmp_path_factory, encoder):
    """`twotower serve` over a --passages index (with BM25, no reranker) of `odd_docs`, in a directory "odd"."""
    from twotower.retrieval import SearchPipeline

    root = tmp_path_factory.mktemp("odd")
    SearchPipeline.build(write_corpus(str(root / "c.jsonl"), odd_docs()), str(root / "odd"), encoder,
                         passages=True, passage_window=16, passage_stride=12, bm25=True, progress=False).close()
    yield from _serve(str(root / "odd"), root)


def test_a_long_unbroken_title_or_id_does_not_scroll_the_page_sideways(odd_server, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    _open(driver, odd_server + "/")
    _submit(driver, "green tea")
    WebDriverWait(driver, 20).until(lambda d: LONG_ID in (_shown(d) or []))
    try:
        for width in (1100, 420):
            driver.set_window_size(width, 900)
            sideways = driver.execute_script("const e = document.documentElement; return e.scrollWidth - e.clientWidth")
            assert sideways <= 0, (width, sideways)
    finally:
        driver.set_window_size(1100, 1500)


def test_a_passage_snippet_starts_at_its_passage_after_characters_outside_the_bmp(odd_server, browser):
    """passage.start counts code points (Python's); the page sliced UTF-16 units, so the snippet began one unit
    early for each emoji (two units) before the passage."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    hits = httpx.get(odd_server + "/search", params={"q": "zorbania", "k": 10, "recall_k": 100, "hybrid": True,
                                                     "rerank": False, "aggregate": "max"}).json()["hits"]
    hit = next(h for h in hits if h["id"] == "emoji")
    start, end = hit["passage"]["start"], hit["passage"]["end"]
    assert hit["text"][:start].count("🙂") == 40  # the passage that ranked it comes after them
    driver = browser
    _open(driver, odd_server + "/")
    driver.find_element(By.CSS_SELECTOR, "label.switch:has(#hybrid)").click()
    _submit(driver, "zorbania")
    WebDriverWait(driver, 20).until(lambda d: _shown(d) == [h["id"] for h in hits])
    el = driver.find_element(By.CSS_SELECTOR, '#results .hit[data-id="emoji"]')
    assert f"passage at character {start}" in el.find_element(By.CLASS_NAME, "scores").text
    snippet = el.find_element(By.CLASS_NAME, "snippet").text
    assert snippet.removeprefix("… ").startswith(hit["text"][start:end].strip()[:40]), snippet
    assert not _severe(driver)


def test_query_words_starting_with_a_non_ascii_letter_are_marked(odd_server, browser):
    """JavaScript's \\b is ASCII-only: "Ökologie" was never marked.  And the snippet began around the first match
    anywhere in a word ("tea" in "steam") while only matches at a word's start were marked."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    _open(driver, odd_server + "/")
    # hybrid: the passage that ranks the document is one holding the word (its BM25 rank is fused in), whichever
    # passage the random tiny model would put first
    driver.find_element(By.CSS_SELECTOR, "label.switch:has(#hybrid)").click()
    _submit(driver, "Ökologie")
    WebDriverWait(driver, 20).until(lambda d: "oeko" in (_shown(d) or []))
    el = driver.find_element(By.CSS_SELECTOR, '#results .hit[data-id="oeko"] .snippet')
    marked = re.findall("<mark>(.*?)</mark>", el.get_attribute("innerHTML"))
    assert marked and set(marked) == {"Ökologie"}, marked  # not "Ökosysteme"
    html = driver.execute_script("return snippet(arguments[0], queryTerms(arguments[1]))", "Die Ökologie", "ökologie")
    assert html == "Die <mark>Ökologie</mark>"
    text = "steam " + "filler " * 60 + "tea time"
    html = driver.execute_script("return snippet(arguments[0], queryTerms('tea'))", text)
    assert html.startswith("… ") and html.endswith("filler <mark>tea</mark> time"), html
    assert not _severe(driver)


def test_a_hit_opens_to_its_whole_document_and_the_status_names_what_is_searched(odd_server, browser):
    """The page showed neither a whole document nor its metadata, nor which fields a filter may name; its status
    line named a model fingerprint, not the index and models."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    _open(driver, odd_server + "/")
    wait = WebDriverWait(driver, 20)
    status = driver.find_element(By.ID, "status").text
    assert status.startswith("odd · 4 documents") and "no reranker" in status and "BM25 available" in status
    assert "model tiny" in status, status
    assert "lang" in driver.find_element(By.ID, "filter").get_attribute("title")
    _submit(driver, "markup bold")
    wait.until(lambda d: "html" in (_shown(d) or []))
    hit = driver.find_element(By.CSS_SELECTOR, '#results .hit[data-id="html"]')
    assert hit.find_element(By.CSS_SELECTOR, ".chip").get_attribute("title").startswith("final score")
    hit.find_element(By.CSS_SELECTOR, "details.doc summary").click()
    wait.until(lambda d: hit.find_element(By.CSS_SELECTOR, ".doc-text").text == HTML_TEXT)
    assert not hit.find_elements(By.CSS_SELECTOR, ".doc-body img, .doc-body i")  # shown as text, never HTML
    meta = [e.text for e in hit.find_elements(By.CSS_SELECTOR, ".doc-meta dt, .doc-meta dd")]
    assert meta == ["note", "<i>x</i>", "tags", '["a","b"]']
    # from the hit, which holds both: no request queued behind the model thread for what the page has
    fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert not [url for url in fetched if "/documents/" in url], fetched
    assert not _severe(driver)


@pytest.fixture()
def token_server(page_index, tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    yield from _serve(page_index, tmp_path, "--token-file", str(tmp_path / "token"))


def test_with_a_token_configured_the_page_asks_for_it_in_its_box(token_server, browser):
    """The page said "ready" before a token was given, and a search's 401 told the person to send an
    Authorization header."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(token_server + "/")
    wait = WebDriverWait(driver, 20)
    status = driver.find_element(By.ID, "status")
    wait.until(lambda d: "token" in status.text)
    assert status.text == "this server needs a token: enter it in the token box"
    assert driver.find_element(By.ID, "token-row").is_displayed()
    _submit(driver, QUERY)
    wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
    assert driver.find_element(By.ID, "error").text == "401: this server needs a token: enter it in the token box"
    driver.find_element(By.ID, "token").send_keys("s3cret")
    driver.find_element(By.ID, "q").click()  # the token box's change: the page describes the index, searches again
    wait.until(lambda d: "120 documents" in status.text and len(_shown(d) or []) == 10)
    assert not driver.find_element(By.ID, "error").is_displayed() and "s3cret" not in driver.current_url
