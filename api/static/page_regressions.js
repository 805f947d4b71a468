// Regressions: filter by status; acknowledge, accept with an expiry (an accepted deviation), re-open;
// the accepted deviations in force; the audit of who decided what, when. Actions need a write token:
// without one the API's refusal is shown as it is.
"use strict";
import { $, $$, api, author, badge, comparisonHref, enc, esc, notice, opHref, pager, projectHref, setQuery, token, when } from "./ui.js";

const STATUSES = ["active", "acknowledged", "accepted", "resolved"];
const PAGE = 50;

export async function render(view, r, ctx) {
  const p = r.project;
  ctx.crumbs(`<a href="${projectHref(p)}">${esc(p)}</a> / regressions`);
  view.innerHTML = `<section id="regressions-section">
    <h2>Regressions <span id="reg-count"></span></h2>
    <form class="filters" id="reg-filters"><fieldset><legend>status</legend>
      ${STATUSES.map((s) => `<label><input type="checkbox" name="status" value="${s}"> ${badge(s)}</label>`).join("")}</fieldset>
      <span class="hint">${token() ? "actions use the token saved under 'token'" : "no token saved: actions will be refused unless the server runs without auth"}</span>
    </form>
    <div id="reg-notice"></div>
    <table id="regressions"><thead><tr><th>op key</th><th>target</th><th>dtype</th><th>input shapes</th><th>status</th><th>reason</th>
      <th>first / last</th><th>updated</th><th>actions</th></tr></thead><tbody></tbody></table>
    <div class="pager" id="reg-pager"></div>
  </section>
  <section id="audit-section"><h2>Audit <small>who decided what, when</small></h2>
      <table id="audit"><thead><tr><th>when</th><th>who</th><th>op key</th><th>target</th><th>set to</th><th>note</th><th>expires</th></tr></thead><tbody></tbody></table></section>
  <section id="deviations-section"><h2>Accepted deviations in force</h2>
      <table id="deviations"><thead><tr><th>pattern</th><th>reason</th><th>by</th><th>expires</th><th>regressions</th><th></th></tr></thead><tbody></tbody></table></section>`;
  const wanted = (r.q.status || "active,acknowledged").split(",");
  $$("#reg-filters input[name=status]").forEach((i) => { i.checked = wanted.includes(i.value); });
  let offset = Number(r.q.offset || 0);
  const load = async (o = offset) => {
    offset = o;
    const status = $$("#reg-filters input[name=status]:checked").map((i) => i.value).join(",") || STATUSES.join(",");
    setQuery({ status, offset: offset || "" });
    const page = await api(`/projects/${enc(p)}/regressions?status=${enc(status)}&limit=${PAGE}&offset=${offset}`);
    if (ctx.stale()) return;
    $("#reg-count").textContent = `(${page.count})`;
    $("#regressions tbody").innerHTML = page.data.map((g) => row(p, g)).join("")
      || `<tr><td colspan="9" class="empty">No regression with these statuses.</td></tr>`;
    pager($("#reg-pager"), { offset, limit: PAGE, count: page.count }, load);
    await Promise.all([audit(p, ctx), deviations(p, ctx, load)]);
  };
  $("#reg-filters").addEventListener("change", () => load(0));
  $("#regressions").addEventListener("click", (e) => act(e, p, load));
  $("#regressions").addEventListener("submit", (e) => accept(e, p, load));
  await load();
}

function in30days() {
  const d = new Date(Date.now() + 30 * 864e5);
  return d.toISOString().slice(0, 10);
}

