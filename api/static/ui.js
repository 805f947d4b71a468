// Shared pieces of the dashboard pages: API calls (token-aware), formatting, links, tables, pager.
"use strict";

export const TOKEN_KEY = "opband.token";
export const AUTHOR_KEY = "opband.author";
export const token = () => localStorage.getItem(TOKEN_KEY) || "";
export const author = () => localStorage.getItem(AUTHOR_KEY) || "";

/** Call /api/v1; rejects with the API's own message (its `detail`) so pages can show it. */
export async function api(path, { method = "GET", body } = {}) {
  const headers = {};
  if (token()) headers.Authorization = "Bearer " + token();
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch("/api/v1" + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!r.ok) {
    const detail = (await r.json().catch(() => ({}))).detail;
    const err = new Error(typeof detail === "string" ? detail : (r.statusText || `HTTP ${r.status}`));
    err.status = r.status;
    throw err;
  }
  return r.status === 204 ? null : r.json();
}

export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];
export const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
export const enc = encodeURIComponent;

/** Numbers as a person reads them: 3 significant digits, exponents for very small or large ones. */
export function fmt(v) {
  if (v === null || v === undefined || v === "") return "-";
  if (typeof v === "string") return v;
  if (v === 0) return "0";
  if (typeof v === "boolean") return String(v);
  const a = Math.abs(v);
  return a >= 1e4 || a < 1e-3 ? v.toExponential(2) : String(Number(v.toPrecision(4)));
}
export const badge = (v) => v ? `<span class="badge ${esc(v)}">${esc(v)}</span>` : "-";
/** A timestamp as local "2026-12-01 15:09" (sortable, no ambiguous day/month order). */
export function when(iso) {
  if (!iso) return "-";
  const d = new Date(iso);
  const p2 = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p2(d.getMonth() + 1)}-${p2(d.getDate())} ${p2(d.getHours())}:${p2(d.getMinutes())}`;
}
/** A cosine near 1 as "1 − 1.9e-9", so that budgets like 0.99999999814 stay readable. */
export const fmtCos = (v) => (typeof v !== "number" ? fmt(v) : v >= 1 ? "1" : v > 0.999 ? `1 − ${(1 - v).toExponential(1)}` : fmt(v));
export const short = (id) => esc(String(id || "").slice(0, 8));

export const opHref = (project, key, params = {}) => {
  const q = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== ""));
  return `#/op/${enc(project)}/${enc(key)}${q.toString() ? "?" + q : ""}`;
};
export const comparisonHref = (id, params = {}) => {
  const q = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== ""));
  return `#/comparison/${enc(id)}${q.toString() ? "?" + q : ""}`;
};
export const projectHref = (project, page = "") => `#/p/${enc(project)}${page ? "/" + page : ""}`;

/** Replace the hash's query without adding a history entry per keystroke (filters stay in the permalink). */
export function setQuery(params) {
  const [path] = location.hash.split("?");
  const q = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== "" && v !== false));
  history.replaceState(null, "", path + (q.toString() ? "?" + q : ""));
}

/** The target name of a comparison's target run (variant@device for comparisons made before run names). */
export const targetOf = (c) => c.target_run?.target || `${c.target_variant}@${c.target_device}`;
/** "ref-label → target-label" of a comparison, "-" when neither run has a label. */
export const labelsOf = (c) => (c.reference_run?.label || c.target_run?.label
  ? `${esc(c.reference_run?.label || "-")} → <b>${esc(c.target_run?.label || "-")}</b>` : "-");

export const counts = (c) => Object.entries(c || {}).filter(([, n]) => n).map(([v, n]) => `<span class="count ${esc(v)}">${n} ${esc(v)}</span>`).join(" ");

/** A pager under a paged table: "41-60 of 132" with previous/next; calls go(offset). */
export function pager(el, { offset, limit, count }, go) {
  const last = Math.min(offset + limit, count);
  el.innerHTML = count ? `<button data-go="prev" ${offset === 0 ? "disabled" : ""}>&larr; previous</button>
    <span class="range">${offset + 1}&ndash;${last} of ${count}</span>
    <button data-go="next" ${last >= count ? "disabled" : ""}>next &rarr;</button>` : "";
  el.querySelector("[data-go=prev]")?.addEventListener("click", () => go(Math.max(0, offset - limit)));
  el.querySelector("[data-go=next]")?.addEventListener("click", () => go(offset + limit));
}

/** A message bar inside a page: errors keep the API's words. */
export function notice(el, text, kind = "error") {
  el.innerHTML = text ? `<div class="notice ${kind}" role="${kind === "error" ? "alert" : "status"}">${esc(text)}</div>` : "";
}

/** Runs on an ordinal x axis ("2026-12-01 15:09 · 3fa2c1"): evenly spaced, oldest left, one tick per run. */
export function runAxis(points) {
  const byId = new Map(points.map((p) => [p.comparison_id, p.created_at]));
  const ordered = [...byId.entries()].sort((a, b) => a[1].localeCompare(b[1]) || a[0].localeCompare(b[0]));
  const label = new Map(ordered.map(([id, at]) => [id, `${when(at)} · ${id.slice(0, 6)}`]));
  return { label: (p) => label.get(p.comparison_id), categories: ordered.map(([id]) => label.get(id)) };
}

/** Where a log axis draws an exact 0: a decade below the smallest positive value shown. */
export function zeroFloor(values) {
  const pos = values.filter((v) => typeof v === "number" && v > 0);
  return pos.length ? 10 ** Math.floor(Math.log10(Math.min(...pos)) - 1) : 1e-12;
}

/** The note that explains the ▼ markers drawn at ``zeroFloor`` on a log axis (none when no value is 0). */
export const zeroNote = (values, floor) => (values.some((v) => v === 0) ? [{
  xref: "paper", x: 0, y: Math.log10(floor), text: "▼ exactly 0", showarrow: false, xanchor: "left", yanchor: "bottom",
  font: { size: 10, color: "#57606a" } }] : []);

export const plotConfig = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
export const VERDICT_COLOR = { pass: "#1a7f37", warn: "#bf8700", fail: "#cf222e", new: "#6e7781", missing: "#6e7781" };
