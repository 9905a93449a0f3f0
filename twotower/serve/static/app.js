// The search page of `twotower serve`: plain JavaScript, nothing loaded from elsewhere (the server's
// Content-Security-Policy refuses that, and inline script and style too: no style="" in the markup made here).
"use strict";

const $ = (id) => document.getElementById(id);
// seq numbers the searches: an answer to any but the newest is dropped, so a slow first search cannot overwrite
// a second one's hits.  inflight aborts the newest one's fetch when another starts.  searched: a query has
// been searched, so changing an option searches again.
const state = { health: null, seq: 0, inflight: null, searched: false };
// The options a search puts in the page's URL, under the names /search takes: a search can be bookmarked,
// shared and gone back to.  Never the token: URLs end up in histories, logs and Referer headers.
const URL_PARAMS = ["q", "k", "recall_k", "hybrid", "bm25", "rerank", "rerank_k", "filter", "aggregate"];
// Changing one of these after a search searches again (the filter box waits for Enter, as the query box does).
const RERUN_ON_CHANGE = ["hybrid", "bm25", "rerank", "k", "recall_k", "rerank_k", "aggregate"];

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function headers() {
  const token = $("token").value.trim();
  return token ? { Authorization: "Bearer " + token } : {};
}

async function getJson(url, signal) {
  const resp = await fetch(url, { headers: headers(), signal });
  let body = null;
  try { body = await resp.json(); } catch (e) { body = { message: resp.statusText }; }
  return { ok: resp.ok, status: resp.status, body };
}

// The server's 401 tells an API client to send an Authorization header; a person here has a box for it.
function tokenProblem() {
  return $("token").value.trim() ? "the server refused the token in the token box; check it"
                                  : "this server needs a token: enter it in the token box";
}

function showError(body, status) {
  const box = $("error");
  if (!body) { box.hidden = true; box.textContent = ""; return; }
  box.hidden = false;
  const message = status === 401 ? tokenProblem() : (body.message || "request failed");
  box.textContent = (status ? status + ": " : "") + message;
}

// While a search runs: its query in the summary (announced: #summary is a status region) and the old hits
// marked busy (dimmed, and not read out as if they answered it).
function setBusy(q) {
  $("results").setAttribute("aria-busy", q === null ? "false" : "true");
  if (q !== null) $("summary").textContent = `searching for “${q}”…`;
}

// Every failed search clears the hits and summary: they answered another query, and left under the error they
// read as this one's.
function fail(body, status) {
  setBusy(null);
  $("results").innerHTML = "";
  $("summary").textContent = "";
  showError(body, status);
}

const STOPWORDS = new Set(("and the for with are was were from that this these those into its not but has have had " +
  "can does did how what which who why when where than then there their them they you your our any all").split(" "));

