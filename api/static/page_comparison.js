// Comparison: both runs and their environment diff, then every op (filters, search, paging),
// inherited failures folded under the local failure they follow.
"use strict";
import { $, $$, api, badge, counts, enc, esc, fmt, fmtCos, opHref, pager, projectHref, setQuery, short, when } from "./ui.js";

const VERDICTS = ["fail", "warn", "missing", "new", "pass"];
const PAGE = 50;

function side(title, s) {
  const tags = Object.entries(s.tags || {}).map(([k, v]) => `<span class="tag">${esc(k)}=${esc(v)}</span>`).join(" ");
  return `<div class="run-card"><h3>${title}</h3><dl>
    <dt>label</dt><dd class="label">${esc(s.label || "-")}</dd>
    <dt>target</dt><dd>${esc(s.target)}</dd>
    <dt>device</dt><dd>${esc(s.device)}</dd><dt>variant</dt><dd>${esc(s.variant)}</dd>
    <dt>git</dt><dd>${esc(s.git_branch || "-")} ${s.git_commit ? `<code>${esc(s.git_commit.slice(0, 10))}</code>` : ""}</dd>
    ${tags ? `<dt>tags</dt><dd>${tags}</dd>` : ""}
    <dt>bundle</dt><dd><code>${short(s.bundle_id)}</code> · ${when(s.created_at)}</dd></dl></div>`;
}

// " at step N (prefill | decode, token position P)": where in a generation the first divergence lies
function stepWords(gen, step) {
  if (!gen) return step ? ` <span id="fd-step">at step ${step}</span>` : "";
  const st = (gen.steps || [])[step || 0];
  const where = st && st.position != null ? `, token position ${st.position}` : "";
  return ` <span id="fd-step">at step ${step || 0} (${step ? "decode" : "prefill"}${where})</span>`;
}

// Both runs generated: per step, how far the target's next-token choice is from the reference's.
function generationSection(gen) {
  if (!gen) return "";
  const parted = gen.first_token_divergence;
  const note = parted == null ? "every step chose the reference's tokens"
    : `the greedy tokens first differ at step ${parted}` + (gen.teacher_forced
      ? " (teacher-forced: every step received the reference's tokens and is judged)"
      : ": later steps compute on other tokens and their ops are not judged (inputs differ)");
  const pct = (v) => `${Math.round(100 * v)}%`;
  const rows = (gen.steps || []).map((st) => `<tr class="${st.step === parted ? "parted" : ""}">
    <td class="num">${st.step}</td><td class="num">${st.position ?? "-"}</td><td class="num">${pct(st.argmax_agreement)}</td>
    <td class="num">${pct(st.topk_overlap)}</td><td class="num">${fmt(st.logprob_drop)}</td><td class="num">${fmt(st.kl)}</td>
    <td><code>${esc((st.reference_tokens || []).join(" "))}</code></td><td><code>${esc((st.target_tokens || []).join(" "))}</code></td></tr>`).join("");
  return `<section id="generation-section"><h2>Generation, step by step</h2><p id="generation-note">${esc(note)}</p>
    <table id="generation"><thead><tr><th>step</th><th>position</th><th>argmax agreement</th><th>top-k overlap</th>
      <th>log-prob drop</th><th>KL (nats)</th><th>reference tokens</th><th>target tokens</th></tr></thead><tbody>${rows}</tbody></table></section>`;
}

