// The run viewer's charts: metric curves and the stacked version-lag chart on uPlot (vendor/uplot, MIT, shipped
// in the package), and a session's trace as a timeline (plain DOM). viewer.js builds the pages around them.
// uPlot gives round ticks, a live legend (the value under the cursor), drag-to-zoom and double-click to reset;
// this file only adds what a run's metrics need: step ticks, labels sized to fit, one colour per version lag.
"use strict";

const COLORS = ["#2463c9", "#d9480f", "#2b8a3e", "#862e9c", "#c92a2a", "#0b7285", "#5f3dc4", "#e67700"];
const LAG_KEYS = ["0", "1", "2", "3", "4+"];
const LAG_COLORS = ["#8ce99a", "#ffe066", "#ffa94d", "#ff8787", "#da77f2"];
const LAG_STROKES = ["#2b8a3e", "#e67700", "#d9480f", "#c92a2a", "#862e9c"];
const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];
const CHART_HEIGHT = 190;
const chartObservers = [];

const lagIndex = (lag) => Math.min(Math.max(lag, 0), LAG_KEYS.length - 1);
const lagColor = (lag) => LAG_COLORS[lagIndex(lag)];

// Tick labels that tell every tick apart and no more: `place` is the last digit the increment needs (0.25 → the
// hundredths, 5 → the units); fixed decimals to that place, exponent notation for tiny values (2.5e-8), compact
// for large increments (1.025M).
function tickLabels(u, splits, axisIdx, space, incr) {
  const top = Math.max(...splits.map((v) => Math.abs(v ?? 0)));
  const power = Math.floor(Math.log10(incr));
  const place = power - (+(incr / 10 ** power).toFixed(3) % 1 ? 1 : 0);
  const digits = Math.max(1, Math.floor(Math.log10(top || incr)) - place + 1);
  const label = top < 1e-4 ? (v) => v.toExponential(Math.min(20, digits - 1))
    : place >= 4 ? (v) => new Intl.NumberFormat("en-US", { notation: "compact", maximumSignificantDigits: Math.min(21, digits) }).format(v)
    : (v) => v.toFixed(Math.min(100, Math.max(0, -place)));
  return splits.map((v) => (v == null ? "" : Math.abs(v) < incr / 1e6 ? "0" : label(v)));
}

// A flat series gets a band around its value (uPlot's own default for a constant 0 is 0 to 100).
function yRange(u, min, max) {
  if (min !== max) return uPlot.rangeNum(min, max, 0.1, true);
  const pad = Math.abs(min) * 0.1 || 1;
  return [min - pad, max + pad];
}

// The y axis is as wide as its longest label (uPlot's fixed default clips "-12,345.5" at the left edge).
function axisSize(u, values, axisIdx, cycleNum) {
  const axis = u.axes[axisIdx];
  if (cycleNum > 1) return axis._size;
  const longest = (values || []).reduce((a, v) => (String(v).length > a.length ? String(v) : a), "");
  u.ctx.font = axis.font[0];
  const text = longest ? u.ctx.measureText(longest).width / devicePixelRatio : 0;
  return Math.ceil(axis.ticks.size + axis.gap + text + 6);
}

const xAxis = () => ({ label: "step", incrs: STEP_INCRS, labelSize: 14, size: 34 });
const yAxis = (values = tickLabels) => ({ values, size: axisSize });

// Step-aligned columns for uPlot: [steps, one array per series with null where a series has no point].
function columns(keys, curves) {
  const steps = [...new Set(keys.flatMap((k) => curves[k].map((p) => p[0])))].sort((a, b) => a - b);
  return [steps, ...keys.map((k) => { const at = new Map(curves[k]); return steps.map((s) => (at.has(s) ? at.get(s) : null)); })];
}

// Keep a chart as wide as its card (the card gets its width once the page is in the document).
function fitWidth(u, card) {
  const observer = new ResizeObserver(([entry]) => {
    const width = Math.floor(entry.contentRect.width);
    if (width > 0 && width !== u.width) u.setSize({ width, height: CHART_HEIGHT });
  });
  observer.observe(card);
  chartObservers.push(observer);
}

function releaseCharts() {
  chartObservers.splice(0).forEach((o) => o.disconnect());
}

function lineChart(card, keys, curves) {
  const series = keys.map((k, i) => ({ label: k, stroke: COLORS[i % COLORS.length], width: 1.6, spanGaps: true,
    points: { size: 5 }, value: (u, v) => fmt(v) }));
  const opts = { width: 340, height: CHART_HEIGHT, scales: { x: { time: false }, y: { range: yRange } }, axes: [xAxis(), yAxis()],
    series: [{ label: "step", value: (u, v) => (v == null ? "–" : v) }, ...series], cursor: { drag: { x: true, y: false } } };
  const u = new uPlot(opts, columns(keys, curves), card);
  fitWidth(u, card);
  return u;
}