// Query words worth highlighting: 3+ letters, not a stopword, lower-cased, regex-escaped.
function queryTerms(q) {
  return [...new Set(q.toLowerCase().match(/[\p{L}\p{N}]{3,}/gu) || [])]
    .filter((t) => !STOPWORDS.has(t))
    .map((t) => t.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
}

// A query word where a word starts (not "tea" inside "steam"), the one rule for where the snippet starts and
// what it marks.  Not \b: JavaScript's is ASCII-only even with the u flag, so "Ökologie" never matched.
function wordStart(terms, flags) {
  return new RegExp("(?<![\\p{L}\\p{N}])(?:" + terms.join("|") + ")", flags);
}

// The JavaScript string index (UTF-16 units) of code point `cp` of `text`: the server's passage offsets count
// code points (Python's), and each character outside the BMP (an emoji, say) is two units here.
function utf16Index(text, cp) {
  let i = 0;
  for (let n = 0; n < cp && i < text.length; n++) i += text.codePointAt(i) > 0xffff ? 2 : 1;
  return i;
}

// About 300 characters of the text, words marked: from code point `from` (the start of the passage that ranked
// a document split into passages), else starting a little before the first query word.
function snippet(text, terms, width = 300, from = null) {
  text = text || "";
  let start = 0;
  if (from !== null && from !== undefined) {
    start = utf16Index(text, from);
  } else if (terms.length) {
    const m = wordStart(terms, "iu").exec(text);
    if (m && m.index > 80) start = text.lastIndexOf(" ", m.index - 60) + 1;
  }
  let piece = text.slice(start, start + width).replace(/[\uD800-\uDBFF]$/, "");  // not half a character
  if (start + width < text.length) piece = piece.replace(/\s+\S*$/, "") + " …";
  if (start > 0) piece = "… " + piece;
  // Marked on the text, each part escaped: marking the escaped HTML put a word like "amp" inside "&amp;".
  let html = "", last = 0;
  if (terms.length) {
    for (const m of piece.matchAll(wordStart(terms, "giu"))) {
      html += escapeHtml(piece.slice(last, m.index)) + "<mark>" + escapeHtml(m[0]) + "</mark>";
      last = m.index + m[0].length;
    }
  }
  return html + escapeHtml(piece.slice(last));
}

function fmt(x) { return x === null || x === undefined ? "–" : Number(x).toFixed(3); }

function chip(cls, text, title) {
  return `<span class="chip ${cls}" title="${escapeHtml(title)}">${escapeHtml(text)}</span>`;
}

// The chips of one hit, each with a tooltip saying what its number is.
function scoreChips(h, data) {
  const reranked = data.reranked && h.rerank_score !== null && h.rerank_score !== undefined;
  const first = data.hybrid ? "reciprocal rank fusion (RRF) of the dense and BM25 lists"
    : data.bm25 ? "BM25 score of the query's words in the document (no dense recall)"
      : "dense similarity of query and document (the index's metric)";
  const chips = [
    chip("", `score ${fmt(h.score)}`, reranked
      ? "final score: the cross-encoder score interpolated with the first-stage score (each z-scored, weighted by " +
        "the reranker's alpha); the hits are in its order"
      : data.reranked ? "final score: below the reranked depth, the hit keeps its first-stage place"
        : "final score: the first-stage score (not reranked)"),
    chip("plain", `first stage #${h.first_stage_rank} · ${fmt(h.first_stage_score)}`,
         `first-stage rank and score: ${first}` +
         (h.passage ? "; of a document split into passages, its passages' scores combined as the passages " +
                      "menu says" : "")),
  ];
  if (data.reranked && !reranked) {
    chips.push(chip("plain", "not reranked (below the reranked depth)",
                    "the cross-encoder scored only the first stage's top candidates (the reranked menu)"));
  } else if (data.reranked) {
    const moved = h.first_stage_rank - h.rank;
    const cls = moved > 0 ? "up" : moved < 0 ? "down" : "plain";
    const arrow = moved > 0 ? ` ↑${moved}` : moved < 0 ? ` ↓${-moved}` : "";
    chips.push(chip(cls, `reranked #${h.rank}${arrow}`,
                    "rank after reranking, and how far it moved from its first-stage rank"));
    chips.push(chip("plain", `cross-encoder ${fmt(h.rerank_score)}`,
                    "the cross-encoder's score of the query and this document"));
  }
  if (h.passage) {
    chips.push(chip("plain", `passage at character ${h.passage.start}`,
                    "the passage that ranked the document starts at this character of its text"));
  }
  if (data.hybrid) {
    chips.push(chip("plain", `dense ${fmt(h.dense_score)} · BM25 ${fmt(h.bm25_score)}`,
                    "the dense similarity and BM25 score fused into the first stage (– where that list did not " +
                    "retrieve it)"));
  }
  return chips.join("");
}

// A <details> with the whole document and its metadata, as the search returned them (each hit holds both, from
// the index generation the search read), built when first opened.  Its content is set as text, never as HTML:
// documents are data.
function documentView(h, generation) {
  const more = document.createElement("details");
  more.className = "doc";
  const label = document.createElement("summary");
  label.textContent = "whole document and metadata";
  const box = document.createElement("div");
  box.className = "doc-body";
  more.append(label, box);
  more.addEventListener("toggle", () => {
    if (!more.open || more.dataset.loaded) return;
    more.dataset.loaded = "yes";
    const text = document.createElement("p");
    text.className = "doc-text";
    text.textContent = h.text;
    const meta = document.createElement("dl");
    meta.className = "doc-meta";
    const entries = Object.entries(h.metadata || {});
    for (const [key, value] of entries) {
      const dt = document.createElement("dt");
      dt.textContent = key;
      const dd = document.createElement("dd");
      dd.textContent = typeof value === "string" ? value : JSON.stringify(value);
      meta.append(dt, dd);
    }
    const note = document.createElement("p");
    note.className = "muted";
    note.textContent = (entries.length ? "" : "no metadata · ") + `index generation ${generation}`;
    box.append(text, ...(entries.length ? [meta] : []), note);
  });
  return more;
}

function renderHits(data) {
  const terms = queryTerms(data.query);
  const list = $("results");
  list.innerHTML = "";
  for (const h of data.hits) {
    const li = document.createElement("li");
    li.className = "hit";
    li.dataset.id = h.id;
    li.innerHTML =
      `<div class="rank">${h.rank}</div><div class="body">` +
      `<p class="title">${escapeHtml(h.title || "(untitled)")}<span class="doc-id">${escapeHtml(h.id)}</span></p>` +
      `<p class="snippet">${snippet(h.text, terms, 300, h.passage ? h.passage.start : null)}</p>` +
      `<div class="scores">${scoreChips(h, data)}</div></div>`;
    li.querySelector(".body").append(documentView(h, data.generation));
    list.appendChild(li);
  }
  const how = (data.hybrid ? "hybrid (dense + BM25)" : data.bm25 ? "BM25" : "dense") + " recall" +
    (data.reranked ? ", reranked" : "");
  const what = `for “${data.query}”`;  // the query these hits answer, whatever the box says now
  const took = `${data.took_ms.toFixed(1)} ms`;
  $("summary").textContent = data.hits.length
    ? `${data.hits.length} hits ${what} · ${took} · ${how} · index generation ${data.generation}`
    : `no hits ${what} · ${how}`;
}

// The /search parameters of the options now set; the page's URL holds the same.
function searchParams(q) {
  const params = new URLSearchParams({ q, k: $("k").value, recall_k: $("recall_k").value,
                                       hybrid: $("hybrid").checked, bm25: $("bm25").checked,
                                       rerank: $("rerank").checked });
  if ($("filter").value.trim()) params.set("filter", $("filter").value);
  if (state.health && state.health.passages) params.set("aggregate", $("aggregate").value);
  if (Number($("recall_k").value) < Number($("k").value)) params.set("recall_k", $("k").value);
  if ($("rerank").checked) {
    params.set("rerank_k", Math.min(Number($("rerank_k").value), Number(params.get("recall_k"))));
  }
  return params;
}

// The button stays enabled while a search runs: a browser does not submit a form on Enter while its submit
// button is disabled, so a second query was dropped and the first one's hits stayed under it.
async function search(event, push = true) {
  if (event) event.preventDefault();
  const seq = ++state.seq;
  if (state.inflight) state.inflight.abort();
  state.inflight = null;
  const q = $("q").value;
  if (!q.trim()) { fail({ message: "type a query first" }); return; }
  const params = searchParams(q);
  state.searched = true;
  if (push && "?" + params !== location.search) history.pushState(null, "", "?" + params);
  const ctrl = new AbortController();
  state.inflight = ctrl;
  setBusy(q);
  try {
    const r = await getJson("/search?" + params, ctrl.signal);
    if (seq !== state.seq) return;
    if (!r.ok) { fail(r.body, r.status); return; }
    showError(null);
    renderHits(r.body);
    setBusy(null);
  } catch (e) {
    if (seq !== state.seq) return;  // aborted by a newer search, which shows its own answer
    fail({ message: "the server did not answer (" + e + ")" });
  } finally {
    if (seq === state.seq) state.inflight = null;
  }
}

// Sets a menu from a URL; a number the menu lacks (a hand-written link) is added to it.
function choose(id, value) {
  const sel = $(id);
  if (![...sel.options].some((o) => o.value === value)) {
    if (id === "aggregate" || !/^[1-9][0-9]{0,4}$/.test(value)) return;
    sel.add(new Option(value));
  }
  sel.value = value;
}

// The options of the page's URL into the controls; a switch the index cannot use stays off.
function fillControls(p) {
  $("q").value = p.get("q") || "";
  $("filter").value = p.get("filter") || "";
  for (const id of ["k", "recall_k", "rerank_k", "aggregate"]) if (p.has(id)) choose(id, p.get(id));
  for (const id of ["hybrid", "bm25", "rerank"]) {  // as /search reads a boolean
    if (p.has(id)) $(id).checked = ["true", "1", "yes", "on", "t", "y"].includes(p.get(id).toLowerCase()) && !$(id).disabled;
  }
  if ($("hybrid").checked && $("bm25").checked) $("bm25").checked = false;  // a URL asking for both: the hybrid (BM25 in it)
  syncRerankK();
}

// Shows the search the URL names (on load, and going back or forward), or an empty page when it names none.
function searchFromUrl() {
  const p = new URLSearchParams(location.search);
  if (!URL_PARAMS.some((name) => p.has(name)) && !state.searched) return;  // keep what was typed while connecting
  fillControls(p);
  if ($("q").value.trim()) { search(null, false); return; }
  state.seq++;
  if (state.inflight) state.inflight.abort();
  state.searched = false;
  setBusy(null);
  $("results").innerHTML = "";
  $("summary").textContent = "";
  showError(null);
}

// "reranked" (rerank_k) means nothing when the cross-encoder does not run.
function syncRerankK() {
  $("rerank_k").disabled = !$("rerank").checked;
}

function setSwitch(id, available, why) {
  const box = $(id);
  box.disabled = !available;
  if (!available) box.checked = false;
  box.parentElement.classList.toggle("off", !available);
  if (!available) box.parentElement.title = why;
}

// A path's last part: the status line names the index directory and the models, not where they lie.
function baseName(path) {
  return path ? String(path).replace(/[\\/]+$/, "").split(/[\\/]/).pop() : null;
}

async function describeIndex() {
  let r;
  try { r = await getJson("/stats"); } catch (e) { return; }
  if (r.status === 401) { $("status").textContent = tokenProblem(); return; }
  if (!r.ok) return;
  const s = r.body;
  const model = s.model.name || s.model.fingerprint;
  $("status").textContent = [baseName(s.index.directory), `${s.documents.toLocaleString()} documents`,
    `${s.index.type} index`, `model ${model}`,
    s.reranker.loaded ? `reranker ${baseName(s.reranker.source) || "loaded"}` : "no reranker",
    s.index.bm25 ? "BM25 available" : "no BM25 (dense only)", `generation ${s.generation}`,
  ].filter(Boolean).join(" · ");
  $("status").title = `index ${s.index.directory} · model ${s.model.source || "(from the index)"} ` +
    `(fingerprint ${s.model.fingerprint})` + (s.reranker.loaded ? ` · reranker ${s.reranker.source}` : "");
  const fields = s.index.metadata_fields;
  if (Array.isArray(fields)) {  // the fields a filter may name
    const filter = $("filter");
    const more = s.index.metadata_field_count > fields.length ? `, … (${s.index.metadata_field_count} in all)` : "";
    filter.placeholder = fields.length ? "fields: " + fields.slice(0, 4).join(", ") + (fields.length > 4 ? ", …" : "")
                                       : "no metadata in this index";
    filter.title = fields.length ? "metadata fields of this index: " + fields.join(", ") + more
                                 : "no document of this index has metadata to filter on";
  }
}

// /health until the server answers: a server still starting (or restarting) is asked again, less often each time.
async function connect(delay = 1000) {
  let r;
  try { r = await getJson("/health"); } catch (e) { r = null; }
  if (!r || (!r.ok && !(r.body && r.body.status))) {  // no answer, or not the service's
    $("status").textContent = `the server is not answering; trying again in ${Math.round(delay / 1000)} s`;
    setTimeout(() => connect(Math.min(delay * 2, 30000)), delay);
    return;
  }
  if (r.body.status === "loading") {
    $("status").textContent = "loading the index and models…";
    setTimeout(connect, 1000);
    return;
  }
  if (!r.ok) { $("status").textContent = "the index could not be loaded: " + (r.body.error || r.status); return; }
  state.health = r.body;
  $("token-row").hidden = !r.body.auth_required;
  setSwitch("hybrid", r.body.hybrid, "this index has no BM25");
  setSwitch("bm25", r.body.bm25, "this index has no BM25");
  setSwitch("rerank", r.body.reranker, "no reranker is loaded");
  $("aggregate-row").hidden = !r.body.passages;
  $("rerank").checked = r.body.reranker;
  syncRerankK();
  $("status").textContent = r.body.auth_required && !$("token").value.trim() ? tokenProblem() : "ready";
  describeIndex();
  searchFromUrl();
}

function init() {
  $("token").value = sessionStorage.getItem("twotower-token") || "";
  $("token").addEventListener("change", () => {
    sessionStorage.setItem("twotower-token", $("token").value);
    describeIndex();
    if (state.searched && $("q").value.trim()) search(null, false);
  });
  $("search-form").addEventListener("submit", search);
  $("rerank").addEventListener("change", syncRerankK);
  // Hybrid fuses BM25 with dense recall, "BM25 only" drops dense recall: turning one on turns the other off
  // (before the search below reads them: a property set by script fires no change of its own).
  for (const [id, other] of [["hybrid", "bm25"], ["bm25", "hybrid"]]) {
    $(id).addEventListener("change", () => { if ($(id).checked) $(other).checked = false; });
  }
  for (const id of RERUN_ON_CHANGE) {
    $(id).addEventListener("change", () => { if (state.searched && $("q").value.trim()) search(); });
  }
  window.addEventListener("popstate", () => { if (state.health) searchFromUrl(); });
  connect();
}

init();
