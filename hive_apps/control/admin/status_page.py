"""``GET /admin/``: one self-contained status page (inline CSS and JS, nothing fetched from elsewhere).

The page itself holds no state and needs no token (``control/admin/guard.py`` lets only this shell
through); its script asks for the admin token in a field, keeps it in the tab's
``sessionStorage`` (never in the URL), and fetches ``/admin/nodes``, ``/admin/gpus``,
``/admin/models``, ``/admin/load`` and ``/admin/history`` with it in the ``Authorization`` header
every few seconds. It draws every node and device with a memory bar and a sparkline of the last
hour, every model with its state (times relative, the absolute one on hover), load and requests
over the last hour (requests/s, tokens/s in and out, running and waiting against planned capacity,
p50 time to first token, wakes with their durations), and a detail view of one model's plan (why
each replica is where it is) and its LoRA adapters with the replicas holding each (``/admin/adapters``). With the token it can sleep, wake and delete a model, deploy one after
a dry-run preview of the same ``/admin/plan`` answer, and pre-fetch weights onto nodes
(``POST /admin/weights``; ``GET /admin/weights`` lists each node's cache). Every value is drawn
as text (``el`` appends strings as text nodes; nothing is ever parsed as HTML): a model id or
message with markup in it stays text, and a number the page computes with is checked to be one
(``num``) before it reaches a chart's points.
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
#state, #since { color: var(--idle); } #state.err { color: var(--bad); }
#notice { margin: .4rem 0; padding: .3rem .6rem; border-radius: 4px; } #notice.err { background: #fee2e2; color: var(--bad); }
#notice.ok { background: #dcfce7; color: #166534; } #notice:empty { display: none; }
.node { background: #fff; border: 1px solid #d1d5db; border-radius: 6px; padding: .6rem .8rem; margin: .5rem 0; }
.node h3 { margin: 0 0 .3rem; font-size: 1rem; } .node .meta { color: var(--idle); font-weight: normal; font-size: .85rem; }
.dev { display: grid; grid-template-columns: 14rem 1fr 13rem; gap: .2rem .8rem; align-items: center; margin: .35rem 0; }
.bar { position: relative; display: flex; height: 18px; border-radius: 3px; overflow: hidden; background: var(--free); }
.bar span { height: 100%; } .bar .res { background: var(--res); } .bar .for { background: var(--for); }
.bar .dor { background: repeating-linear-gradient(45deg, var(--dor) 0 4px, transparent 4px 8px); }
.bar .used { position: absolute; left: 0; bottom: 0; height: 3px; background: var(--used); }
.nums { grid-column: 2; color: #374151; font-size: .8rem; }
.chips { grid-column: 2; display: flex; flex-wrap: wrap; gap: .25rem; }
.chip { font-size: .78rem; padding: 0 .35rem; border-radius: 3px; background: #dbeafe; border: 1px solid var(--res); }
.chip.dormant { background: #ede9fe; border: 1px dashed var(--dor); }
.legend span:not(#since) { display: inline-block; width: .8rem; height: .8rem; vertical-align: middle; margin: 0 .2rem 0 .8rem; border-radius: 2px; }
table { border-collapse: collapse; background: #fff; } th, td { border: 1px solid #d1d5db; padding: .25rem .5rem; text-align: left; vertical-align: top; }
.st { font-weight: 600; } .st.ready { color: var(--ok); } .st.degraded, .st.healing, .st.waking, .st.deploying, .st.scaling { color: var(--warn); }
.st.failed, .st.destroyed, .st.deleting { color: var(--bad); } .st.sleeping { color: var(--dor); }
code { font-size: .85rem; } small, .muted { color: var(--idle); }
svg.spark { display: block; background: #f9fafb; border: 1px solid #e5e7eb; }
svg.spark .a { fill: none; stroke: var(--res); stroke-width: 1.5; } svg.spark .b { fill: none; stroke: var(--warn); stroke-width: 1.2; }
svg.spark .c { fill: none; stroke: var(--dor); stroke-width: 1.2; stroke-dasharray: 3 2; } svg.spark .d { fill: none; stroke: var(--used); stroke-width: 1; }
svg.spark .e { fill: none; stroke: var(--ok); stroke-width: 1.5; } svg.spark .w { stroke: var(--dor); stroke-width: 2; }
.hist .lbl { font-size: .72rem; color: var(--idle); margin-top: .1rem; }
button { font: inherit; padding: .05rem .45rem; margin: .1rem .15rem 0 0; } button.danger { color: var(--bad); }
#detail { background: #fff; border: 1px solid #d1d5db; border-radius: 6px; padding: .6rem .8rem; margin: .5rem 0; }
#detail:empty { display: none; } #detail h3 { margin: 0 0 .4rem; }
.rej { color: var(--bad); } pre { background: #f3f4f6; padding: .5rem; overflow: auto; max-height: 18rem; font-size: .8rem; }
#deploy, #weights { display: grid; grid-template-columns: 12rem 20rem; gap: .3rem .6rem; align-items: center; }
#deploy textarea { grid-column: 1 / 3; width: 33rem; height: 4rem; font-family: monospace; }
#deploy .row, #weights .row { grid-column: 1 / 3; }
</style></head>
<body>
<h1>Ray Hive</h1>
<form id="auth" autocomplete="off">
  <label for="token">Admin token</label>
  <input id="token" type="password" placeholder="HIVE_ADMIN_TOKEN (kept in this tab only)">
  <button type="submit">Use</button>
  <span id="state">enter the admin token</span>
</form>
<div id="notice" role="status"></div>
<div class="legend">memory:<span style="background:var(--res)"></span>reserved by the hive<span style="background:var(--for)"></span>foreign
<span style="background:var(--free)"></span>free<span style="background:repeating-linear-gradient(45deg,var(--dor) 0 3px,#fff 3px 6px)"></span>dormant (sleeping models' last place)
<span style="background:var(--used);height:3px"></span>used · charts: the last hour, one point a minute (hover a chart for what it draws) <span id="since"></span></div>
<h2>Nodes and devices</h2>
<div id="nodes"></div>
<h2>Models</h2>
<table id="models"><thead><tr><th>model</th><th>state</th><th>replicas</th><th>load / planned capacity</th><th>last hour</th><th>route</th><th>message</th><th>actions</th></tr></thead><tbody id="models-body"></tbody></table>
<div id="detail"></div>
<h2>Deploy</h2>
<form id="deploy" autocomplete="off">
  <label for="d-model_id">model_id</label><input id="d-model_id" required>
  <label for="d-model">model (Hub name, s3:// or folder)</label><input id="d-model" required>
  <label for="d-engine">engine</label><select id="d-engine"><option>vllm</option><option>sim</option></select>
  <label for="d-gpu">gpu (comma-separated device ids; empty: the planner picks)</label><input id="d-gpu">
  <label for="d-replicas">replicas</label><input id="d-replicas" type="number" min="1" value="1">
  <label for="d-max_input_prompt_length">max_input_prompt_length</label><input id="d-max_input_prompt_length" type="number" min="1" value="1024">
  <label for="d-max_output_prompt_length">max_output_prompt_length</label><input id="d-max_output_prompt_length" type="number" min="1" value="1024">
  <label for="d-sleep_timeout">sleep_timeout (s; empty: never sleeps)</label><input id="d-sleep_timeout" type="number" min="0">
  <label for="d-extra">other fields (a JSON object, merged in)</label><span></span>
  <textarea id="d-extra" spellcheck="false">{}</textarea>
  <div class="row"><button type="button" id="d-preview">Preview plan (dry run)</button><button type="submit" id="d-submit">Deploy</button></div>
  <div class="row">JSON body (POST /admin/models, or /admin/plan for a dry run):<pre id="d-body"></pre></div>
  <div class="row" id="d-plan"></div>
</form>
<h2>Weights</h2>
<form id="weights" autocomplete="off">
  <label for="w-model">source (org/name[@revision] or s3://bucket/prefix)</label><input id="w-model" required>
  <label for="w-nodes">nodes (comma-separated names; empty: every node with a GPU)</label><input id="w-nodes">
  <div class="row"><button type="submit" id="w-submit">Pre-fetch (POST /admin/weights)</button>
    <small>a later deploy or wake of this source starts without a download; nothing is served</small></div>
  <div class="row" id="w-result"></div>
</form>
<div id="w-cache"></div>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
const base = location.pathname.replace(/\/+$/, "");  // /admin
let token = sessionStorage.getItem("hive-admin-token") || "";
let selected = "";  // the model whose detail view is open
let hist = null;  // GET /admin/history, refreshed every few refreshes
let refreshes = 0;
const $ = (id) => document.getElementById(id);
const gib = (b) => (b / 2 ** 30).toFixed(1);
const SVG = "http://www.w3.org/2000/svg";
// every value is appended as a text node or set as an attribute: nothing the hive sends is parsed as HTML
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
}
function ago(sec) {
  const s = Math.max(0, Math.round(sec));
  if (s < 60) return s + " s"; if (s < 3600) return Math.round(s / 60) + " min";
  if (s < 86400) return (s / 3600).toFixed(1) + " h"; return (s / 86400).toFixed(1) + " days";
}
// a time a person reads: relative, with the absolute time on hover
function when(epoch, prefix, suffix) {
  if (typeof epoch !== "number") return "";
  const d = new Date(epoch * 1000);
  return el("time", { datetime: d.toISOString(), title: d.toLocaleString() }, (prefix || "") + ago(Date.now() / 1000 - epoch) + (suffix === undefined ? " ago" : suffix));
}
async function call(method, path, body) {
  const opts = { method, headers: { Authorization: "Bearer " + token }, cache: "no-store" };
  if (body !== undefined) { opts.headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(body); }
  const r = await fetch(base + path, opts);
  let data = null; try { data = await r.json(); } catch (_) {}
  if (!r.ok) throw new Error(r.status + (data && data.error ? ": " + data.error.message : ""));
  return data;
}
const get = (path) => call("GET", path);
function notice(text, ok) { $("notice").className = ok ? "ok" : "err"; $("notice").textContent = text; }
function pct(part, total) { return total > 0 ? Math.max(0, Math.min(100, 100 * part / total)) : 0; }
// a number the hive sent, or null: a chart's points and the page's sums take only finite numbers
const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
const fix = (v, d) => (num(v) === null ? "–" : v.toFixed(d));
// a small chart of one or more series over the history's window; each series: [class, [[t, v], ...]] (a
// point whose value is not a number is left out: a gap); marks: [[t, text], ...] drawn as ticks with a hover text
function spark(series, label, w, h, marks) {
  w = w || 200; h = h || 34;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "spark"); svg.setAttribute("width", w); svg.setAttribute("height", h);
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`); svg.setAttribute("data-chart", label);
  const title = document.createElementNS(SVG, "title"); title.textContent = label; svg.append(title);
  const now = num(hist && hist.now) || Date.now() / 1000, span = 3600;
  const x = (t) => (w * (1 - (now - t) / span)).toFixed(1);
  const shown = series.map(([cls, pts]) => [cls, pts.filter(([t, v]) => num(t) !== null && num(v) !== null && t >= now - span)]);
  const peak = Math.max(0, ...shown.flatMap(([, pts]) => pts.map(([, v]) => v)));
  svg.setAttribute("data-max", String(peak));  // the highest value drawn (tests read it; 0: a flat line)
  const max = Math.max(1e-9, peak);
  for (const [cls, pts] of shown) {
    if (!pts.length) continue;
    const xy = pts.map(([t, v]) => `${x(t)},${(h - 2 - (h - 4) * v / max).toFixed(1)}`);
    if (xy.length === 1) xy.push(xy[0].replace(/^[^,]+/, (x0) => String(Math.min(w, +x0 + 3))));
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("class", cls); line.setAttribute("points", xy.join(" "));
    svg.append(line);
  }
  for (const [t, text] of (marks || []).filter(([t]) => num(t) !== null && t >= now - span)) {
    const tick = document.createElementNS(SVG, "line");
    tick.setAttribute("class", "w"); tick.setAttribute("data-mark", "");
    tick.setAttribute("x1", x(t)); tick.setAttribute("x2", x(t)); tick.setAttribute("y1", 0); tick.setAttribute("y2", h);
    const hover = document.createElementNS(SVG, "title"); hover.textContent = text; tick.append(hover);
    svg.append(tick);
  }
  return svg;
}
function deviceChart(id) {
  const pts = (hist && hist.devices[id]) || [];
  if (!pts.length) return el("small", {}, "no history yet");
  const s = (f) => pts.map((p) => [p.t, f(p)]);
  return el("div", { title: "reserved (blue), used (black), dormant (dashed), the last hour, GiB" },
    spark([["a", s((p) => p.reserved_bytes)], ["d", s((p) => p.used_bytes)], ["c", s((p) => p.dormant_bytes)]], "memory " + id),
    el("small", {}, `peak used ${gib(Math.max(...pts.map((p) => p.used_bytes)))} GiB`));
}
const ms = (sec) => (num(sec) === null ? "–" : sec < 1 ? Math.round(sec * 1000) + " ms" : sec.toFixed(2) + " s");
function modelChart(id) {
  const pts = (hist && hist.models[id]) || [];
  if (!pts.length) return el("small", {}, "no history yet");
  const s = (f) => pts.map((p) => [p.t, f(p)]);
  const last = pts[pts.length - 1], wakes = (hist.wakes[id] || []);
  const woke = wakes.map((w) => [w.at, `woke in ${fix(w.total_s, 1)} s (${w.how})`]);
  const peak = (f) => Math.max(0, ...pts.map(f).filter((v) => num(v) !== null));
  const ttft = pts.filter((p) => num(p.ttft_p50_s) !== null), lastTtft = ttft.length ? ttft[ttft.length - 1].ttft_p50_s : null;
  return el("div", { title: "per minute, the last hour: requests/s (blue, wakes as purple ticks); tokens/s out (blue) and in (orange); " +
                            "running + waiting (orange) against planned capacity (dashed); p50 time to first token (green)" },
    spark([["a", s((p) => p.requests_per_s)]], "requests/s " + id, 160, 26, woke),
    el("div", { class: "lbl" }, `${fix(last.requests_per_s, 2)} req/s now · peak ${fix(peak((p) => p.requests_per_s), 2)}`),
    spark([["a", s((p) => p.generation_tokens_per_s)], ["b", s((p) => p.prompt_tokens_per_s)]], "tokens/s " + id, 160, 26),
    el("div", { class: "lbl", "data-tokens": "" }, `${fix(last.generation_tokens_per_s, 1)} tok/s out, ${fix(last.prompt_tokens_per_s, 1)} in · ` +
      `peak out ${fix(peak((p) => p.generation_tokens_per_s), 1)}`),
    spark([["b", s((p) => p.running + p.waiting)], ["c", s((p) => p.capacity)]], "load " + id, 160, 26),
    el("div", { class: "lbl" }, `running + waiting: peak ${fix(peak((p) => p.running + p.waiting), 0)} of ${fix(last.capacity, 0)} planned`),
    spark([["e", s((p) => p.ttft_p50_s)]], "p50 TTFT " + id, 160, 26),
    el("div", { class: "lbl", "data-ttft": "" }, `p50 TTFT ${ms(lastTtft)}` + (ttft.length ? ` · worst minute ${ms(peak((p) => p.ttft_p50_s))}` : " (no first token yet)")),
    el("div", { class: "lbl", "data-wakes": String(wakes.length) }, wakes.length
      ? `${wakes.length} wake(s): ` + wakes.slice(-4).map((w) => fix(w.total_s, 1) + " s").join(", ") + (wakes.length > 4 ? " (last 4)" : "")
      : "no wakes"));
}
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
  const chart = el("div", { class: "hist", "data-history": d.device.id, style: "grid-row: 1 / 4; grid-column: 3" }, deviceChart(d.device.id));
  return el("div", { class: "dev", "data-device": d.device.id },
    el("div", {}, el("b", {}, d.device.id), " ", d.device.name), bar, chart, nums, chips);
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
// each action asks the API and says what it answered; those that drop traffic ask first
async function act(what, m) {
  const id = m.model_id;
  if (what === "delete" && !confirm(`Delete ${id}? Its replicas stop and requests to it fail from now on.`)) return;
  try {
    const r = what === "delete" ? await call("DELETE", "/models/" + encodeURIComponent(id))
      : await call("POST", `/models/${encodeURIComponent(id)}/${what}`);
    notice(`${what} ${id}: ` + (r && r.status ? r.status : "done") + (r && r.message ? " · " + r.message : ""), true);
  } catch (e) { notice(`${what} ${id} refused: ${e.message}`, false); }
  refresh();
}
function actions(m) {
  const b = (what, label, cls) => { const x = el("button", { type: "button", "data-action": what, class: cls || "" }, label); x.addEventListener("click", () => act(what, m)); return x; };
  const open = el("button", { type: "button", "data-action": "detail" }, selected === m.model_id ? "hide plan" : "why here?");
  open.addEventListener("click", () => { selected = selected === m.model_id ? "" : m.model_id; refresh(); });
  const out = [open];
  if (m.can_sleep && (m.status === "ready" || m.status === "degraded")) out.push(b("sleep", "sleep now"));
  if (m.status === "sleeping") out.push(b("wake", "wake now"));
  if (m.status !== "deleting") out.push(b("delete", "delete", "danger"));
  return out;
}
function stateCell(m) {
  const kids = [m.status + (m.resident || !m.sleep_mode ? "" : " (" + m.sleep_mode + ")")];
  if (m.status === "sleeping" && m.slept_at) kids.push(el("br"), when(m.slept_at, "for ", ""));
  return el("td", { class: "st " + m.status, "data-status": m.status }, ...kids,
    ...Object.entries(m.fetch || {}).map(([node, f]) => el("div", { class: "fetch", "data-fetch": node },
      `fetching on ${node}: ${gib(f.bytes_done)} / ${gib(f.bytes_total)} GiB, ${(f.rate_bytes_per_s / 2 ** 20).toFixed(0)} MiB/s`)));
}
function drawModels(models, load) {
  $("models-body").replaceChildren(...models.map((m) => {
    const now = Object.values(load[m.model_id] || {});
    const busy = now.reduce((s, r) => s + r.running + r.waiting, 0);
    const reps = Object.entries(m.replicas);
    const seqs = reps.filter(([r]) => !(r in (m.lost_replicas || {}))).reduce((s, [, r]) => s + r.settings.max_num_seqs, 0);
    const where = reps.map(([r, p]) => `${r}: ${p.devices.join("+")}`).join(", ");
    return el("tr", { "data-model": m.model_id },
      el("td", {}, el("b", {}, m.model_id), el("br"), el("small", {}, m.model + " · " + m.engine)),
      stateCell(m),
      el("td", {}, where || "none"),
      el("td", { "data-load": busy }, m.resident ? `${busy} / ${seqs} sequences (${Math.round(pct(busy, seqs))} %)` : `${seqs} when awake`),
      el("td", { class: "hist", "data-history": m.model_id }, modelChart(m.model_id)),
      el("td", {}, el("code", {}, m.route + "/v1"), " and ", el("code", {}, `${m.openai_v1} model=${m.model_id}`)),
      el("td", { "data-message": "" }, m.message || ""),
      el("td", { class: "actions" }, ...actions(m)));
  }));
}
const mib = (b) => (b / 2 ** 20).toFixed(0) + " MiB";
function planTables(replicas, rejected, notes) {
  const head = ["replica", "node / devices", "settings", "memory per device: weights / KV cache / activations / overhead", "engine start"];
  const rows = Object.entries(replicas).map(([r, p]) => el("tr", { "data-plan-replica": r },
    el("td", {}, r), el("td", {}, `${p.node} · ${p.devices.join(" + ")} (${p.device_kind})`),
    el("td", {}, `max_num_seqs ${p.settings.max_num_seqs} · max_num_batched_tokens ${p.settings.max_num_batched_tokens}` +
      ` · max_model_len ${p.settings.max_model_len} · tensor_parallel_size ${p.settings.tensor_parallel_size}` +
      ` · kv_cache_memory ${gib(p.settings.kv_cache_memory_bytes)} GiB` + (p.settings.enforce_eager ? " · enforce_eager" : "")),
    el("td", {}, `${gib(p.memory.weights)} / ${gib(p.memory.kv_cache)} / ${mib(p.memory.activations)} / ${mib(p.memory.overhead)}` +
      ` · reserved ${gib(p.reservation_bytes)} GiB`),
    el("td", {}, p.engine_start_s == null ? "" : p.engine_start_s.toFixed(1) + " s")));
  return [
    el("table", { class: "plan" }, el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))), el("tbody", {}, ...rows)),
    el("h4", {}, "devices not chosen"),
    rejected.length ? el("ul", { class: "rejected" }, ...rejected.map((x) => el("li", { class: "rej", "data-rejected": x.device }, x.device + ": " + x.reason)))
      : el("p", { class: "muted" }, "none: every device that could hold it was considered"),
    el("h4", {}, "notes"),
    notes.length ? el("ul", { class: "notes" }, ...notes.map((n) => el("li", {}, n))) : el("p", { class: "muted" }, "none"),
  ];
}
async function drawDetail() {
  if (!selected) { $("detail").replaceChildren(); return; }
  let m;
  try { m = await get("/models/" + encodeURIComponent(selected)); } catch (e) { selected = ""; $("detail").replaceChildren(); return; }
  const w = m.last_wake, wakes = (hist && hist.wakes[m.model_id]) || [];
  let adapters = [];  // its LoRA adapters, with the replicas whose engine holds each now
  try { adapters = ((await get("/adapters")).adapters || []).filter((a) => a.base === m.model_id); } catch (e) { adapters = []; }
  const times = [el("span", {}, "deployed "), when(m.created_at)];
  if (m.ready_at) times.push(el("span", {}, m.deploy_seconds != null ? ` · took ${m.deploy_seconds.toFixed(1)} s` : ""));
  $("detail").replaceChildren(el("div", { "data-detail": m.model_id },
    el("h3", {}, "Why ", m.model_id, " is where it is"), el("p", {}, ...times),
    ...planTables(m.replicas, m.rejected || [], m.notes || []),
    el("h4", {}, "last wake"),
    w ? el("p", { "data-wake": "" }, when(w.ready_at, "", " ago"), ` (${w.how}): ${w.total_s.toFixed(1)} s in all = placement ${w.placement_s.toFixed(1)} s` +
      (w.engine_start_s != null ? ` + engine ${w.engine_start_s.toFixed(1)} s` : "") + (w.warm_up_s != null ? ` + warm-up ${w.warm_up_s.toFixed(2)} s` : "") +
      (w.evicted.length ? ` · put to sleep for it: ${w.evicted.join(", ")}` : "")) : el("p", { class: "muted" }, "it has not slept and woken"),
    wakes.length > 1 ? el("p", {}, "wakes in the last hour and a half: " + wakes.map((x) => fix(x.total_s, 1) + " s").join(", ")) : el("span"),
    adapters.length ? el("h4", {}, "LoRA adapters") : el("span"),
    adapters.length ? el("ul", {}, ...adapters.map((a) => el("li", { "data-adapter": "" }, `${a.model_id} · rank ${a.rank} · ` +
      ((a.loaded_on || []).length ? "loaded on " + a.loaded_on.join(", ") : "not loaded now")))) : el("span"),
    m.policy_warning ? el("p", { class: "rej" }, m.policy_warning) : el("span")));
}
// --- deploy: the form builds the JSON body; preview asks /admin/plan (reserves nothing) ----------
function deployBody() {
  const body = JSON.parse($("d-extra").value.trim() || "{}");
  if (typeof body !== "object" || body === null || Array.isArray(body)) throw new Error("other fields: not a JSON object");
  for (const k of ["model_id", "model", "engine"]) if ($("d-" + k).value.trim()) body[k] = $("d-" + k).value.trim();
  for (const k of ["replicas", "max_input_prompt_length", "max_output_prompt_length", "sleep_timeout"])
    if ($("d-" + k).value !== "") body[k] = Number($("d-" + k).value);
  const gpu = $("d-gpu").value.split(",").map((x) => x.trim()).filter(Boolean);
  if (gpu.length) body.gpu = gpu.length === 1 ? gpu[0] : gpu;
  return body;
}
function showBody() {
  try { $("d-body").textContent = JSON.stringify(deployBody(), null, 2); } catch (e) { $("d-body").textContent = e.message; }
}
async function preview() {
  let body;
  try { body = deployBody(); } catch (e) { notice(e.message, false); return; }
  try {
    const plan = await call("POST", "/plan", body);
    const reps = {};
    for (const p of plan.replicas) reps["r" + p.index] = { node: p.node_name, devices: p.devices, device_kind: p.device_kind,
      settings: p.settings, memory: p.memory, reservation_bytes: p.reservation_bytes, engine_start_s: null };
    $("d-plan").replaceChildren(el("h4", {}, "dry run: where it would go (nothing reserved)"), ...planTables(reps, plan.rejected || [], plan.notes || []));
    notice("plan of " + body.model_id + ": " + plan.replicas.length + " replica(s); nothing was reserved", true);
  } catch (e) {
    $("d-plan").replaceChildren(el("p", { class: "rej" }, "refused: " + e.message));
    notice("plan refused: " + e.message, false);
  }
}
async function deploy(ev) {
  ev.preventDefault();
  let body;
  try { body = deployBody(); } catch (e) { notice(e.message, false); return; }
  $("d-submit").disabled = true;
  try {
    const r = await call("POST", "/models", body);
    notice(`deploy ${body.model_id}: ${r.status}` + (r.message ? " · " + r.message : ""), true);
    $("d-plan").replaceChildren();
  } catch (e) { notice("deploy refused: " + e.message, false); }
  $("d-submit").disabled = false;
  refresh();
}
// --- weights: pre-fetch a source onto nodes (POST /admin/weights), and what each node's cache holds ---------
async function prefetch(ev) {
  ev.preventDefault();
  const body = { model: $("w-model").value.trim() };
  const nodes = $("w-nodes").value.split(",").map((x) => x.trim()).filter(Boolean);
  if (nodes.length) body.nodes = nodes;
  $("w-submit").disabled = true;
  try {
    const r = await call("POST", "/weights", body);
    const per = Object.entries(r.nodes || {}).map(([node, p]) => el("li", { "data-prefetch": node },
      `${node}: ${p.state}` + (p.bytes_total ? ` · ${gib(p.bytes_done)} / ${gib(p.bytes_total)} GiB` : "") + (p.error ? " · " + p.error : "")));
    $("w-result").replaceChildren(el("p", {}, `${r.model} at revision ${r.revision}: ${gib(r.bytes)} GiB`), el("ul", {}, ...per));
    notice(`pre-fetch ${body.model}: asked on ${per.length} node(s)`, true);
  } catch (e) {
    $("w-result").replaceChildren(el("p", { class: "rej" }, "refused: " + e.message));
    notice("pre-fetch refused: " + e.message, false);
  }
  $("w-submit").disabled = false;
  await drawWeights();
}
async function drawWeights() {
  let w;
  try { w = await get("/weights"); } catch (e) { $("w-cache").replaceChildren(el("p", { class: "muted" }, "weight caches not read: " + e.message)); return; }
  const rows = Object.entries(w.nodes || {}).flatMap(([node, c]) => c.error
    ? [el("tr", { "data-cache-node": node }, el("td", {}, node), el("td", { colspan: "4", class: "rej" }, c.error))]
    : (c.weights || []).map((x) => el("tr", { "data-cached": x.source, "data-cache-node": node },
      el("td", {}, node), el("td", {}, x.source), el("td", {}, String(x.revision).slice(0, 12)),
      el("td", {}, `${gib(x.bytes)} GiB` + (x.complete ? "" : " (partial)") + (x.in_use ? " · in use" : "")),
      el("td", {}, when(x.last_used)))));
  $("w-cache").replaceChildren(rows.length
    ? el("table", {}, el("thead", {}, el("tr", {}, ...["node", "source", "revision", "size", "last used"].map((h) => el("th", {}, h)))), el("tbody", {}, ...rows))
    : el("p", { class: "muted" }, "no weights cached on any node"));
}
async function refresh() {
  if (!token) return;
  try {
    const slow = refreshes++ % 5 === 0;  // the history and the weight caches change slowly: every fifth refresh
    if (slow || !hist) hist = await get("/history");
    if (slow) drawWeights();  // not awaited: a slow node's cache must not hold the rest of the page
    const [nodes, gpus, models, load] = await Promise.all([get("/nodes"), get("/gpus"), get("/models"), get("/load")]);
    drawNodes(nodes.nodes, gpus.devices);
    drawModels(models.models, load.models);
    await drawDetail();
    $("since").replaceChildren("(kept by the hive since ", when(hist.since, "", " ago"),
      hist.restarts.length ? `; the admin restarted ${hist.restarts.length} time(s), last ` : "",
      hist.restarts.length ? when(hist.restarts[hist.restarts.length - 1]) : "", ")");
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
$("deploy").addEventListener("submit", deploy);
$("deploy").addEventListener("input", showBody);
$("d-preview").addEventListener("click", preview);
$("weights").addEventListener("submit", prefetch);
showBody();
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
