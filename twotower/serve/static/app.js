// The search page of `twotower serve`: plain JavaScript, nothing loaded from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { health: null };

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function headers() {
  const token = $("token").value.trim();
  return token ? { Authorization: "Bearer " + token } : {};
}

async function getJson(url) {
  const resp = await fetch(url, { headers: headers() });
  let body = null;
  try { body = await resp.json(); } catch (e) { body = { message: resp.statusText }; }
  return { ok: resp.ok, status: resp.status, body };
}

function showError(body, status) {
  const box = $("error");
  if (!body) { box.hidden = true; box.textContent = ""; return; }
  box.hidden = false;
  box.textContent = (status ? status + ": " : "") + (body.message || "request failed");
}

const STOPWORDS = new Set(("and the for with are was were from that this these those into its not but has have had " +
  "can does did how what which who why when where than then there their them they you your our any all").split(" "));

// Query words worth highlighting: 3+ letters, not a stopword, lower-cased, regex-escaped.
function queryTerms(q) {
  return [...new Set(q.toLowerCase().match(/[\p{L}\p{N}]{3,}/gu) || [])]
    .filter((t) => !STOPWORDS.has(t))
    .map((t) => t.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
}

// About 300 characters of the text, words marked: from `from` (the start of the passage that ranked a document
// split into passages), else starting a little before the first query word.
function snippet(text, terms, width = 300, from = null) {
  text = text || "";
  let start = 0;
  if (from !== null && from !== undefined) {
    start = from;
  } else if (terms.length) {
    const m = new RegExp("(" + terms.join("|") + ")", "iu").exec(text);
    if (m && m.index > 80) start = text.lastIndexOf(" ", m.index - 60) + 1;
  }
  let piece = text.slice(start, start + width);
  if (start + width < text.length) piece = piece.replace(/\s+\S*$/, "") + " …";
  if (start > 0) piece = "… " + piece;
  // Marked on the text, each part escaped: marking the escaped HTML put a word like "amp" inside "&amp;".
  let html = "", last = 0;
  if (terms.length) {
    for (const m of piece.matchAll(new RegExp("\\b(" + terms.join("|") + ")", "giu"))) {
      html += escapeHtml(piece.slice(last, m.index)) + "<mark>" + escapeHtml(m[0]) + "</mark>";
      last = m.index + m[0].length;
    }
  }
  return html + escapeHtml(piece.slice(last));
}

function fmt(x) { return x === null || x === undefined ? "–" : Number(x).toFixed(3); }

function renderHits(data, q) {
  const terms = queryTerms(q);
  const list = $("results");
  list.innerHTML = "";
  for (const h of data.hits) {
    const li = document.createElement("li");
    li.className = "hit";
    li.dataset.id = h.id;
    const chips = [`<span class="chip">score ${fmt(h.score)}</span>`,
                   `<span class="chip plain">first stage #${h.first_stage_rank} · ${fmt(h.first_stage_score)}</span>`];
    if (data.reranked && (h.rerank_score === null || h.rerank_score === undefined)) {
      chips.push(`<span class="chip plain">not reranked (below the reranked depth)</span>`);
    } else if (data.reranked) {
      const moved = h.first_stage_rank - h.rank;
      const cls = moved > 0 ? "up" : moved < 0 ? "down" : "plain";
      const arrow = moved > 0 ? ` ↑${moved}` : moved < 0 ? ` ↓${-moved}` : "";
      chips.push(`<span class="chip ${cls}">reranked #${h.rank}${arrow}</span>`);
      chips.push(`<span class="chip plain">cross-encoder ${fmt(h.rerank_score)}</span>`);
    }
    if (h.passage) chips.push(`<span class="chip plain">passage at character ${h.passage.start}</span>`);
    if (data.hybrid) chips.push(`<span class="chip plain">dense ${fmt(h.dense_score)} · BM25 ${fmt(h.bm25_score)}</span>`);
    li.innerHTML =
      `<div class="rank">${h.rank}</div><div class="body">` +
      `<p class="title">${escapeHtml(h.title || "(untitled)")}<span class="doc-id">${escapeHtml(h.id)}</span></p>` +
      `<p class="snippet">${snippet(h.text, terms, 300, h.passage ? h.passage.start : null)}</p><div class="scores">${chips.join("")}</div></div>`;
    list.appendChild(li);
  }
  const how = (data.hybrid ? "hybrid (dense + BM25)" : "dense") + " recall" + (data.reranked ? ", reranked" : "");
  $("summary").textContent = data.hits.length
    ? `${data.hits.length} hits · ${data.took_ms.toFixed(1)} ms · ${how} · index generation ${data.generation}`
    : `no hits · ${how}`;
}

async function search(event) {
  if (event) event.preventDefault();
  const q = $("q").value;
  if (!q.trim()) { showError({ message: "type a query first" }); return; }
  const params = new URLSearchParams({ q, k: $("k").value, recall_k: $("recall_k").value,
                                       hybrid: $("hybrid").checked, rerank: $("rerank").checked });
  if ($("filter").value.trim()) params.set("filter", $("filter").value);
  if (state.health && state.health.passages) params.set("aggregate", $("aggregate").value);
  if (Number($("recall_k").value) < Number($("k").value)) params.set("recall_k", $("k").value);
  if ($("rerank").checked) params.set("rerank_k", Math.min(Number($("rerank_k").value), Number(params.get("recall_k"))));
  $("go").disabled = true;
  try {
    const r = await getJson("/search?" + params);
    if (!r.ok) { showError(r.body, r.status); return; }
    showError(null);
    renderHits(r.body, q);
  } catch (e) {
    showError({ message: "the server did not answer (" + e + ")" });
  } finally {
    $("go").disabled = false;
  }
}

function setSwitch(id, available, why) {
  const box = $(id);
  box.disabled = !available;
  if (!available) box.checked = false;
  box.parentElement.classList.toggle("off", !available);
  if (!available) box.parentElement.title = why;
}

async function describeIndex() {
  const r = await getJson("/stats");
  if (!r.ok) return;
  const s = r.body;
  $("status").textContent = `${s.documents.toLocaleString()} documents · ${s.index.type} index · model ` +
    `${s.model.fingerprint} · generation ${s.generation}` + (s.reranker.loaded ? " · reranker loaded" : "");
}

async function init() {
  $("token").value = sessionStorage.getItem("twotower-token") || "";
  $("token").addEventListener("change", () => { sessionStorage.setItem("twotower-token", $("token").value); describeIndex(); });
  $("search-form").addEventListener("submit", search);
  let r;
  try { r = await getJson("/health"); } catch (e) { $("status").textContent = "the server is not answering"; return; }
  if (r.body.status === "loading") { $("status").textContent = "loading the index and models…"; setTimeout(init, 1000); return; }
  if (!r.ok) { $("status").textContent = "the index could not be loaded: " + (r.body.error || r.status); return; }
  state.health = r.body;
  $("token-row").hidden = !r.body.auth_required;
  setSwitch("hybrid", r.body.hybrid, "this index has no BM25");
  setSwitch("rerank", r.body.reranker, "no reranker is loaded");
  $("aggregate-row").hidden = !r.body.passages;
  $("rerank").checked = r.body.reranker;
  $("status").textContent = "ready";
  describeIndex();
}

init();