function row(p, g) {
  const actions = [];
  if (g.status === "active") actions.push(`<button data-act="acknowledged" data-id="${g.id}">acknowledge</button>`);
  if (g.status === "active" || g.status === "acknowledged") actions.push(`<button data-act="accept-form" data-id="${g.id}">accept…</button>`);
  if (g.status !== "active") actions.push(`<button data-act="active" data-id="${g.id}">re-open</button>`);
  return `<tr data-id="${g.id}" data-status="${esc(g.status)}"><td><a href="${opHref(p, g.key, { target: g.target, run: g.last_comparison_id })}"><code>${esc(g.key)}</code></a></td>
    <td>${esc(g.target)}</td><td>${esc(g.dtype)}</td><td>${esc(g.shape_signature)}</td><td>${badge(g.status)}</td><td class="reason">${esc(g.reason)}</td>
    <td><a href="${comparisonHref(g.first_comparison_id)}">${esc(g.first_comparison_id.slice(0, 6))}</a> /
        <a href="${comparisonHref(g.last_comparison_id)}">${esc(g.last_comparison_id.slice(0, 6))}</a></td>
    <td>${when(g.updated_at)}</td><td class="actions">${actions.join(" ")}</td></tr>
    <tr class="accept-row" id="accept-${g.id}" hidden><td colspan="9"><form class="accept-form" data-id="${g.id}" data-key="${esc(g.key)}" data-shape="${esc(g.shape_signature)}">
      Accept <code>${esc(g.key)}</code> for these input shapes until <input type="date" name="expires" value="${in30days()}" required>
      because <input name="reason" required placeholder="why this deviation is acceptable" size="40">
      <button type="submit">accept with expiry</button></form></td></tr>`;
}

async function act(e, p, load) {
  const b = e.target.closest("button[data-act]");
  if (!b) return;
  const id = b.dataset.id;
  if (b.dataset.act === "accept-form") { $(`#accept-${id}`).hidden = !$(`#accept-${id}`).hidden; return; }
  try {
    await api(`/regressions/${id}`, { method: "PATCH", body: { status: b.dataset.act, author: author() || undefined } });
    notice($("#reg-notice"), `regression ${id}: ${b.dataset.act === "active" ? "re-opened" : b.dataset.act}`, "ok");
    await load();
  } catch (err) {
    notice($("#reg-notice"), `refused: ${err.message}`);
  }
}

async function accept(e, p, load) {
  e.preventDefault();
  const f = e.target;
  const body = { key_pattern: f.dataset.key, shape_signature: f.dataset.shape || null, reason: f.elements.reason.value,
                 author: author() || "dashboard user", expires_at: new Date(f.elements.expires.value + "T23:59:59Z").toISOString() };
  try {
    const d = await api(`/projects/${enc(p)}/deviations`, { method: "POST", body });
    notice($("#reg-notice"), `accepted until ${f.elements.expires.value}: ${d.accepted_regressions} regression(s)`, "ok");
    await load();
  } catch (err) {
    notice($("#reg-notice"), `refused: ${err.message}`);
  }
}

async function audit(p, ctx) {
  const page = await api(`/projects/${enc(p)}/regression-events?limit=30`);
  if (ctx.stale()) return;
  $("#audit tbody").innerHTML = page.data.map((ev) => `<tr><td>${when(ev.at)}</td><td>${esc(ev.actor)}</td>
    <td><a href="${opHref(p, ev.key, { target: ev.target })}"><code>${esc(ev.key)}</code></a></td><td>${esc(ev.target)}</td>
    <td>${badge(ev.status)}</td><td class="reason">${esc(ev.note || "")}</td><td>${ev.expires_at ? when(ev.expires_at) : "-"}</td></tr>`).join("")
    || `<tr><td colspan="7" class="empty">No decisions recorded yet.</td></tr>`;
}

async function deviations(p, ctx, load) {
  const page = await api(`/projects/${enc(p)}/deviations`);
  if (ctx.stale()) return;
  $("#deviations tbody").innerHTML = page.data.map((d) => `<tr><td><code>${esc(d.key_pattern)}</code>${d.shape_signature ? ` <small>${esc(d.shape_signature)}</small>` : ""}</td>
    <td class="reason">${esc(d.reason)}</td><td>${esc(d.author)}</td><td>${d.expires_at ? when(d.expires_at) : "never"}</td><td class="num">${d.accepted_regressions || ""}</td>
    <td><button data-withdraw="${d.id}">withdraw</button></td></tr>`).join("")
    || `<tr><td colspan="6" class="empty">None.</td></tr>`;
  $$("#deviations button[data-withdraw]").forEach((b) => b.addEventListener("click", async () => {
    try {
      await api(`/projects/${enc(p)}/deviations/${b.dataset.withdraw}`, { method: "DELETE" });
      notice($("#reg-notice"), `deviation ${b.dataset.withdraw} withdrawn: its regressions are open again`, "ok");
      await load();
    } catch (err) {
      notice($("#reg-notice"), `refused: ${err.message}`);
    }
  }));
}
