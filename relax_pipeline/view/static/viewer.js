// The run viewer's page: hash routes #/curves, #/steps/<step>?status=&page=, #/session/<step>/<session_id>,
// #/check, #/bundle (a replay bundle opened directly). Draws from the JSON API of view/app.py; the charts and the
// trace timeline are in charts.js (uPlot, vendored under vendor/uplot; no CDN).
"use strict";

const PAGE_SIZE = 50;
const VERSION_COLORS = ["#cfe2ff", "#ffd8a8", "#c3fae8", "#eebefa", "#ffc9c9", "#d3f9d8", "#fff3bf", "#d0bfff"];
const CHARTS = [
  ["Reward", [/^rollout\/raw_reward$/, /^rollout\/sampled_reward$/]],
  ["Pass rate", [/^passrate$/, /^rollout\/sampled_passrate$/]],
  ["Eval accuracy", [/^eval\/.+\/raw_reward$/]],
  ["Loss", [/^train\/loss$/, /^train\/pg_loss$/]],
  ["KL", [/^train\/kl$/, /^train\/ppo_kl$/]],
  ["Entropy", [/^train\/entropy$/]],
  ["Truncated ratio", [/^rollout\/truncated_ratio$/]],
  ["Fork count", [/^rollout\/fork_count$/]],
  ["Mean version lag", [/^train\/version_lag\/mean$/]],
  ["KL by version lag", [/^train\/version_lag_kl\//]],
  ["Step time (s)", [/^perf\/step_time$/]],
];
const LAG_CHART = "Version lag (share of trained tokens)";
const state = { run: null, extra: [], colorMode: "mask", zoom: {} };

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  return el;
}

async function api(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: ${response.status} ${(await response.json()).detail || ""}`);
  return response.json();
}

const fmt = (v) => (v === null || v === undefined ? "–" : typeof v === "number" ? +v.toPrecision(4) : String(v));

function route() {
  const [path, query] = (location.hash.slice(1) || (state.run && state.run.bundle ? "/bundle" : "/curves")).split("?");
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), query: new URLSearchParams(query || "") };
}

async function render() {
  const view = document.getElementById("view");
  let parts = [];
  try {
    state.run = await api("/api/run");
    header(state.run);
    const where = route();
    parts = where.parts;
    releaseCharts();
    let page;
    if (parts[0] === "session") page = await sessionPage(parts[1], parts.slice(2).join("/"));
    else if (parts[0] === "steps") page = await stepsPage(parts[1], where.query);
    else if (parts[0] === "check") page = await checkPage();
    else if (parts[0] === "bundle") page = await bundlePage();
    else page = await curvesPage();
    view.replaceChildren(page);
  } catch (error) {
    view.replaceChildren(h("p", { class: "card" }, `Could not load: ${error.message}`));
  }
  document.getElementById("nav-bundle").hidden = !(state.run && state.run.bundle);
  document.getElementById("nav-bundle").classList.toggle("active", parts[0] === "bundle");
  document.getElementById("nav-curves").classList.toggle("active", !parts[0] || parts[0] === "curves");
  document.getElementById("nav-sessions").classList.toggle("active", parts[0] === "steps" || parts[0] === "session");
  document.getElementById("nav-check").classList.toggle("active", parts[0] === "check");
}

function header(run) {
  const what = run.bundle ? `replay bundle of step ${run.bundle.step} (format v${run.bundle.format_version})` : `job=${run.job ?? "?"}`;
  document.getElementById("folder").textContent = `${run.folder} · ${what} · model=${run.model ?? "?"}`;
  const ago = run.updated ? Math.max(0, Math.round(run.now - run.updated)) : null;
  document.getElementById("updated").textContent = ago === null ? "nothing written yet" : `last write ${ago}s ago`;
}

// ---- check: the job=check certificate and its worst turn ------------------------------------------------

async function checkPage() {
  let data;
  try {
    data = await api("/api/check");
  } catch (error) {
    return h("p", { class: "card" }, "No certificate in this folder: run python -m relax_pipeline job=check (it writes check/certificate.json).");
  }
  const cert = data.certificate;
  const stages = h("table", { id: "check-stages" }, h("tr", {}, ["stage", "verdict", "summary"].map((x) => h("th", {}, x))),
    cert.stages.map((s) => h("tr", {}, h("td", {}, s.name), h("td", { class: `verdict ${s.verdict}` }, s.verdict), h("td", {}, s.summary))));
  const causes = cert.causes.length
    ? h("table", { id: "check-causes" }, h("tr", {}, ["cause", "turns", "forks", "tokens duplicated", "tokens lost", "share", "fix"].map((x) => h("th", {}, x))),
      cert.causes.map((c) => h("tr", {}, [c.cause, c.turns, c.forks, c.tokens_duplicated, c.tokens_lost, fmt(c.share), c.fix || "–"].map((x) => h("td", {}, x)))))
    : h("p", { class: "muted" }, "No drift: every re-sent history re-renders to the tokens the forest holds.");
  return h("div", {},
    h("h2", {}, "Check: ", h("span", { id: "verdict", class: `verdict ${cert.verdict}` }, cert.verdict), h("span", { class: "muted" }, ` · certificate v${cert.version}`)),
    h("div", { class: "card" }, h("h3", {}, "Stages"), stages),
    h("div", { class: "card" }, h("h3", {}, "Causes"), causes),
    h("div", { class: "card", id: "worst" }, h("h3", {}, "Worst turn"), worstTurn(data.worst)));
}

function worstTurn(turn) {
  if (!turn) return h("p", { class: "muted" }, "No turn drifted.");
  const d = turn.first_difference;
  const side = (label, text) => h("div", { class: "diff-side" }, h("div", { class: "muted" }, label),
    h("pre", {}, marked(text)));
  return h("div", {},
    h("p", {}, `session ${turn.session}, turn ${turn.turn}: ${d.cause}${turn.forked ? " (forked the session)" : " (absorbed, no fork)"}; `,
      `first differing token #${d.token_index}, message #${d.message_index}`),
    h("div", { class: "diff" }, side("held by the forest (what the model saw)", d.held),
      side("re-rendered from what the agent sent", d.rendered)));
}