export async function render(view, r, ctx) {
  const h = await api(`/comparisons/${enc(r.id)}/runs`);
  if (ctx.stale()) return;
  const c = h.comparison;
  const p = h.project;
  ctx.setProject(p);
  ctx.crumbs(`<a href="${projectHref(p)}">${esc(p)}</a> / comparison <code>${short(c.id)}</code>`);
  const fd = c.first_divergence;
  view.innerHTML = `
  <section id="comparison-header">
    <h2>Comparison <code>${short(c.id)}</code> ${badge(c.verdict || c.status)} <small>${esc(c.mode)} · ${when(c.created_at)} · ${counts(c.counts)}${c.unmatched ? ` · ${c.unmatched} unmatched` : ""}</small></h2>
    ${c.error ? `<div class="notice error">${esc(c.error)}</div>` : ""}
    <div class="runs">${side("reference", h.reference)}${side("target", h.target)}
      <div class="run-card env"><h3>environment diff <span id="env-summary">${h.categories.length
        ? h.categories.map((k) => `<span class="chip">${esc(k)}</span>`).join(" ") : "<span class='chip same'>identical</span>"}</span></h3>
        <table id="env-diff"><thead><tr><th>what</th><th>field</th><th>reference</th><th>target</th></tr></thead><tbody>
        ${h.changed.map((d) => `<tr data-category="${esc(d.category)}"><td><span class="chip">${esc(d.category)}</span></td><td><code>${esc(d.field)}</code></td>
          <td>${esc(JSON.stringify(d.a) ?? "-")}</td><td>${esc(JSON.stringify(d.b) ?? "-")}</td></tr>`).join("")}
        </tbody></table><small>${h.same} fields equal</small></div>
    </div>
    ${fd ? `<p class="first-div">First divergence: <a id="first-divergence" href="${opHref(p, fd.key, { target: h.target.target, run: c.id })}"><code>${esc(fd.key)}</code></a>
      ${badge(fd.verdict)}${stepWords(c.generation, fd.step)} <span class="reason">${esc(fd.reason || "")}</span></p>` : ""}
  </section>
  ${generationSection(c.generation)}
  <section id="ops-section">
    <h2>Ops <span id="ops-count"></span></h2>
    <form id="filters" class="filters">
      <fieldset><legend>verdict</legend>${VERDICTS.map((v) => `<label><input type="checkbox" name="verdict" value="${v}"> ${badge(v)}</label>`).join("")}</fieldset>
      <label>search <input name="search" placeholder="part of the op key"></label>
      <label>module <input name="module" placeholder="glob, e.g. model.layers.1*"></label>
      <label>op <input name="op" placeholder="e.g. aten.mm"></label>
      <label><input type="checkbox" name="fold"> fold inherited failures</label>
    </form>
    <table id="ops"><thead><tr><th>verdict</th><th>op key</th><th>input shapes</th><th>dtype</th><th>severity</th><th>norm_l2</th>
      <th>max_abs</th><th>max_rel</th><th>cosine</th><th>budget</th><th>reason</th></tr></thead><tbody></tbody></table>
    <div class="pager" id="ops-pager"></div>
  </section>`;
  const form = $("#filters");
  const q = r.q;
  const wanted = (q.verdict || "").split(",").filter(Boolean);
  $$("input[name=verdict]", form).forEach((i) => { i.checked = wanted.includes(i.value); });
  for (const name of ["search", "module", "op"]) form.elements[name].value = q[name] || "";
  form.elements.fold.checked = q.fold !== "0";
  let offset = Number(q.offset || 0);
  const state = () => ({
    verdict: $$("input[name=verdict]:checked", form).map((i) => i.value).join(","),
    search: form.elements.search.value.trim(), module: form.elements.module.value.trim(), op: form.elements.op.value.trim(),
    fold: form.elements.fold.checked ? "" : "0",
  });
  let timer = null;
  const reload = (o) => { offset = o; const s = state(); setQuery({ ...s, offset: offset || "" }); return loadOps(p, c.id, h, s, offset, reload, ctx); };
  form.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(() => reload(0), 250); });
  form.addEventListener("submit", (e) => e.preventDefault());
  await loadOps(p, c.id, h, state(), offset, reload, ctx);
}

function opRow(p, h, cid, o, cls = "") {
  const sev = o.severity === "inf" ? "∞" : fmt(o.severity);
  return `<tr class="${cls}" data-key="${esc(o.key)}"><td>${badge(o.verdict)}${o.inherited ? ' <span class="inh">inherited</span>' : ""}</td>
    <td><a href="${opHref(p, o.key, { target: h.target.target, run: cid })}"><code>${esc(o.key)}</code></a></td>
    <td>${esc(o.shape_signature)}</td><td>${esc(o.dtype)}</td><td class="num">${sev}</td>
    <td class="num">${fmt(o.norm_l2)}</td><td class="num">${fmt(o.max_abs)}</td><td class="num">${fmt(o.max_rel)}</td>
    <td class="num">${fmtCos(o.cosine)}</td><td class="num">${fmt(o.budget && o.budget.norm_l2)}</td><td class="reason">${esc(o.reason)}</td></tr>`;
}

async function loadOps(p, cid, h, s, offset, reload, ctx) {
  const q = new URLSearchParams({ limit: PAGE, offset, fold: s.fold === "0" ? "false" : "true" });
  for (const k of ["verdict", "search", "module", "op"]) if (s[k]) q.set(k, s[k]);
  const page = await api(`/comparisons/${enc(cid)}/op-groups?${q}`);
  if (ctx.stale()) return;
  $("#ops-count").textContent = `(${page.count}${page.folded ? " rows, inherited failures folded" : ""})`;
  $("#ops tbody").innerHTML = page.data.map((g, i) => {
    let html = opRow(p, h, cid, g.op, g.inherited_count ? "root" : "");
    if (g.inherited_count) {
      html += `<tr class="fold-toggle" data-group="${i}"><td></td><td colspan="10"><button type="button" class="link" data-group="${i}">
        ▸ ${g.inherited_count} inherited failure${g.inherited_count > 1 ? "s carry" : " carries"} this op's error downstream</button></td></tr>`;
      html += g.inherited.map((x) => opRow(p, h, cid, x, `child g${i}`)).join("");
      if (g.inherited_count > g.inherited.length) {
        html += `<tr class="child g${i}"><td></td><td colspan="10" class="empty">… ${g.inherited_count - g.inherited.length} more: untick "fold" to page through all</td></tr>`;
      }
    }
    return html;
  }).join("") || `<tr><td colspan="11" class="empty">No op matches these filters.</td></tr>`;
  $$("#ops button[data-group]").forEach((b) => b.addEventListener("click", () => {
    const open = b.classList.toggle("open");
    b.textContent = b.textContent.replace(open ? "▸" : "▾", open ? "▾" : "▸");
    $$(`#ops tr.child.g${b.dataset.group}`).forEach((tr) => tr.classList.toggle("shown", open));
  }));
  pager($("#ops-pager"), { offset, limit: PAGE, count: page.count }, reload);
}
