// opband dashboard: comparisons, the worst ops of one, and drift of a metric per op key.
"use strict";
const api = (path) => fetch("/api/v1" + path).then(async (r) => {
  if (!r.ok) throw new Error((await r.json().catch(() => ({}))).detail || r.statusText);
  return r.json();
});
const $ = (sel) => document.querySelector(sel);
const fmt = (v) => v === null || v === undefined ? "-" : (v === 0 ? "0" :
  (Math.abs(v) >= 1e4 || Math.abs(v) < 1e-3 ? v.toExponential(2) : Number(v.toPrecision(4)).toString()));
const badge = (v) => `<span class="badge ${v}">${v}</span>`;
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
const state = { project: null, comparison: null };

function setStatus(text) { $("#status").textContent = text; }

async function loadProjects() {
  const { data } = await api("/projects");
  const sel = $("#project");
  sel.innerHTML = data.map((p) => `<option>${esc(p.name)}</option>`).join("");
  const wanted = new URLSearchParams(location.search).get("project");
  if (wanted && data.some((p) => p.name === wanted)) sel.value = wanted;
  state.project = sel.value || null;
  if (!state.project) { setStatus("no projects yet"); $("#no-comparisons").hidden = false; return; }
  await refresh();
}

async function refresh() {
  await Promise.all([loadComparisons(), loadDrift()]);
  setStatus("updated " + new Date().toLocaleTimeString());
}

async function loadComparisons() {
  const { data } = await api(`/projects/${encodeURIComponent(state.project)}/comparisons?limit=50`);
  $("#no-comparisons").hidden = data.length > 0;
  const targets = new Set();
  $("#comparisons tbody").innerHTML = data.map((c) => {
    targets.add(`${c.target_variant}@${c.target_device}`);
    const counts = Object.entries(c.counts || {}).filter(([, n]) => n).map(([v, n]) => `${n} ${v}`).join(", ");
    const fd = c.first_divergence ? `<code>${esc(c.first_divergence.key)}</code>` : (c.error ? esc(c.error) : "-");
    return `<tr class="selectable" data-id="${c.id}"><td>${new Date(c.created_at).toLocaleString()}</td>
      <td>${esc(c.target_variant)}@${esc(c.target_device)}</td><td>${esc(c.mode)}</td><td>${badge(c.status)}</td>
      <td>${c.verdict ? badge(c.verdict) : "-"}</td><td>${esc(counts)}</td><td>${fd}</td></tr>`;
  }).join("");
  const tsel = $("#target");
  const current = tsel.value;
  tsel.innerHTML = `<option value="">worst of all</option>` + [...targets].map((t) => `<option>${esc(t)}</option>`).join("");
  tsel.value = [...targets].includes(current) ? current : "";
  document.querySelectorAll("#comparisons tbody tr").forEach((tr) => tr.addEventListener("click", () => selectComparison(tr.dataset.id)));
  const done = data.find((c) => c.status === "done");
  if (!state.comparison && done) await selectComparison(done.id);
}

async function selectComparison(id) {
  state.comparison = id;
  document.querySelectorAll("#comparisons tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.id === id));
  const { data, count } = await api(`/comparisons/${id}/ops?limit=15&sort=worst&order=desc`);
  $("#ops-title").textContent = `(${data.length} of ${count})`;
  $("#ops tbody").innerHTML = data.map((o) => `<tr><td>${badge(o.verdict)}${o.inherited ? " inherited" : ""}</td>
    <td><code>${esc(o.key)}</code></td><td>${esc(o.shape_signature)}</td><td>${esc(o.dtype)}</td>
    <td class="num">${fmt(o.norm_l2)}</td><td class="num">${fmt(o.max_abs)}</td><td class="num">${fmt(o.max_rel)}</td>
    <td class="num">${fmt(o.cosine)}</td><td class="num">${fmt(o.budget && o.budget.norm_l2)}</td>
    <td class="reason">${esc(o.reason)}</td></tr>`).join("");
}

async function loadDrift() {
  const metric = $("#metric").value;
  const target = $("#target").value;
  const q = new URLSearchParams({ metric, series: "8", points: "100" });
  if (target) q.set("target", target);
  const series = await api(`/projects/${encodeURIComponent(state.project)}/drift?${q}`);
  const traces = series.filter((s) => s.points.length).map((s) => ({
    type: "scatter", mode: "lines+markers", name: `${s.key} [${s.target}]`,
    x: s.points.map((p) => p.created_at), y: s.points.map((p) => p.value),
    text: s.points.map((p) => `${p.verdict}; budget ${fmt(p.budget)}`),
    hovertemplate: "%{y:.3e}<br>%{text}<extra>%{fullData.name}</extra>",
  }));
  $("#no-drift").hidden = traces.length > 0;
  const logY = metric !== "cosine" && metric !== "snr_db";
  await Plotly.react("drift", traces, {
    margin: { t: 10, r: 10, l: 60, b: 40 }, legend: { orientation: "h", y: -0.2, font: { size: 11 } },
    yaxis: logY ? { title: { text: metric }, type: "log", tickformat: ".3~g" }
               : { title: { text: metric }, type: "linear" },
    xaxis: { title: { text: "comparison time" } },
  }, { displaylogo: false, responsive: true });
  window.opbandDriftPoints = traces.reduce((n, t) => n + t.y.filter((v) => v !== null).length, 0);
}

$("#project").addEventListener("change", (e) => { state.project = e.target.value; state.comparison = null; refresh(); });
$("#metric").addEventListener("change", loadDrift);
$("#target").addEventListener("change", loadDrift);
loadProjects().catch((e) => setStatus("error: " + e.message));
setInterval(() => state.project && refresh().catch((e) => setStatus("error: " + e.message)), 15000);