function marked(text) {
  // certify/drift.py brackets the first differing token as ⟦token⟧ inside its context: mark it.
  const open = text.indexOf("⟦"), close = text.indexOf("⟧", open + 1);
  if (open < 0 || close < 0) return text;
  return [text.slice(0, open), h("mark", { class: "first-diff" }, text.slice(open + 1, close) || "∅"), text.slice(close + 1)];
}

// ---- curves ----------------------------------------------------------------------------------------------

// One card per chart that has data (a chart with no points is left out and named in the toolbar); the charts
// are drawn by charts.js once their cards exist.
async function curvesPage() {
  const { source, curves } = await api("/api/metrics");
  const keys = Object.keys(curves).filter((k) => curves[k].length).sort();
  const used = new Set(keys.filter((k) => k.startsWith("train/version_lag/") && k !== "train/version_lag/mean"));
  const cards = [], empty = [];
  if (used.size) cards.push(chartCard(LAG_CHART, (card) => lagChart(card, curves)));
  for (const [title, patterns] of CHARTS) {
    const series = keys.filter((k) => patterns.some((p) => p.test(k)));
    series.forEach((k) => used.add(k));
    if (series.length) cards.push(chartCard(title, (card) => lineChart(card, series, curves)));
    else empty.push(title);
  }
  for (const key of state.extra) if (curves[key]) cards.push(chartCard(key, (card) => lineChart(card, [key], curves)));
  const others = keys.filter((k) => !used.has(k) && !state.extra.includes(k));
  const pick = h("select", { id: "add-metric", onchange: (e) => { state.extra.push(e.target.value); render(); } },
    h("option", { value: "" }, `add a chart (${others.length} more metrics)…`), others.map((k) => h("option", { value: k }, k)));
  const steps = state.run.steps.filter((s) => s.kind === "train").length;
  return h("div", {},
    h("div", { class: "toolbar" }, h("h2", {}, "Curves"), h("span", { class: "muted" }, `from ${source}, ${steps} step dumps · drag to zoom, double-click to reset`), pick,
      empty.length ? h("span", { class: "muted", id: "no-data" }, `no data: ${empty.join(", ")}`) : null),
    h("div", { class: "charts" }, cards));
}

