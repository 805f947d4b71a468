// Project overview: targets x latest verdict, open regressions, recent comparisons, and the drift chart.
"use strict";
import { $, api, badge, comparisonHref, counts, enc, esc, fmt, labelsOf, opHref, targetOf, plotConfig, projectHref, runAxis, setQuery, when, zeroFloor, zeroNote } from "./ui.js";

export async function render(view, r, ctx) {
  const p = r.project;
  const project = () => p;
  const o = await api(`/projects/${enc(p)}/overview`);
  if (ctx.stale()) return;
  ctx.crumbs(`<a href="${projectHref(p)}">${esc(p)}</a>`);
  view.innerHTML = `
  <section id="targets-section">
    <h2>${esc(p)} <small>${o.public ? "public" : "private"} · ${o.comparisons} comparisons</small></h2>
    <h3>Targets, latest verdict</h3>
    <table id="targets"><thead><tr><th>target</th><th>latest verdict</th><th>ops</th><th>first divergence</th>
      <th>label</th><th>when</th><th>runs</th></tr></thead><tbody>
      ${o.targets.map((t) => `<tr data-target="${esc(t.target)}">
        <td><b>${esc(t.target)}</b> <small><a href="${projectHref(p, "heatmap")}?target=${enc(t.target)}">heatmap</a> ·
          <a href="${projectHref(p)}?target=${enc(t.target)}">drift</a></small></td>
        <td><a href="${comparisonHref(t.comparison_id)}">${badge(t.verdict)}</a></td><td>${counts(t.counts)}</td>
        <td>${t.first_divergence ? `<a href="${opHref(p, t.first_divergence, { target: t.target, run: t.comparison_id })}"><code>${esc(t.first_divergence)}</code></a>` : "-"}</td>
        <td>${esc(t.label || "-")}${Object.keys(t.tags || {}).length ? " " + Object.entries(t.tags).map(([k, v]) => `<span class="tag">${esc(k)}=${esc(v)}</span>`).join("") : ""}</td><td>${when(t.created_at)}</td><td class="num">${t.runs}</td></tr>`).join("")}
    </tbody></table>
    ${o.targets.length ? "" : `<p class="empty">No finished comparisons yet: upload two bundles and compare them (<code>opband gate</code> or <code>opband demo</code>).</p>`}
  </section>
  <div class="two">
    <section id="open-regressions">
      <h2>Open regressions <span class="pill ${o.open_regressions ? "fail" : "pass"}" id="open-count">${o.open_regressions}</span>
        <a class="more" href="${projectHref(p, "regressions")}">all regressions &rarr;</a></h2>
      <table><thead><tr><th>op key</th><th>target</th><th>status</th><th>since</th></tr></thead><tbody>
      ${o.regressions.map((g) => `<tr><td><a href="${opHref(p, g.key, { target: g.target, run: g.last_comparison_id })}"><code>${esc(g.key)}</code></a></td>
        <td>${esc(g.target)}</td><td>${badge(g.status)}</td><td><a href="${comparisonHref(g.first_comparison_id)}">${when(g.created_at)}</a></td></tr>`).join("")}
      </tbody></table>
      ${o.regressions.length ? "" : `<p class="empty">None open.</p>`}
    </section>
    <section id="recent-section">
      <h2>Recent comparisons</h2>
      <table id="comparisons"><thead><tr><th>when</th><th>target</th><th>labels</th><th>verdict</th><th>ops</th><th>first divergence</th></tr></thead><tbody>
      ${o.recent.map((c) => `<tr class="selectable" data-id="${esc(c.id)}">
        <td><a href="${comparisonHref(c.id)}">${when(c.created_at)}</a></td><td>${esc(targetOf(c))}</td><td>${labelsOf(c)}</td>
        <td>${badge(c.verdict || c.status)}</td><td>${counts(c.counts)}</td>
        <td>${c.first_divergence ? `<a href="${opHref(project(c), c.first_divergence.key, { target: targetOf(c), run: c.id })}"><code>${esc(c.first_divergence.key)}</code></a>` : esc(c.error || "-")}</td></tr>`).join("")}
      </tbody></table>
    </section>
  </div>
  <section id="drift-section">
    <h2>Drift
      <label>metric <select id="metric">${["norm_l2", "max_abs", "max_rel", "cosine", "snr_db"].map((m) => `<option>${m}</option>`).join("")}</select></label>
      <label>target <select id="target"><option value="">flagged + worst of all</option>${o.targets.map((t) => `<option>${esc(t.target)}</option>`).join("")}</select></label>
      <small>default: every open regression and first divergence, then the worst series; click a point for the op's page</small>
    </h2>
    <div id="drift" aria-label="drift chart"></div>
    <p class="empty" id="no-drift" hidden>No results to plot yet.</p>
  </section>`;
  $("#metric").value = r.q.metric || "norm_l2";
  $("#target").value = r.q.target || "";
  view.querySelectorAll("#comparisons tbody tr").forEach((tr) => tr.addEventListener("click", (e) => {
    if (e.target.closest("a")) return;
    location.hash = comparisonHref(tr.dataset.id);
  }));
  const redraw = () => { setQuery({ metric: $("#metric").value, target: $("#target").value }); return drift(p, o, ctx); };
  $("#metric").addEventListener("change", redraw);
  $("#target").addEventListener("change", redraw);
  await drift(p, o, ctx);
}

