// Op page: the op's error history per target with the band and the budget drawn as shaded ranges
// and out-of-band points marked; the selected run's error histogram, quantiles and both sides'
// statistics; the runs it was accepted in.
"use strict";
import { $, api, badge, comparisonHref, enc, esc, fmt, fmtCos, opHref, plotConfig, projectHref, runAxis, setQuery, short, targetOf, when, VERDICT_COLOR, zeroFloor, zeroNote } from "./ui.js";

const METRICS = ["norm_l2", "max_rel", "max_abs", "cosine", "snr_db"];
const MAX_CHARTS = 6;
const STATS = ["numel", "min", "max", "mean", "std", "l2", "absmax", "nan", "inf", "zeros"];
const DETAIL_METRICS = ["numel", "max_abs", "mean_abs", "rmse", "max_rel", "mean_rel", "norm_l2", "cosine", "snr_db",
  "ulp_max", "ulp_mean", "share_over_1ulp", "exact_share", "error_balance", "nan_mismatch", "inf_mismatch", "source"];

export async function render(view, r, ctx) {
  const p = r.project;
  const key = r.key;
  const metric = METRICS.includes(r.q.metric) ? r.q.metric : "norm_l2";
  const q = new URLSearchParams({ key, metric });
  if (r.q.target) q.set("target", r.q.target);
  const hist = await api(`/projects/${enc(p)}/op-history?${q}`);
  if (ctx.stale()) return;
  const targets = hist.targets;
  ctx.crumbs(`<a href="${projectHref(p)}">${esc(p)}</a> / op <code>${esc(key)}</code>`);
  const lastPoint = hist.series.flatMap((s) => s.points).sort((a, b) => a.created_at.localeCompare(b.created_at)).at(-1);
  let run = r.q.run || lastPoint?.comparison_id;
  view.innerHTML = `
  <section id="op-header">
    <h2><code>${esc(key)}</code> <small>${esc(hist.op || "")}</small></h2>
    <div class="filters">
      <label>target <select id="op-target"><option value="">every target (${targets.length})</option>${targets.map((t) => `<option>${esc(t)}</option>`).join("")}</select></label>
      <label>metric <select id="op-metric">${METRICS.map((m) => `<option>${m}</option>`).join("")}</select></label>
      <span class="legend"><span class="sw band"></span> band (learned from accepted runs) <span class="sw budget"></span> budget
        <span class="sw out">✕</span> out of band <span class="sw acc">◯</span> accepted in a baseline</span>
    </div>
  </section>
  <section id="history-section"><h2>History</h2><div id="history-charts"></div></section>
  <div class="two">
    <section id="run-section"><h2>Selected run <span id="run-title"></span></h2><div id="run-detail"></div></section>
    <section id="hist-section"><h2>|error| histogram <small>log-binned, quarter octaves</small></h2><div id="histogram"></div>
      <table id="quantiles"></table></section>
  </div>
  <div class="two">
    <section id="stats-section"><h2>Reference vs target statistics</h2><table id="stats"></table></section>
    <section id="accepted-section"><h2>Accepted in <small>(baselines the band learns from)</small></h2>
      <table id="accepted"><thead><tr><th>baseline</th><th>comparison</th><th>target</th><th>${esc(metric)}</th><th>verdict</th><th>added</th></tr></thead><tbody>
      ${hist.accepted_in.map((a) => `<tr><td>${esc(a.baseline)}</td><td><a href="${comparisonHref(a.comparison_id)}"><code>${short(a.comparison_id)}</code></a></td>
        <td>${esc(a.target)}</td><td class="num">${fmt(a.value)}</td><td>${badge(a.verdict)}</td><td>${when(a.added_at)}</td></tr>`).join("")}
      </tbody></table>${hist.accepted_in.length ? "" : `<p class="empty">Not accepted in any baseline yet: its band is the dtype default budget.</p>`}</section>
  </div>`;
  $("#op-target").value = r.q.target || "";
  $("#op-metric").value = metric;
  const nav = () => { location.hash = opHref(p, key, { target: $("#op-target").value, metric: $("#op-metric").value, run }); };
  $("#op-target").addEventListener("change", nav);
  $("#op-metric").addEventListener("change", nav);
  const select = async (cid) => {
    run = cid;
    setQuery({ target: r.q.target, metric: metric === "norm_l2" ? "" : metric, run: cid });
    markRun(cid);
    await detail(p, key, cid, ctx);
  };
  await charts(hist, metric, run, select);
  if (run) await detail(p, key, run, ctx);
}