function chartCard(title, draw) {
  const card = h("div", { class: "card chart", dataset: { chart: title } }, h("h3", {}, title));
  card.uplot = draw(card);
  keepZoom(title, card.uplot);
  return card;
}

// A chart zoomed in stays zoomed when the page is drawn again (Refresh, auto-refresh); zoomed out, it shows new steps.
function keepZoom(title, u) {
  if (state.zoom[title]) u.setScale("x", state.zoom[title]);
  u.hooks.setScale = [(chart, key) => {
    if (key !== "x") return;
    const steps = chart.data[0], { min, max } = chart.scales.x;
    state.zoom[title] = min > steps[0] || max < steps[steps.length - 1] ? { min, max } : null;
  }];
}

// ---- sessions of a step -----------------------------------------------------------------------------------

async function stepsPage(step, query) {
  const steps = state.run.steps;
  if (!steps.length) return h("p", { class: "card" }, "No rollout dump yet: the run writes one per step with debug.save_rollout_data=PATH_{rollout_id}.jsonl.");
  step = step ?? steps[steps.length - 1].id;
  const status = query.get("status") || "";
  const page = Math.max(0, parseInt(query.get("page") || "0", 10));
  const data = await api(`/api/steps/${encodeURIComponent(step)}/sessions?offset=${page * PAGE_SIZE}&limit=${PAGE_SIZE}` + (status ? `&status=${status}` : ""));
  const go = (s, st, p) => `#/steps/${encodeURIComponent(s)}?` + new URLSearchParams({ ...(st ? { status: st } : {}), page: p });
  const picker = h("select", { id: "step", onchange: (e) => { location.hash = go(e.target.value, status, 0); } },
    steps.map((s) => h("option", { value: s.id, selected: s.id === step }, s.kind === "train" ? `step ${s.id}` : s.id)));
  const chips = [h("a", { class: "chip" + (status ? "" : " active"), href: go(step, "", 0), dataset: { status: "" } }, `all (${data.all})`),
    ...state.run.statuses.map((s) => h("a", { class: "chip" + (s === status ? " active" : ""), href: go(step, s, 0), dataset: { status: s } }, `${s} (${data.counts[s]})`))];
  const pages = Math.max(1, Math.ceil(data.total / PAGE_SIZE));
  const pager = h("div", { class: "pager" },
    h("button", { id: "prev", disabled: page === 0, onclick: () => { location.hash = go(step, status, page - 1); } }, "‹ prev"),
    h("span", { id: "page-info" }, `page ${page + 1} of ${pages} · ${data.total} sessions · ${data.rows} rows in the step`),
    h("button", { id: "next", disabled: page + 1 >= pages, onclick: () => { location.hash = go(step, status, page + 1); } }, "next ›"));
  return h("div", {}, h("div", { class: "toolbar" }, h("h2", {}, "Sessions"), picker, chips), sessionTable(step, data.sessions), pager);
}

function sessionTable(step, sessions) {
  const head = h("tr", {}, ["session", "group", "status", "reward", "advantage", "turns", "branches", "reason"].map((c) => h("th", {}, c)));
  const rows = sessions.map((s) => h("tr", {
    class: "session-row", dataset: { session: s.session_id, status: s.status },
    onclick: () => { location.hash = `#/session/${encodeURIComponent(step)}/${encodeURIComponent(s.session_id)}`; },
  },
    h("td", { class: "mono" }, s.session_id), h("td", { class: "mono" }, s.group_id),
    h("td", {}, [...new Set(s.statuses)].map((st) => h("span", { class: `status ${st}` }, st + " "))),
    h("td", {}, s.rewards.map(fmt).join(", ")), h("td", {}, s.advantages.map(fmt).join(", ")),
    h("td", {}, s.turns), h("td", {}, s.branches || ""), h("td", { class: "reason" }, s.error || "")));
  return h("table", { id: "sessions" }, h("thead", {}, head), h("tbody", {}, rows));
}

