// Heatmap: ops (rows, in execution order) x runs (columns, oldest left), colour = severity
// (value / limit of the worst metric; 1 is the edge of the band). Click a cell for the op's page.
"use strict";
import { $, api, enc, esc, fmt, opHref, plotConfig, projectHref, setQuery, when } from "./ui.js";

// log10(severity) from -2 (1 % of the budget) to +2 (100x over): green below 1, amber at the edge, red above
const SCALE = [[0, "#dafbe1"], [0.35, "#aceebb"], [0.5, "#fff8c5"], [0.62, "#ffb77c"], [0.8, "#fa4549"], [1, "#82071e"]];

export async function render(view, r, ctx) {
  const p = r.project;
  const ov = await api(`/projects/${enc(p)}/overview`);
  if (ctx.stale()) return;
  ctx.crumbs(`<a href="${projectHref(p)}">${esc(p)}</a> / heatmap`);
  view.innerHTML = `<section id="heatmap-section">
    <h2>Heatmap <small>ops × runs, colour = severity (value / limit; ≥ 1 is out of band)</small></h2>
    <div class="filters">
      <label>target <select id="hm-target"><option value="">all targets</option>${ov.targets.map((t) => `<option>${esc(t.target)}</option>`).join("")}</select></label>
      <label>runs <select id="hm-runs">${[10, 30, 60, 100].map((n) => `<option>${n}</option>`).join("")}</select></label>
      <label>ops <select id="hm-ops">${[30, 60, 120, 250].map((n) => `<option>${n}</option>`).join("")}</select></label>
      <label>rows <select id="hm-order"><option value="execution">execution order: where drift starts</option>
        <option value="similar">ops that move together, side by side</option></select></label>
    </div>
    <div id="heatmap"></div><p class="empty" id="no-heatmap" hidden>No finished comparisons yet.</p>
  </section>`;
  $("#hm-target").value = r.q.target || "";
  $("#hm-runs").value = r.q.runs || "30";
  $("#hm-ops").value = r.q.ops || "60";
  $("#hm-order").value = r.q.order === "similar" ? "similar" : "execution";
  const draw = async () => {
    const q = { target: $("#hm-target").value, runs: $("#hm-runs").value, ops: $("#hm-ops").value,
                order: $("#hm-order").value === "similar" ? "similar" : "" };
    setQuery(q);
    const params = new URLSearchParams(Object.entries(q).filter(([, v]) => v));
    const hm = await api(`/projects/${enc(p)}/heatmap?${params}`);
    if (ctx.stale()) return;
    await plot(p, hm);
  };
  for (const id of ["#hm-target", "#hm-runs", "#hm-ops", "#hm-order"]) $(id).addEventListener("change", draw);
  await draw();
}

async function plot(project, hm) {
  $("#no-heatmap").hidden = hm.runs.length > 0;
  const x = hm.runs.map((r, j) => `${j + 1}. ${r.label || r.target} · ${r.comparison_id.slice(0, 6)}`);
  const y = hm.ops.map((o) => o.key);
  const z = hm.z.map((row) => row.map((v) => (v === null ? null : Math.log10(Math.max(v, 1e-2)))));
  const text = hm.z.map((row, i) => row.map((v, j) => `${hm.verdicts[i][j] || "not run"} · severity ${v === null ? "-" : (v >= 1000 ? "≥1000 (non-finite)" : fmt(v))}<br>${esc(hm.runs[j].target)} · ${when(hm.runs[j].created_at)}`));
  const el = $("#heatmap");
  const height = Math.max(320, 90 + 16 * y.length);
  await Plotly.react(el, [{
    type: "heatmap", x, y, z, text, zmin: -2, zmax: 2, colorscale: SCALE, xgap: 1, ygap: 1,
    customdata: hm.z.map((row) => row.map((_, j) => hm.runs[j].comparison_id)),
    hovertemplate: "<b>%{y}</b><br>%{text}<extra></extra>",
    colorbar: { title: { text: "severity" }, tickvals: [-2, -1, 0, 1, 2], ticktext: ["0.01", "0.1", "1 (edge)", "10", "≥100"] },
  }], {
    height, margin: { t: 10, r: 10, b: 120, l: Math.min(480, 20 + 7 * Math.max(10, ...y.map((k) => k.length))) },
    yaxis: { autorange: "reversed", tickfont: { size: 10, family: "ui-monospace, monospace" } },
    xaxis: { tickangle: -35, tickfont: { size: 10 } },
  }, plotConfig);
  el.removeAllListeners?.("plotly_click");
  el.on("plotly_click", (ev) => {
    const pt = ev.points[0];
    const run = hm.runs[pt.pointNumber[1]];
    location.hash = opHref(project, pt.y, { target: run.target, run: run.comparison_id });
  });
  window.opbandHeatmap = { runs: hm.runs.length, ops: hm.ops.length, cells: hm.z.flat().filter((v) => v !== null).length };
}