async function drift(project, o, ctx) {
  const metric = $("#metric").value;
  const target = $("#target").value;
  const q = new URLSearchParams({ metric, series: "8", points: "100" });
  if (target) q.set("target", target);
  const series = await api(`/projects/${enc(project)}/drift?${q}`);
  if (ctx.stale()) return;
  const flagged = new Set(o.regressions.map((g) => `${g.key}|${g.target}`));
  const axis = runAxis(series.flatMap((s) => s.points));
  const logY = metric !== "cosine" && metric !== "snr_db";
  const zero = zeroFloor(series.flatMap((s) => s.points.map((p) => p.value)));  // exact 0 on a log axis
  const y = (p) => (logY && p.value === 0 ? zero : p.value);
  const traces = series.filter((s) => s.points.length).map((s) => ({
    type: "scatter", mode: "lines+markers", name: `${s.key} [${s.target}]${flagged.has(`${s.key}|${s.target}`) ? " ⚑" : ""}`,
    x: s.points.map(axis.label), y: s.points.map(y),
    customdata: s.points.map((p) => [s.key, s.target, p.comparison_id]),
    text: s.points.map((p) => `${p.value === 0 ? "exactly 0; " : ""}${p.verdict}; budget ${fmt(p.budget)}`),
    marker: { symbol: s.points.map((p) => (p.verdict === "fail" || p.verdict === "warn" ? "x" : p.value === 0 ? "triangle-down" : "circle")),
              size: s.points.map((p) => (p.verdict === "fail" || p.verdict === "warn" ? 10 : 6)) },
    hovertemplate: "%{y:.3e}<br>%{text}<extra>%{fullData.name}</extra>",
  }));
  $("#no-drift").hidden = traces.length > 0;
  const el = $("#drift");
  await Plotly.react(el, traces, {
    margin: { t: 10, r: 10, l: 60, b: 60 }, legend: { orientation: "h", y: -0.3, font: { size: 11 } },
    yaxis: logY ? { title: { text: metric }, type: "log", tickformat: ".3~g" } : { title: { text: metric }, type: "linear" },
    annotations: logY ? zeroNote(series.flatMap((s) => s.points.map((p) => p.value)), zero) : [],
    xaxis: { title: { text: "comparison (oldest left)" }, type: "category", categoryorder: "array", categoryarray: axis.categories,
             tickangle: -20, tickfont: { size: 10 } },
  }, plotConfig);
  el.removeAllListeners?.("plotly_click");
  el.on("plotly_click", (ev) => {
    const [key, tgt, run] = ev.points[0].customdata;
    location.hash = opHref(project, key, { target: tgt, run, metric });
  });
  window.opbandDriftPoints = traces.reduce((n, t) => n + t.y.filter((v) => v !== null).length, 0);
  window.opbandDriftKeys = series.map((s) => s.key);
}