// ---- a replay bundle opened directly ---------------------------------------------------------------------------

async function bundlePage() {
  const b = await api("/api/bundle");
  const m = b.manifest, step = String(m.step);
  const ref = (c) => (c ? `${c.path} (${Object.keys(c.sha256).join(", ")})` : "none recorded");
  const facts = [["step", m.step], ["format version", m.format_version], ["code version", `${m.code_version?.package ?? "?"} · git ${m.code_version?.git ?? "–"}`],
    ["samples trained", m.samples], ["checkpoint before", ref(m.checkpoint_before)], ["checkpoint after", ref(m.checkpoint_after)]];
  const session = (id) => h("a", { href: `#/session/${encodeURIComponent(step)}/${encodeURIComponent(id)}` }, id);
  const credit = h("table", { id: "credit" }, h("tr", {}, ["group", "session", "slot", "branch / name", "reward", "advantage", "filtered"].map((x) => h("th", {}, x))),
    b.groups.flatMap((g) => g.contexts.map((c) => h("tr", { dataset: { session: c.session_id } }, h("td", { class: "mono" }, g.group_id), h("td", { class: "mono" }, session(c.session_id)),
      h("td", {}, c.slot), h("td", {}, c.name ?? c.branch ?? "–"), h("td", {}, fmt(c.reward)), h("td", { class: "advantage" }, fmt(c.advantage)), h("td", {}, g.filtered || "")))));
  return h("div", {},
    h("div", { class: "toolbar" }, h("h2", {}, `Replay bundle: step ${step}`), h("a", { href: `#/steps/${encodeURIComponent(step)}` }, "its sessions ›"),
      h("span", { class: "muted" }, `re-run it: python -m relax_pipeline job=replay replay.bundle=${b.folder}`)),
    h("div", { class: "card" }, h("h3", {}, "Bundle"), h("dl", { class: "kv", id: "bundle-facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]))),
    h("div", { class: "card" }, h("h3", {}, "Loss and metrics"), h("dl", { class: "kv", id: "bundle-metrics" }, b.metrics.map(([k, v]) => [h("dt", {}, k), h("dd", {}, fmt(v))]))),
    h("div", { class: "card" }, h("h3", {}, `Credit: ${b.groups.length} groups`), credit));
}

// ---- one session --------------------------------------------------------------------------------------------

async function sessionPage(step, sessionId) {
  const s = await api(`/api/steps/${encodeURIComponent(step)}/sessions/${encodeURIComponent(sessionId)}`);
  const back = h("a", { href: `#/steps/${encodeURIComponent(step)}` }, `‹ step ${step}`);
  const forks = s.forks.length
    ? h("ul", { id: "forks" }, s.forks.map((f) => h("li", {}, `turn ${f.turn}: ${f.why}`)))
    : h("p", { class: "muted" }, "no fork recorded in run.log");
  const modes = { mask: " loss mask", version: " weight version", lag: " version lag" };
  const mode = h("div", { class: "toolbar", id: "color-mode" }, h("strong", {}, "token colour:"),
    Object.entries(modes).map(([m, label]) => h("label", {}, h("input", { type: "radio", name: "mode", value: m, checked: state.colorMode === m,
      onchange: () => { state.colorMode = m; document.getElementById("contexts").className = `color-${m}`; } }), label)),
    h("span", { class: "legend" }, h("i", { style: "background:#c7ecd2" }), "loss 1 (generated)", h("i", { style: "background:#e4e8ee" }), "loss 0 (observation)",
      h("span", { class: "muted" }, " · prompt tokens grey text · hover a token for its logprob")), lagLegend(s.trained_version));
  const trace = h("div", { class: "card", id: "trace" }, h("h3", {}, "Trace"), h("p", { class: "muted" }, "loading…"));
  api(`/api/steps/${encodeURIComponent(step)}/sessions/${encodeURIComponent(sessionId)}/trace`)
    .then((t) => trace.replaceChildren(h("h3", {}, "Trace ", h("span", { class: "muted" }, `${t.file} · ${t.spans.length} spans · ${fmt(t.duration_ms)} ms · hover a span, click one to zoom to it, double-click for the whole trace`)), timelineView(t, s.trained_version)))
    .catch((error) => trace.replaceChildren(h("h3", {}, "Trace"), h("p", { class: "muted", id: "no-trace" },
      !/^\d+$/.test(step) ? "eval sessions are not traced" : / 404 /.test(error.message) ? "no trace recorded (tracking.traces=false?)" : `Could not load the trace: ${error.message}`)));
  return h("div", {},
    h("div", { class: "toolbar" }, back, h("h2", {}, `Session ${s.session_id}`), h("span", { class: "muted" }, `group ${s.group_id} · tokens decoded with ${s.tokenizer}`)),
    h("div", { class: "card" }, h("h3", {}, "Forest"), renderTree(s.tree, s.contexts), h("h3", {}, "Fork records"), forks),
    trace, mode, h("div", { id: "contexts", class: `color-${state.colorMode}` }, s.contexts.map((c, i) => renderContext(c, i, s.trained_version))));
}

function lagLegend(trained) {
  if (trained === null || trained === undefined) return h("span", { class: "legend lag muted" }, "(no version lag: nothing trained on this dump)");
  return h("span", { class: "legend lag" }, `version lag (v${trained}, the weights this step trained, minus the token's version):`,
    LAG_KEYS.map((k, i) => [h("i", { style: `background:${LAG_COLORS[i]}` }), k]));
}

function leafLabel(c) {
  const which = c.name ? `context ${c.name}` : c.branch !== null && c.branch !== undefined ? `branch ${c.branch}` : "context";
  return `${which} · ${c.status} · reward ${fmt(c.reward)} · adv ${fmt(c.advantage)}`;
}

function renderTree(nodes, contexts) {
  const item = (node) => h("li", { class: "node", dataset: { node: node.id, depth: node.depth } },
    h("span", { class: `role ${node.role}` }, node.role), node.text,
    node.forks.length || node.children.length > 1 ? h("span", { class: "fork", title: node.forks.join("\n") }, `fork${node.forks.length ? ": " + node.forks.join("; ") : ""}`) : null,
    node.contexts.map((i) => h("a", { class: "leaf", href: `#ctx-${i}`, dataset: { context: i },
      onclick: (e) => { e.preventDefault(); document.getElementById(`ctx-${i}`).scrollIntoView(); } }, leafLabel(contexts[i]))),
    node.children.length ? h("ul", {}, node.children.map((id) => item(nodes[id]))) : null);
  const root = nodes[0];
  if (!root.children.length) return h("p", { class: "muted" }, "no messages: the session failed or was dropped before it exported anything");
  return h("ul", { class: "tree", id: "tree" }, root.children.map((id) => item(nodes[id])));
}

function renderContext(c, i, trained) {
  const turns = (c.timing && c.timing.turns) || [];
  const fields = [["status", h("span", { class: `status ${c.status}` }, c.status)], ["reward", fmt(c.reward)], ["advantage", fmt(c.advantage)],
    ["prompt / response tokens", `${c.prompt_length} / ${c.response_length}`], ["turns", c.turn_count], ["aborts", c.abort_count],
    ["error", c.error || "–"], ["metadata", JSON.stringify(c.metadata)]];
  const timing = turns.length ? h("table", { class: "timing" }, h("tr", {}, ["turn", "queue ms", "generation ms", "total ms"].map((x) => h("th", {}, x))),
    turns.map((t, n) => h("tr", {}, h("td", {}, n + 1), h("td", {}, fmt(t.queue_ms)), h("td", {}, fmt(t.generation_ms)), h("td", {}, fmt(t.total_ms))))) : null;
  const messages = h("details", {}, h("summary", {}, `${(c.messages || []).length} messages`),
    (c.messages || []).map((m) => h("div", { class: `msg ${m.role}` }, h("strong", {}, m.role + ": "), messageBody(m))));
  return h("div", { class: "card context", id: `ctx-${i}`, dataset: { context: i, branch: c.branch ?? "" } },
    h("h3", {}, leafLabel(c)), h("dl", { class: "kv" }, fields.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    timing, messages, versionLegend(c), tokenStrip(c, trained));
}

function messageBody(m) {
  const parts = [];
  if (m.reasoning_content) parts.push(`[reasoning] ${m.reasoning_content}\n`);
  if (typeof m.content === "string") parts.push(m.content);
  else if (Array.isArray(m.content)) parts.push(m.content.map((p) => (p.type === "text" ? p.text : `[${p.type}]`)).join(" "));
  for (const call of m.tool_calls || []) parts.push(`\n[tool call] ${call.function?.name}(${call.function?.arguments})`);
  return parts.join("");
}

function versionLegend(c) {
  const versions = [...new Set(c.weight_versions)].sort((a, b) => a - b);
  return h("div", { class: "legend versions" }, "weight versions:", versions.map((v) => [h("span", { class: "swatch", style: `background:${VERSION_COLORS[v % VERSION_COLORS.length]}` }), `v${v}`]));
}

function tokenStrip(c, trained) {
  const strip = h("div", { class: "tokens" });
  const P = c.prompt_length;
  c.pieces.forEach((piece, i) => {
    const r = i - P;
    const text = piece.replace(/\n/g, "↵\n");
    if (r < 0) { strip.append(h("span", { class: "tok prompt", dataset: { i, id: c.tokens[i] } }, text)); return; }
    const v = c.weight_versions[r];
    const lag = trained === null || trained === undefined || v === undefined ? "" : trained - v;
    strip.append(h("span", {
      class: `tok resp m${c.loss_mask[r]}`, style: `--vc:${VERSION_COLORS[v % VERSION_COLORS.length]};--lc:${lag === "" ? "transparent" : lagColor(lag)}`,
      dataset: { i, id: c.tokens[i], mask: c.loss_mask[r], lp: c.rollout_logprobs[r], v, lag },
    }, text));
  });
  return strip;
}

function tooltip(event) {
  const tip = document.getElementById("tip");
  const tok = event.target.closest && event.target.closest(".tok, .span");
  if (!tok) { tip.hidden = true; return; }
  const d = tok.dataset, piece = JSON.stringify(tok.textContent.replace(/↵\n/g, "\n"));
  if (d.tip) tip.textContent = d.tip;
  else tip.textContent = d.mask === undefined
    ? `token ${d.i} · id ${d.id} · ${piece}\nprompt token`
    : `token ${d.i} · id ${d.id} · ${piece}\nlogprob ${(+d.lp).toFixed(4)} · loss mask ${d.mask} · weight v${d.v}` + (d.lag === "" ? "" : ` · lag ${d.lag}`);
  tip.style.left = `${event.clientX + 12}px`;
  tip.style.top = `${event.clientY + 14}px`;
  tip.hidden = false;
}

// ---- wiring -------------------------------------------------------------------------------------------------

let timer = null;
document.addEventListener("mouseover", tooltip);
document.addEventListener("mousemove", (e) => { if (!document.getElementById("tip").hidden) tooltip(e); });
window.addEventListener("hashchange", render);
document.getElementById("refresh").addEventListener("click", render);
document.getElementById("auto").addEventListener("change", (e) => {
  clearInterval(timer);
  if (e.target.checked) timer = setInterval(() => { if (route().parts[0] !== "session") render(); }, 5000);
});
render();
