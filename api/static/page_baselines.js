// Baselines: named sets of accepted comparisons that bands are learned from; create one, promote a
// finished comparison into it (a write token is needed; the API's refusal is shown as it is).
"use strict";
import { $, api, badge, comparisonHref, counts, enc, esc, labelsOf, notice, projectHref, short, targetOf, when } from "./ui.js";

export async function render(view, r, ctx) {
  const p = r.project;
  const [bl, comps] = await Promise.all([api(`/projects/${enc(p)}/baselines`),
                                         api(`/projects/${enc(p)}/comparisons?status=done&limit=200`)]);
  if (ctx.stale()) return;
  ctx.crumbs(`<a href="${projectHref(p)}">${esc(p)}</a> / baselines`);
  const byId = Object.fromEntries(comps.data.map((c) => [c.id, c]));
  view.innerHTML = `<section id="baselines-section">
    <h2>Baselines <small>bands are learned from the comparisons promoted here</small></h2>
    <div id="bl-notice"></div>
    ${bl.data.map((b) => `<div class="baseline" data-name="${esc(b.name)}"><h3>${esc(b.name)} <small>${b.comparisons.length} comparisons · since ${when(b.created_at)}</small></h3>
      <table><thead><tr><th>comparison</th><th>target</th><th>labels</th><th>verdict</th><th>ops</th><th>when</th></tr></thead><tbody>
      ${b.comparisons.slice().reverse().map((id) => { const c = byId[id]; return `<tr><td><a href="${comparisonHref(id)}"><code>${short(id)}</code></a></td>
        <td>${c ? esc(targetOf(c)) : "-"}</td><td>${c ? labelsOf(c) : "-"}</td><td>${badge(c?.verdict)}</td><td>${c ? counts(c.counts) : ""}</td><td>${c ? when(c.created_at) : "-"}</td></tr>`; }).join("")}
      </tbody></table></div>`).join("") || `<p class="empty">No baselines yet: create one (e.g. <code>main</code>) and promote a passing comparison into it.</p>`}
  </section>
  <section id="baseline-actions"><h2>Create or promote</h2>
    <form id="bl-create" class="filters"><label>new baseline <input name="name" placeholder="main, release/2.4" required></label><button>create</button></form>
    <form id="bl-promote" class="filters"><label>baseline <select name="name">${bl.data.map((b) => `<option>${esc(b.name)}</option>`).join("")}</select></label>
      <label>comparison <select name="comparison">${comps.data.map((c) => `<option value="${esc(c.id)}">${short(c.id)} · ${esc(targetOf(c))}${c.target_run?.label ? " · " + esc(c.target_run.label) : ""} · ${esc(c.verdict)} · ${when(c.created_at)}</option>`).join("")}</select></label>
      <label><input type="checkbox" name="force"> even if it failed</label><button>promote</button></form>
  </section>`;
  const rerender = () => render(view, r, ctx);
  $("#bl-create").addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      await api(`/projects/${enc(p)}/baselines`, { method: "POST", body: { name: e.target.elements.name.value.trim() } });
      await rerender();
    } catch (err) { notice($("#bl-notice"), `refused: ${err.message}`); }
  });
  $("#bl-promote").addEventListener("submit", async (e) => {
    e.preventDefault();
    const f = e.target.elements;
    try {
      await api(`/projects/${enc(p)}/baselines/${f.name.value}/comparisons`, { method: "POST", body: { comparison: f.comparison.value, force: f.force.checked } });
      await rerender();
    } catch (err) { notice($("#bl-notice"), `refused: ${err.message}`); }
  });
}
