"""The search page in a real browser: `twotower serve` in a subprocess, headless Debian Chromium via Selenium.

Types a query, waits for the hits, checks what each shows (title, snippet, final score,
first-stage and reranked rank) and saves a screenshot (``$TWOTOWER_SCREENSHOT_DIR`` keeps a
copy).  Skipped only where Chromium is absent outside CI; in CI (``CI=true``) it must run:
.ci/run installs ``chromium`` and ``chromium-driver``.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
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


@pytest.fixture()
def server(page_index, reranker_dir, tmp_path):
    yield from _serve(page_index, tmp_path, "--reranker", reranker_dir)


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