function floorOf(series) {
  return zeroFloor(series.points.flatMap((pt) => [pt.value, pt.budget, pt.band]));
}

/** One chart per series (target x input shapes x dtype): budget and band as shaded ranges behind the points. */
async function charts(hist, metric, run, select) {
  const box = $("#history-charts");
  const shown = hist.series.slice(0, MAX_CHARTS);
  box.innerHTML = shown.map((s, i) => `<div class="chart-block"><h3>${esc(s.target)} <small>${esc(s.dtype)} · ${esc(s.shape_signature)}</small>
    ${s.regression ? `regression ${badge(s.regression.status)}` : ""}</h3><div class="history" id="history-${i}"></div></div>`).join("")
    + (hist.series.length > MAX_CHARTS ? `<p class="empty">${hist.series.length - MAX_CHARTS} more series: pick a target above.</p>` : "");
  const logY = !["cosine", "snr_db"].includes(metric);
  window.opbandHistory = [];
  for (const [i, s] of shown.entries()) {
    const axis = runAxis(s.points);
    const x = s.points.map(axis.label);
    s.axis = axis;
    const traces = [];
    const low = logY ? floorOf(s) : null;  // the bottom of the shaded ranges, and where an exact 0 is drawn
    const shade = (lower, upper, name, color, lineColor) => {
      if (!upper.some((v) => v !== null)) return;
      traces.push({ x, y: lower, mode: "lines", line: { width: 0, shape: "hv" }, hoverinfo: "skip", showlegend: false });
      traces.push({ x, y: upper, mode: "lines", name, fill: "tonexty", fillcolor: color,
                    line: { color: lineColor, width: 1, dash: "dot", shape: "hv" }, hovertemplate: `${name} %{y:.3e}<extra></extra>` });
    };
    const budget = s.points.map((pt) => pt.budget);
    const band = s.points.map((pt) => pt.band);
    const to = (ys, v) => ys.map((y) => (y === null ? null : v));
    if (metric === "cosine") {  // the accepted range is [cosine_min, 1]
      shade(budget, to(budget, 1), "budget", "rgba(84,174,255,0.13)", "#54aeff");
    } else if (logY) {
      shade(to(budget, low), budget, "budget", "rgba(84,174,255,0.13)", "#54aeff");
      shade(to(band, low), band, "band", "rgba(26,127,55,0.20)", "#1a7f37");
    }
    const bad = (pt) => pt.out;
    traces.push({
      x, y: s.points.map((pt) => (logY && pt.value === 0 ? low : pt.value)), mode: "lines+markers", name: metric, line: { color: "#24292f", width: 1.5 },
      customdata: s.points.map((pt) => pt.comparison_id),
      text: s.points.map((pt) => `${pt.value === 0 ? "exactly 0; " : ""}${pt.verdict}${pt.label ? " · " + pt.label : ""}; budget ${fmt(pt.budget)}; band ${fmt(pt.band)} (${pt.band_runs} accepted)`),
      hovertemplate: "%{y:.3e}<br>%{text}<extra></extra>",
      marker: { size: s.points.map((pt) => (bad(pt) ? 13 : 7)), symbol: s.points.map((pt) => (bad(pt) ? "x" : pt.value === 0 ? "triangle-down" : "circle")),
                color: s.points.map((pt) => VERDICT_COLOR[pt.verdict] || "#24292f") },
    });
    const acc = s.points.filter((pt) => pt.accepted_in.length);
    if (acc.length) {
      traces.push({ x: acc.map(axis.label), y: acc.map((pt) => (logY && pt.value === 0 ? low : pt.value)), mode: "markers", name: "accepted",
                    marker: { symbol: "circle-open", size: 15, color: "#1a7f37", line: { width: 2 } },
                    customdata: acc.map((pt) => pt.comparison_id), hovertemplate: "accepted in %{text}<extra></extra>",
                    text: acc.map((pt) => pt.accepted_in.join(", ")) });
    }
    const el = $(`#history-${i}`);
    await Plotly.newPlot(el, traces, {
      margin: { t: 6, r: 10, l: 64, b: 56 }, height: 280, showlegend: false, hovermode: "closest",
      yaxis: logY ? { title: { text: metric }, type: "log", tickformat: ".2~e" } : { title: { text: metric } },
      xaxis: { type: "category", categoryorder: "array", categoryarray: axis.categories, tickangle: -20, tickfont: { size: 10 } },
      shapes: runLine(s, run), annotations: logY ? zeroNote(s.points.map((pt) => pt.value), low) : [],
    }, plotConfig);
    el.on("plotly_click", (ev) => { const cid = ev.points.find((pt) => pt.customdata)?.customdata; if (cid) select(cid); });
    window.opbandHistory.push({ target: s.target, values: s.points.map((pt) => pt.value), out: s.points.filter(bad).length,
                                budget: s.points.map((pt) => pt.budget), band: s.points.map((pt) => pt.band) });
  }
  markRun.series = shown;
}

