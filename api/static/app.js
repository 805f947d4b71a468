// opband dashboard: a hash router over the pages; every view has a permalink.
//   #/p/{project}                     overview: targets x latest verdict, open regressions, recent comparisons, drift
//   #/p/{project}/heatmap?target=     ops x runs, colour = severity
//   #/p/{project}/regressions?status= regressions with acknowledge / accept-with-expiry, and their audit
//   #/p/{project}/baselines           baselines and their comparisons
//   #/comparison/{id}?verdict=&module=&op=&search=&fold=&offset=   every op of one comparison
//   #/op/{project}/{key}?target=&metric=&run=                      one op's history, band, histogram, stats
"use strict";
import { $, $$, api, esc, enc, notice, TOKEN_KEY, AUTHOR_KEY, token, author } from "./ui.js";
import * as overview from "./page_overview.js";
import * as comparison from "./page_comparison.js";
import * as op from "./page_op.js";
import * as heatmap from "./page_heatmap.js";
import * as regressions from "./page_regressions.js";
import * as baselines from "./page_baselines.js";

const PROJECT_PAGES = { "": overview, heatmap, regressions, baselines };
let generation = 0;
let projects = [];

/** The page and its parameters named by the current hash. */
export function parseHash(hash = location.hash) {
  const [path, query = ""] = hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const q = Object.fromEntries(new URLSearchParams(query));
  if (parts[0] === "p" && parts[1]) return { page: PROJECT_PAGES[parts[2] || ""], name: parts[2] || "", project: parts[1], q };
  if (parts[0] === "comparison" && parts[1]) return { page: comparison, name: "comparison", id: parts[1], q };
  if (parts[0] === "op" && parts[1] && parts.length >= 3) {
    return { page: op, name: "op", project: parts[1], key: parts.slice(2).join("/"), q };
  }
  return { page: null, name: "home", q };
}

function setProject(project) {
  const sel = $("#project");
  if (project && ![...sel.options].some((o) => o.value === project)) sel.add(new Option(project, project));
  if (project) sel.value = project;
  $$("#nav a[data-page]").forEach((a) => {
    a.href = project ? `#/p/${enc(project)}${a.dataset.page ? "/" + a.dataset.page : ""}` : "#/";
  });
}

function markNav(name) {
  $$("#nav a[data-page]").forEach((a) => a.classList.toggle("active", a.dataset.page === name));
}

async function route() {
  const mine = ++generation;
  const view = $("#view");
  const r = parseHash();
  if (!r.page) {  // home: the first project, or the legacy ?project= link
    const wanted = new URLSearchParams(location.search).get("project");
    const first = wanted || projects[0]?.name;
    if (first) { location.replace(`#/p/${enc(first)}`); return; }
    view.innerHTML = `<section><h2>No public projects</h2><p class="empty">Upload two bundles and compare them
      (<code>opband gate</code> or <code>opband demo</code>). A private project is not listed: set its token under
      <b>token</b> and open it by name.</p>
      <form id="open-project" class="filters"><label>project <input name="project" required placeholder="name"></label><button>open</button></form></section>`;
    $("#open-project").addEventListener("submit", (e) => { e.preventDefault(); location.hash = `#/p/${enc(e.target.elements.project.value.trim())}`; });
    return;
  }
  if (r.project) setProject(r.project);
  markNav(r.name);
  view.innerHTML = `<p class="loading">loading…</p>`;
  $("#crumbs").innerHTML = "";
  try {
    const stale = () => mine !== generation;
    await r.page.render(view, r, { stale, setProject, crumbs: (html) => { $("#crumbs").innerHTML = html; } });
    if (!stale()) $("#status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    if (mine !== generation) return;
    view.innerHTML = `<section><div id="page-error"></div></section>`;
    notice($("#page-error"), e.message + (e.status === 401 || e.status === 403 ? " (set a token under 'token', top right)" : ""));
  }
}

async function loadProjects() {
  try {
    projects = (await api("/projects")).data;
  } catch (e) {
    projects = [];
  }
  const sel = $("#project");
  sel.innerHTML = projects.map((p) => `<option value="${esc(p.name)}">${esc(p.name)}</option>`).join("");
}

function settings() {
  $("#token").value = token();
  $("#author").value = author();
  $("#settings-form").addEventListener("submit", (e) => {
    e.preventDefault();
    localStorage.setItem(TOKEN_KEY, $("#token").value.trim());
    localStorage.setItem(AUTHOR_KEY, $("#author").value.trim());
    $("#settings").open = false;
    loadProjects().then(route);
  });
}

$("#project").addEventListener("change", (e) => { location.hash = `#/p/${enc(e.target.value)}`; });
window.addEventListener("hashchange", route);
settings();
loadProjects().then(route);
