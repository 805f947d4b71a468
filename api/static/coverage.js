// opband coverage page: the op x model matrix of a project (GET /api/v1/projects/{p}/coverage).
// Token-aware calls and escaping come from the dashboard's shared ui.js (a project may need a token to read).
import { $, api as get, esc } from "/static/ui.js";

const stateClass = (s) => s.startsWith("FAIL") ? "fail" : s.startsWith("WARN") ? "warn" : s.startsWith("pass") ? "pass" : "new";
const cell = (s) => s ? `<span class="badge ${stateClass(s)}">${esc(s)}</span>` : "";

async function load() {
  const project = $("#project").value;
  history.replaceState(null, "", "?project=" + encodeURIComponent(project));
  if (!project) return;
  const ops = $("#oplist").value.split(/[\s,]+/).filter(Boolean);
  const query = ops.map((o) => "op=" + encodeURIComponent(o)).join("&");
  try {
    const cov = await get(`/projects/${encodeURIComponent(project)}/coverage${query ? "?" + query : ""}`);
    render(cov);
    $("#status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) { $("#status").textContent = "error: " + e.message; }
}

function render(cov) {
  $("#no-coverage").hidden = cov.ops.length > 0;
  $("#matrix thead").innerHTML = "<tr><th>op</th>" + cov.models.map((m) => `<th>${esc(m)}</th>`).join("") + "</tr>";
  $("#matrix tbody").innerHTML = cov.ops.map((o) => `<tr><td><code>${esc(o.op)}</code></td>` +
    cov.models.map((m) => `<td>${o.models[m] ? cell(o.models[m].state) : ""}</td>`).join("") + "</tr>").join("");
  $("#cov-ops tbody").innerHTML = cov.ops.map((o) => `<tr><td><code>${esc(o.op)}</code></td><td class="num">${o.calls}</td>` +
    `<td>${esc(o.overloads.join(", ") || "-")}</td><td>${esc(o.dtypes.join(", "))}</td><td class="num">${o.shape_classes.length}</td>` +
    `<td>${esc(o.regimes.join(", "))}</td><td>${cell(o.state)}</td>` +
    `<td>${esc(Object.entries(o.bands).map(([k, n]) => `${k} ${n}`).join(", ") || "-")}</td></tr>`).join("");
  const list = cov.op_list;
  $("#share").textContent = list ? `${list.covered.length}/${list.size} covered (${(100 * list.share).toFixed(1)}%)` : "";
  $("#uncovered").textContent = list && list.uncovered.length ? "uncovered: " + list.uncovered.join(", ") : "";
}

async function init() {
  const { data } = await get("/projects");
  const sel = $("#project");
  sel.innerHTML = data.map((p) => `<option>${esc(p.name)}</option>`).join("");
  const wanted = new URLSearchParams(location.search).get("project");
  if (wanted && data.some((p) => p.name === wanted)) sel.value = wanted;
  sel.addEventListener("change", load);
  $("#apply").addEventListener("click", load);
  await load();
}
init().catch((e) => { $("#status").textContent = "error: " + e.message; });