function runLine(s, run) {
  const pt = s.points.find((x) => x.comparison_id === run);
  return pt ? [{ type: "line", xref: "x", yref: "paper", x0: s.axis.label(pt), x1: s.axis.label(pt), y0: 0, y1: 1,
                 line: { color: "#8250df", width: 1.5, dash: "dash" } }] : [];
}

function markRun(run) {
  (markRun.series || []).forEach((s, i) => Plotly.relayout($(`#history-${i}`), { shapes: runLine(s, run) }));
}

async function detail(p, key, cid, ctx) {
  let d;
  try {
    d = await api(`/comparisons/${enc(cid)}/op?key=${enc(key)}`);
  } catch (e) {
    $("#run-detail").innerHTML = `<div class="notice error">${esc(e.message)}</div>`;
    return;
  }
  if (ctx.stale()) return;
  const o = d.result;
  const m = o.metrics || {};
  $("#run-title").innerHTML = `<a href="${comparisonHref(cid)}"><code>${short(cid)}</code></a> ${badge(o.verdict)}${o.inherited ? " inherited" : ""}`;
  $("#run-detail").innerHTML = `<p class="reason">${esc(o.reason || "within budget")}</p>
    <p><small>${when(d.comparison.created_at)} · target ${esc(targetOf(d.comparison))}${d.comparison.target_run?.label ? ` (${esc(d.comparison.target_run.label)})` : ""} ·
      budget norm_l2 ${fmt(o.budget?.norm_l2)}, cosine ≥ ${fmtCos(o.budget?.cosine_min)} (${esc(o.budget?.source || "-")})</small></p>
    <table class="kv">${DETAIL_METRICS.filter((k) => m[k] !== undefined).map((k) => `<tr><th>${k}</th><td class="num">${k === "cosine" ? fmtCos(m[k]) : fmt(m[k])}</td></tr>`).join("")}
    ${Object.entries(m.share_rel_over || {}).map(([t, v]) => `<tr><th>share rel &gt; ${esc(t)}</th><td class="num">${fmt(v)}</td></tr>`).join("")}</table>`;
  $("#quantiles").innerHTML = `<thead><tr><th>quantile of |error|</th>${Object.keys(d.quantiles).map((k) => `<th>${esc(k)}</th>`).join("")}<th>max</th></tr></thead>
    <tbody><tr><td></td>${Object.values(d.quantiles).map((v) => `<td class="num">${fmt(v)}</td>`).join("")}<td class="num">${fmt(m.max_abs)}</td></tr></tbody>`;
  await histogram(d.histogram, d.quantiles, m.max_abs);
  window.opbandHistogram = d.histogram;
  const rs = d.reference_stats || {};
  const ts = d.target_stats || {};
  $("#stats").innerHTML = d.reference_stats || d.target_stats
    ? `<thead><tr><th>statistic</th><th>reference</th><th>target</th><th>target − reference</th></tr></thead><tbody>
      ${STATS.filter((k) => rs[k] !== undefined || ts[k] !== undefined).map((k) => `<tr data-stat="${k}"><th>${k}</th><td class="num">${fmt(rs[k])}</td><td class="num">${fmt(ts[k])}</td>
        <td class="num">${typeof rs[k] === "number" && typeof ts[k] === "number" ? fmt(ts[k] - rs[k]) : "-"}</td></tr>`).join("")}</tbody>`
    : `<tr><td class="empty">The bundles hold no statistics for this op.</td></tr>`;
}