// Shares of the trained tokens by version lag, stacked to 100%: each series is the running total up to its lag,
// drawn oldest first and filled down to 0, so the younger lags paint over it; the legend shows each share itself.
function lagChart(card, curves) {
  const keys = LAG_KEYS.map((k) => `train/version_lag/${k}`).filter((k) => curves[k]);
  const [steps, ...shares] = columns(keys, curves);
  const totals = shares.map((_, i) => steps.map((_, j) => shares.slice(0, i + 1).reduce((a, s) => a + (s[j] || 0), 0)));
  const order = keys.map((_, i) => i).reverse();
  const series = order.map((i) => {
    const lag = LAG_KEYS.indexOf(keys[i].split("/").pop());
    return { label: `lag ${LAG_KEYS[lag]}`, stroke: LAG_STROKES[lag], fill: LAG_COLORS[lag], width: 1, points: { show: false },
      value: (u, v, si, j) => (j == null || shares[i][j] == null ? "–" : `${(100 * shares[i][j]).toFixed(1)}%`) };
  });
  const percent = (u, splits) => splits.map((v) => `${Math.round(v * 100)}%`);
  const opts = { width: 340, height: CHART_HEIGHT, scales: { x: { time: false }, y: { range: [0, 1] } },
    axes: [xAxis(), yAxis(percent)], series: [{ label: "step" }, ...series], cursor: { drag: { x: true, y: false } } };
  const u = new uPlot(opts, [steps, ...order.map((i) => totals[i])], card);
  fitWidth(u, card);
  return u;
}

// ---- a session's trace as a timeline ----------------------------------------------------------------------

const TIMELINE_ROW = 22;

// A round tick step for `range` split into about `count` parts (1, 2 or 5 × 10^k).
function niceStep(range, count) {
  const raw = range / count, mag = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
}

function spanTitle(s) {
  const attrs = Object.entries(s.attributes).map(([k, v]) => `${k} = ${JSON.stringify(v)}`);
  return [`${s.name} · ${fmt(s.end_ms - s.start_ms)} ms (from +${fmt(s.start_ms)} ms)`, ...attrs].join("\n");
}

// One bar per span, a row per depth (overlapping spans of a depth get rows of their own, server side); turn spans
// are coloured by their weight version's lag behind `trainedVersion` when both are known. Clicking a span zooms the
// timeline to it; double-click shows the whole trace again.
function timelineView(trace, trainedVersion) {
  const total = trace.duration_ms || 1;
  const bars = h("div", { class: "bars", style: `height:${trace.rows * TIMELINE_ROW}px` });
  for (const s of trace.spans) {
    const version = s.attributes["relax.weight_version"];
    const lag = version != null && trainedVersion != null ? trainedVersion - version : null;
    const bar = h("div", { class: `span ${s.name}`, dataset: { name: s.name, row: s.row, depth: s.depth, lag: lag ?? "", tip: spanTitle(s) },
      style: `top:${s.row * TIMELINE_ROW}px` + (lag === null ? "" : `;background:${lagColor(lag)}`) });
    bar.span = s;
    bars.append(bar);
  }
  const ticks = h("div", { class: "ticks" });
  const box = h("div", { class: "timeline", id: "timeline" }, bars, ticks);
  const place = (from, to) => {
    const scale = 100 / (to - from || 1);
    for (const bar of bars.children) {
      const s = bar.span, width = (s.end_ms - s.start_ms) * scale;
      Object.assign(bar.style, { left: `${(s.start_ms - from) * scale}%`, width: `max(${width}%, 2px)` });
      bar.textContent = width > 6 ? s.name : "";
    }
    const step = niceStep(to - from || 1, 8);
    const at = [];
    for (let t = Math.ceil(from / step) * step; t <= to + 1e-9; t += step) at.push(t);
    ticks.replaceChildren(...at.map((t) => h("span", { style: `left:${(t - from) * scale}%` }, `${+t.toFixed(6)} ms`)));
    Object.assign(box.dataset, { from, to });
  };
  bars.addEventListener("click", (e) => { const bar = e.target.closest(".span"); if (bar) place(bar.span.start_ms, bar.span.end_ms); });
  bars.addEventListener("dblclick", () => place(0, total));
  place(0, total);
  return box;
}
