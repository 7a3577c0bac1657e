"""``GET /admin/``: one self-contained status page (inline CSS and JS, nothing fetched from elsewhere).

The page itself holds no state and needs no token (``control/admin/guard.py`` lets only this shell
through); its script asks for the admin token in a field, keeps it in the tab's
``sessionStorage`` (never in the URL), and fetches ``/admin/nodes``, ``/admin/gpus`` and
``/admin/models`` and ``/admin/load`` with it in the ``Authorization`` header every few seconds. It draws every
node and device with a memory bar (reserved by the hive, foreign, free; dormant marked
inside free, used as a line) and the replicas on each, and every model with its state,
planned capacity and routes.
"""

from __future__ import annotations

import base64
import hashlib

REFRESH_MS = 2000

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Ray Hive status</title>
<style>
:root { --res:#3b82f6; --for:#f59e0b; --free:#e5e7eb; --dor:#a78bfa; --used:#111827; --ok:#16a34a; --warn:#d97706; --bad:#dc2626; --idle:#6b7280; }
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2rem; color: #111827; background: #fafafa; }
h1 { font-size: 1.3rem; margin: 0 0 .6rem; } h2 { font-size: 1.05rem; margin: 1.2rem 0 .4rem; }
#auth { display: flex; gap: .5rem; align-items: center; margin-bottom: .6rem; }
#auth input { width: 22rem; padding: .25rem; }
#state { color: var(--idle); } #state.err { color: var(--bad); }
.node { background: #fff; border: 1px solid #d1d5db; border-radius: 6px; padding: .6rem .8rem; margin: .5rem 0; }
.node h3 { margin: 0 0 .3rem; font-size: 1rem; } .node .meta { color: var(--idle); font-weight: normal; font-size: .85rem; }
.dev { display: grid; grid-template-columns: 14rem 1fr; gap: .2rem .8rem; align-items: center; margin: .35rem 0; }
.bar { position: relative; display: flex; height: 18px; border-radius: 3px; overflow: hidden; background: var(--free); }
.bar span { height: 100%; } .bar .res { background: var(--res); } .bar .for { background: var(--for); }
.bar .dor { background: repeating-linear-gradient(45deg, var(--dor) 0 4px, transparent 4px 8px); }
.bar .used { position: absolute; left: 0; bottom: 0; height: 3px; background: var(--used); }
.nums { grid-column: 2; color: #374151; font-size: .8rem; }
.chips { grid-column: 2; display: flex; flex-wrap: wrap; gap: .25rem; }
.chip { font-size: .78rem; padding: 0 .35rem; border-radius: 3px; background: #dbeafe; border: 1px solid var(--res); }
.chip.dormant { background: #ede9fe; border: 1px dashed var(--dor); }
.legend span { display: inline-block; width: .8rem; height: .8rem; vertical-align: middle; margin: 0 .2rem 0 .8rem; border-radius: 2px; }
table { border-collapse: collapse; background: #fff; } th, td { border: 1px solid #d1d5db; padding: .25rem .5rem; text-align: left; }
.st { font-weight: 600; } .st.ready { color: var(--ok); } .st.degraded, .st.healing, .st.waking, .st.deploying { color: var(--warn); }
.st.failed, .st.destroyed, .st.deleting { color: var(--bad); } .st.sleeping { color: var(--dor); }
code { font-size: .85rem; }
</style></head>
<body>
<h1>Ray Hive</h1>
<form id="auth" autocomplete="off">
  <label for="token">Admin token</label>
  <input id="token" type="password" placeholder="HIVE_ADMIN_TOKEN (kept in this tab only)">
  <button type="submit">Use</button>
  <span id="state">enter the admin token</span>
</form>
<div class="legend">memory:<span style="background:var(--res)"></span>reserved by the hive<span style="background:var(--for)"></span>foreign
<span style="background:var(--free)"></span>free<span style="background:repeating-linear-gradient(45deg,var(--dor) 0 3px,#fff 3px 6px)"></span>dormant (sleeping models' last place)
<span style="background:var(--used);height:3px"></span>used</div>
<h2>Nodes and devices</h2>
<div id="nodes"></div>
<h2>Models</h2>
<table id="models"><thead><tr><th>model</th><th>state</th><th>replicas</th><th>load / planned capacity</th><th>route</th><th>message</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
const base = location.pathname.replace(/\/+$/, "");  // /admin
let token = sessionStorage.getItem("hive-admin-token") || "";
const $ = (id) => document.getElementById(id);
const gib = (b) => (b / 2 ** 30).toFixed(1);
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
}
async function get(path) {
  const r = await fetch(base + path, { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
  if (!r.ok) { let m = r.status + ""; try { m += ": " + (await r.json()).error.message; } catch (_) {} throw new Error(m); }
  return r.json();
}
function pct(part, total) { return total > 0 ? Math.max(0, Math.min(100, 100 * part / total)) : 0; }
function deviceRow(d) {
  const t = d.total_bytes, res = Math.min(d.reserved_bytes, t), fr = Math.min(d.foreign_bytes, t - res);
  const free = Math.max(0, t - res - fr), dor = Math.min(d.dormant_bytes || 0, free);
  const bar = el("div", { class: "bar", title: d.device.id },
    el("span", { class: "res", style: `width:${pct(res, t)}%` }),
    el("span", { class: "for", style: `width:${pct(fr, t)}%` }),
    el("span", { class: "dor", style: `width:${pct(dor, t)}%` }),
    el("span", { class: "used", style: `width:${pct(d.used_bytes, t)}%` }));
  const chips = el("div", { class: "chips" },
    ...d.replicas.map((r) => el("span", { class: "chip", "data-replica": r }, r)),
    ...(d.dormant || []).map((r) => el("span", { class: "chip dormant", "data-dormant": r }, r + " (asleep)")));
  const nums = el("div", { class: "nums" }, `total ${gib(t)} GiB · used ${gib(d.used_bytes)} · reserved ${gib(d.reserved_bytes)}` +
    ` · foreign ${gib(d.foreign_bytes)} · dormant ${gib(d.dormant_bytes || 0)} · free ${gib(d.free_bytes)} · available ${gib(d.available_bytes)}`);
  return el("div", { class: "dev", "data-device": d.device.id },
    el("div", {}, el("b", {}, d.device.id), " ", d.device.name), bar, nums, chips);
}
function drawNodes(nodes, devices) {
  const byNode = {};
  for (const d of devices) (byNode[d.device.node_name] ||= []).push(d);
  const names = [...new Set([...nodes.map((n) => n.node_name), ...Object.keys(byNode)])].sort();
  $("nodes").replaceChildren(...names.map((name) => {
    const n = nodes.find((x) => x.node_name === name);
    const disk = n && n.weights_disk;
    const meta = n ? ` ${n.cpu_count} CPUs · host RAM ${gib(n.host_used_bytes)} / ${gib(n.host_total_bytes)} GiB` +
      (disk ? ` · weight cache ${gib(disk.cached_bytes)} GiB, ${gib(disk.free_bytes)} GiB free` : "") +
      (n.error ? ` · monitor error: ${n.error}` : "") : "";
    return el("div", { class: "node", "data-node": name },
      el("h3", {}, name, el("span", { class: "meta" }, meta)),
      ...(byNode[name] || []).map(deviceRow));
  }));
}
function drawModels(models, load) {
  $("models").tBodies[0].replaceChildren(...models.map((m) => {
    const now = Object.values(load[m.model_id] || {});
    const busy = now.reduce((s, r) => s + r.running + r.waiting, 0);
    const reps = Object.entries(m.replicas);
    const seqs = reps.filter(([r]) => !(r in (m.lost_replicas || {}))).reduce((s, [, r]) => s + r.settings.max_num_seqs, 0);
    const where = reps.map(([r, p]) => `${r}: ${p.devices.join("+")}`).join(", ");
    return el("tr", { "data-model": m.model_id },
      el("td", {}, el("b", {}, m.model_id), el("br"), el("small", {}, m.model + " · " + m.engine)),
      el("td", { class: "st " + m.status, "data-status": m.status }, m.status + (m.resident || !m.sleep_mode ? "" : " (" + m.sleep_mode + ")"),
        ...Object.entries(m.fetch || {}).map(([node, f]) => el("div", { class: "fetch", "data-fetch": node },
          `fetching on ${node}: ${gib(f.bytes_done)} / ${gib(f.bytes_total)} GiB, ${(f.rate_bytes_per_s / 2 ** 20).toFixed(0)} MiB/s`))),
      el("td", {}, where || "none"),
      el("td", { "data-load": busy }, m.resident ? `${busy} / ${seqs} sequences (${Math.round(pct(busy, seqs))} %)` : `${seqs} when awake`),
      el("td", {}, el("code", {}, m.route + "/v1"), " and ", el("code", {}, `${m.openai_v1} model=${m.model_id}`)),
      el("td", {}, m.message || ""));
  }));
}
async function refresh() {
  if (!token) return;
  try {
    const [nodes, gpus, models, load] = await Promise.all([get("/nodes"), get("/gpus"), get("/models"), get("/load")]);
    drawNodes(nodes.nodes, gpus.devices);
    drawModels(models.models, load.models);
    $("state").className = ""; $("state").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    $("state").className = "err"; $("state").textContent = "refresh failed: " + e.message;
  }
}
$("auth").addEventListener("submit", (ev) => {
  ev.preventDefault();
  token = $("token").value.trim();
  sessionStorage.setItem("hive-admin-token", token);
  $("token").value = "";
  refresh();
});
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body></html>
""".replace("__REFRESH_MS__", str(REFRESH_MS))


def _script_hash(page: str) -> str:
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()


# Only this page's own script runs, and it talks only to this origin: nothing from a CDN can load.
CSP = (f"default-src 'none'; script-src '{_script_hash(PAGE)}'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src 'self' data:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