/** Bars on a log10 |error| axis (each bin a quarter octave wide); exact zeros as one bar left of the rest;
 * the quantiles and the max as dashed lines. */
async function histogram(bins, quantiles, maxAbs) {
  const finite = bins.filter((b) => b.high !== 0);
  const lows = finite.map((b) => Math.log10(Math.max(b.low, 1e-45)));
  const left = lows.length ? Math.floor(Math.min(...lows)) - 1 : -8;
  const zero = bins.find((b) => b.high === 0);
  const xs = finite.map((b) => (Math.log10(Math.max(b.low, 1e-45)) + Math.log10(b.high ?? b.low * 2)) / 2);
  const ws = finite.map((b) => (Math.log10(b.high ?? b.low * 2) - Math.log10(Math.max(b.low, 1e-45))) * 0.95);
  const traces = [{ type: "bar", x: xs, y: finite.map((b) => b.count), width: ws, marker: { color: "#8250df" }, name: "|error|",
                    text: finite.map((b) => `[${fmt(b.low)}, ${b.high === null ? "∞" : fmt(b.high)})`), textposition: "none",
                    hovertemplate: "%{text}: %{y} elements<extra></extra>" }];
  if (zero) traces.push({ type: "bar", x: [left], y: [zero.count], width: [0.6], marker: { color: "#6e7781" }, name: "exact",
                          textposition: "none", hovertemplate: "exactly equal: %{y} elements<extra></extra>" });
  const lines = Object.entries(quantiles).concat(maxAbs ? [["max", maxAbs]] : []).filter(([, v]) => typeof v === "number" && v > 0);
  const lo = Math.min(left, ...xs) - 0.5;
  const hi = Math.max(left + 1, ...xs) + 0.5;
  const ticks = [];
  for (let t = Math.ceil(lo); t <= hi; t++) ticks.push(t);
  await Plotly.react($("#histogram"), traces, {
    margin: { t: 34, r: 10, l: 50, b: 44 }, height: 270, showlegend: false, bargap: 0,
    xaxis: { title: { text: "|target − reference|" }, range: [lo, hi], tickvals: [...(zero ? [left] : []), ...ticks.filter((t) => t !== left)],
             ticktext: [...(zero ? ["0"] : []), ...ticks.filter((t) => t !== left).map((t) => `1e${t}`)] },
    yaxis: { title: { text: "elements" } },
    shapes: lines.map(([, v]) => ({ type: "line", x0: Math.log10(v), x1: Math.log10(v), yref: "paper", y0: 0, y1: 1,
                                    line: { color: "#cf222e", width: 1, dash: "dot" } })),
    annotations: lines.map(([k, v], i) => ({ x: Math.log10(v), yref: "paper", y: 1.0 + (i % 2) * 0.09, text: k, showarrow: false,
                                             font: { size: 10, color: "#cf222e" }, yanchor: "bottom" })),
  }, plotConfig);
}
