"""GET /admin/: the shell loads without a token, every JSON endpoint still needs one, and the
page is self-contained (its own script only, no other origin)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import time
from urllib.parse import quote

import httpx
from starlette.applications import Starlette
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from hive_apps.control.admin import status_page
from hive_apps.control.admin.guard import AdminGuard
from hive_apps.core.settings import HiveSettings

SETTINGS = HiveSettings(admin_token="s3cret-admin-tok")


def client() -> httpx.AsyncClient:
    """The admin's guard in front of the page and stand-ins for its JSON routes, mounted at /admin as
    Serve mounts the admin (the page through the real Admin app: tests/cluster/test_observability.py)."""

    async def page(_):
        return HTMLResponse(status_page.PAGE, headers={"cache-control": "no-store", "content-security-policy": status_page.CSP})

    async def data(_):
        return JSONResponse({})

    routes = [Route("/", page, methods=["GET"])] + [Route(p, data, methods=["GET", "POST", "DELETE"]) for p in (
        "/gpus", "/nodes", "/models", "/models/x", "/load", "/history", "/models/x/sleep", "/models/x/wake", "/weights",
        "/adapters")]
    guarded = AdminGuard(Starlette(routes=routes), settings=lambda: SETTINGS)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded, root_path="/admin"), base_url="http://h")


async def test_the_shell_loads_without_a_token_and_the_data_does_not():
    async with client() as c:
        for path in ("/admin/",):
            r = await c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
            assert "Ray Hive" in r.text and "s3cret-admin-tok" not in r.text
        for path in ("/admin/gpus", "/admin/nodes", "/admin/models", "/admin/models/x", "/admin/load", "/admin/history",
                     "/admin/weights"):
            r = await c.get(path)
            assert r.status_code == 401, path
            assert (await c.get(path, headers={"authorization": "Bearer s3cret-admin-tok"})).status_code == 200
        for method, path in (("POST", "/admin/models/x/sleep"), ("POST", "/admin/models/x/wake"),
                             ("DELETE", "/admin/models/x"), ("POST", "/admin/models"), ("POST", "/admin/weights")):  # the page's actions
            assert (await c.request(method, path)).status_code == 401, path
        assert (await c.post("/admin/", content=b"{}")).status_code == 405, "the shell is GET only"


async def test_the_page_is_self_contained_and_keeps_the_token_out_of_urls():
    async with client() as c:
        r = await c.get("/admin/")
    html, csp = r.text, r.headers["content-security-policy"]
    assert not re.search(r"(src|href)\s*=\s*[\"'](https?:)?//", html), "nothing loads from another origin"
    bare = html.replace('"http://www.w3.org/2000/svg"', "")  # the SVG namespace names, it loads nothing
    assert "http://" not in bare and "https://" not in bare
    script = html.split("<script>", 1)[1].split("</script>", 1)[0]
    digest = "sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src '{digest}'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    # the token travels in a header set by the script; the form never submits it anywhere
    assert 'Authorization: "Bearer " + token' in script and "ev.preventDefault()" in script
    assert "location.search" not in script and "?token" not in script
    assert r.headers["cache-control"] == "no-store"
    assert status_page.REFRESH_MS <= 5000


# --- issue 31: everything drawn is text; the page's actions and charts ------------------------------
HOSTILE = '<img src=x onerror="alert(1)"><script>alert(2)</script>'

# A minimal DOM in node: elements record their children, attributes and text; any HTML sink
# (innerHTML, outerHTML, insertAdjacentHTML, document.write) is recorded as used, so the test proves the
# page never hands the hive's strings to an HTML parser. fetch answers from canned JSON.
DOM_STUB = r"""
const sinks = [];
class Node {
  constructor(tag) { this.tag = tag; this.kids = []; this.attrs = {}; this.style = {}; this.listeners = {}; this.className = ""; this.value = ""; }
  append(...xs) { for (const x of xs) this.kids.push(typeof x === "string" ? { text: x } : x); }
  replaceChildren(...xs) { this.kids = []; this.append(...xs); }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  addEventListener(k, f) { this.listeners[k] = f; }
  set textContent(v) { this.kids = [{ text: String(v) }]; }
  get textContent() { return this.kids.map((k) => k.text !== undefined ? k.text : k.textContent).join(""); }
  set innerHTML(v) { sinks.push("innerHTML"); } set outerHTML(v) { sinks.push("outerHTML"); }
  insertAdjacentHTML() { sinks.push("insertAdjacentHTML"); }
}
const byId = {};
globalThis.document = {
  createElement: (t) => new Node(t), createElementNS: (ns, t) => new Node(t),
  getElementById: (id) => (byId[id] ||= new Node("#" + id)), write: () => sinks.push("document.write"),
};
globalThis.location = { pathname: "/admin/" };
globalThis.sessionStorage = { getItem: () => "tok", setItem: () => {} };
globalThis.setInterval = () => 0; globalThis.confirm = () => true;
// GET answers DATA[path]; another method DATA["POST /path"]; REFUSE["POST /path"] = [status, message] refuses it
// as the API does. Every call is kept (method, path, body, Authorization).
const calls = [];
globalThis.fetch = async (url, opts) => {
  const path = url.replace("/admin", "").split("?")[0], method = (opts && opts.method) || "GET";
  calls.push([method, path, (opts && opts.body) || null, (opts && opts.headers && opts.headers.Authorization) || null]);
  const refused = REFUSE[method + " " + path];
  if (refused) return { ok: false, status: refused[0], json: async () => ({ error: { message: refused[1] } }) };
  return { ok: true, json: async () => (method === "GET" ? DATA[path] : DATA[method + " " + path]) || {} };
};
function walk(n, out) { out.push(n); for (const k of n.kids || []) walk(k, out); return out; }
"""


def hostile_data(now: float) -> dict:
    replica = {"node": "node-a", "devices": ["node-a:gpu0"], "device_kind": "gpu", "reservation_bytes": 2**30,
               "settings": {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "max_model_len": 1024,
                            "tensor_parallel_size": 1, "kv_cache_memory_bytes": 2**29, "enforce_eager": False},
               "memory": {"weights": 2**29, "kv_cache": 2**29, "activations": 2**20, "overhead": 2**20}, "engine_start_s": 1.5}
    model = {"model_id": HOSTILE, "model": HOSTILE, "engine": "sim", "status": "sleeping", "message": HOSTILE,
             "route": "/" + HOSTILE, "openai_v1": "/v1", "replicas": {"r0": replica}, "resident": False,
             "sleep_mode": "parked", "slept_at": now - 180, "can_sleep": True, "created_at": now - 3600,
             "ready_at": now - 3500, "deploy_seconds": 100.0, "rejected": [{"device": HOSTILE, "reason": HOSTILE}],
             "notes": [HOSTILE], "lost_replicas": {}, "fetch": {},
             "last_wake": {"how": "parked", "requested_at": now - 900, "ready_at": now - 890, "placement_s": 0.1,
                           "engine_start_s": 1.5, "warm_up_s": 0.2, "total_s": 10.0, "evicted": [HOSTILE]}}
    device = {"device": {"id": HOSTILE, "name": HOSTILE, "node_name": HOSTILE}, "total_bytes": 2**34, "used_bytes": 2**30,
              "free_bytes": 2**33, "reserved_bytes": 2**30, "foreign_bytes": 0, "available_bytes": 2**33,
              "replicas": [HOSTILE], "dormant_bytes": 2**30, "dormant": [HOSTILE]}
    point = {"t": now - 60, "requests": 6, "requests_per_s": 0.1, "running": 1, "waiting": 0, "capacity": 8, "resident": True,
             "prompt_tokens": 600, "generation_tokens": 300, "prompt_tokens_per_s": 10.0, "generation_tokens_per_s": 5.0,
             "ttft_count": 6, "ttft_p50_s": 0.25, "ttft_mean_s": 0.3}
    # a point whose numbers are not numbers (markup, a string, null): left out of the charts, never drawn as points
    bad = {**point, "t": now - 120, "requests_per_s": HOSTILE, "prompt_tokens_per_s": "1e999", "generation_tokens_per_s": HOSTILE,
           "ttft_p50_s": HOSTILE, "running": HOSTILE, "capacity": None}
    return {
        "/nodes": {"nodes": [{"node_name": HOSTILE, "cpu_count": 8, "host_used_bytes": 1, "host_total_bytes": 2,
                              "error": HOSTILE, "weights_disk": None}]},
        "/gpus": {"devices": [device]}, "/models": {"models": [model]}, "/load": {"models": {}},
        "/models/" + quote(HOSTILE, safe="()!'*"): model,  # as encodeURIComponent writes it
        "/adapters": {"adapters": [{"model_id": HOSTILE, "base": HOSTILE, "rank": 8, "loaded_on": ["r0", HOSTILE]},
                                   {"model_id": "cold", "base": HOSTILE, "rank": 16, "loaded_on": []},
                                   {"model_id": "elsewhere", "base": "other-base", "rank": 8, "loaded_on": ["r0"]}]},
        "/history": {"now": now, "since": now - 7200, "restarts": [now - 600], "minute_s": 60, "keep_s": 5400,
                     "models": {HOSTILE: [bad, point, {**point, "t": now, "generation_tokens_per_s": 7.5, "ttft_p50_s": None}]},
                     "devices": {HOSTILE: [{"t": now, "total_bytes": 2**34, "reserved_bytes": 2**30, "used_bytes": 2**30,
                                            "dormant_bytes": 0}]},
                     "wakes": {HOSTILE: [{"at": now - 890, "how": "parked", "total_s": 10.0},
                                         {"at": now - 300, "how": HOSTILE, "total_s": HOSTILE}]}},
        "/weights": {"nodes": {HOSTILE: {"disk": None, "weights": [{"key": "k", "source": HOSTILE, "revision": HOSTILE, "bytes": 2**30,
                                                                   "complete": False, "last_used": now - 60, "in_use": True}]},
                               "node-b": {"error": HOSTILE}}},
        "POST /weights": {"model": HOSTILE, "key": "k", "revision": HOSTILE, "bytes": 2**31,
                          "nodes": {HOSTILE: {"key": "k", "state": "fetching", "bytes_done": 2**30, "bytes_total": 2**31, "error": ""},
                                    "node-b": {"key": "k", "state": "failed", "error": HOSTILE}}},
    }


def run_page(script: str, after: str, now: float) -> dict:
    """The page's own script in node over the stub DOM and ``hostile_data``; ``after`` runs once it drew."""
    js = (DOM_STUB + f"const DATA = {json.dumps(hostile_data(now))};\nconst REFUSE = {{}};\n" + script +
          "\n;(async () => { await new Promise((r) => setTimeout(r, 50));" + after + "})();")
    out = subprocess.run(["node", "-e", js], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_hostile_model_id_and_message_are_drawn_as_text():
    assert shutil.which("node"), "this test runs the page's own script in node: install nodejs (.ci/run does)"
    script = status_page.PAGE.split("<script>", 1)[1].split("</script>", 1)[0]
    now = time.time()
    found = run_page(script, """
      selected = DATA["/models"].models[0].model_id;   // open its detail view too
      await refresh();
      const all = walk(document.getElementById("nodes"), []).concat(walk(document.getElementById("models-body"), []),
                                                                   walk(document.getElementById("detail"), []));
      console.log(JSON.stringify({
        sinks, tags: [...new Set(all.filter((n) => n.tag).map((n) => n.tag))],
        texts: all.filter((n) => n.text !== undefined).map((n) => n.text),
        attrs: all.flatMap((n) => Object.keys(n.attrs || {})),
        state: document.getElementById("state").textContent,
        charts: all.filter((n) => n.attrs && n.attrs["data-chart"]).length,
        rejected: all.filter((n) => n.attrs && n.attrs["data-rejected"] !== undefined).map((n) => n.textContent),
        actions: all.filter((n) => n.attrs && n.attrs["data-action"]).map((n) => n.attrs["data-action"]),
        times: all.filter((n) => n.tag === "time").map((n) => [n.textContent, n.attrs.title]),
        chartMax: Object.fromEntries(all.filter((n) => n.attrs && n.attrs["data-chart"])
                                        .map((n) => [n.attrs["data-chart"].split(" ")[0], n.attrs["data-max"]])),
        lines: Object.fromEntries(all.filter((n) => n.attrs && n.attrs["data-chart"])
                                     .map((n) => [n.attrs["data-chart"].split(" ")[0], n.kids.filter((k) => k.tag === "polyline").length])),
        points: all.filter((n) => n.tag === "polyline").map((n) => n.attrs.points),
        marks: all.filter((n) => n.attrs && n.attrs["data-mark"] !== undefined).map((n) => n.textContent),
        svgAttrs: all.filter((n) => ["svg", "polyline", "line"].includes(n.tag))  // all but the label (an attribute, never parsed)
                     .flatMap((n) => Object.entries(n.attrs).filter(([k]) => k !== "data-chart").map(([, v]) => v)),
        labels: Object.fromEntries(["data-tokens", "data-ttft", "data-wakes"].map((k) => [k, all.filter((n) => n.attrs && n.attrs[k] !== undefined).map((n) => n.textContent)])),
        cache: walk(document.getElementById("w-cache"), []).filter((n) => n.text !== undefined).map((n) => n.text),
        adapters: all.filter((n) => n.attrs && n.attrs["data-adapter"] !== undefined).map((n) => n.textContent),
      }));""", now)
    assert found["sinks"] == [], "nothing is ever handed to an HTML parser"
    assert not {"img", "script"} & set(found["tags"]), found["tags"]
    assert not [a for a in found["attrs"] if a.lower().startswith("on")], "no event handler attribute is ever set"
    assert any(HOSTILE in t for t in found["texts"]), "the markup is shown, as text"
    assert found["state"].startswith("updated"), found["state"]
    assert found["charts"] == 5, "a device's chart and a model's four: requests/s, tokens/s, load, p50 TTFT"
    assert found["rejected"] == [f"{HOSTILE}: {HOSTILE}"], "the detail view lists the rejected devices"
    assert found["actions"] == ["detail", "wake", "delete"], "a sleeping model offers wake, not sleep"
    texts = " ".join(found["texts"])
    assert str(int(now - 180)) not in texts and str(int(now))[:6] not in texts, "no raw epoch is drawn"
    assert any(text == "for 3 min" and title for text, title in found["times"]), found["times"]
    # the new charts: tokens/s (out and in) and p50 TTFT drawn from the numbers only, the bad point left out
    assert found["chartMax"]["tokens/s"] == "10" and found["lines"]["tokens/s"] == 2, found["chartMax"]
    assert found["chartMax"]["p50"] == "0.25" and found["lines"]["p50"] == 1, "only the minute that had a first token"
    assert found["chartMax"]["requests/s"] == "0.1" and found["chartMax"]["load"] == "8"
    assert all(re.fullmatch(r"[0-9.\- ,]+", p) for p in found["points"]), found["points"]
    assert found["svgAttrs"] and not [v for v in found["svgAttrs"] if "<" in v or "alert" in v], "no hive string in a chart's geometry"
    assert found["labels"]["data-tokens"] == ["7.5 tok/s out, 10.0 in · peak out 7.5"], found["labels"]
    assert found["labels"]["data-ttft"] == ["p50 TTFT 250 ms · worst minute 250 ms"], found["labels"]
    assert found["labels"]["data-wakes"] == ["2 wake(s): 10.0 s, – s"], "wakes with their durations; a bad one as a dash"
    assert sorted(found["marks"]) == sorted(["woke in 10.0 s (parked)", f"woke in – s ({HOSTILE})"]), found["marks"]
    # the weight caches: each node's entries, a node's error, all as text
    assert HOSTILE in found["cache"] and any("(partial) · in use" in t for t in found["cache"])
    # its LoRA adapters (only its own), with where each is loaded now, as text
    assert found["adapters"] == [f"{HOSTILE} · rank 8 · loaded on r0, {HOSTILE}", "cold · rank 16 · not loaded now"]


def test_prefetch_from_the_page_sends_the_form_and_shows_the_apis_answer_or_refusal():
    script = status_page.PAGE.split("<script>", 1)[1].split("</script>", 1)[0]
    found = run_page(script, """
      const submit = async () => { await document.getElementById("weights").listeners.submit({ preventDefault() {} });
                                   await new Promise((r) => setTimeout(r, 20)); };
      document.getElementById("w-model").value = "  org/name@main ";
      document.getElementById("w-nodes").value = "node-a, , node-b";
      await submit();
      const ok = { notice: document.getElementById("notice").textContent, cls: document.getElementById("notice").className,
                   result: walk(document.getElementById("w-result"), []).filter((n) => n.text !== undefined).map((n) => n.text),
                   tags: walk(document.getElementById("w-result"), []).map((n) => n.tag).filter(Boolean) };
      REFUSE["POST /weights"] = [404, "no live node ['" + DATA["/nodes"].nodes[0].node_name + "']; GET /admin/nodes lists them"];
      await submit();
      console.log(JSON.stringify({ ok, posts: calls.filter((c) => c[0] === "POST"),
        refused: { notice: document.getElementById("notice").textContent, cls: document.getElementById("notice").className,
                   result: document.getElementById("w-result").textContent },
        disabled: document.getElementById("w-submit").disabled }));""", time.time())
    assert [p[:2] for p in found["posts"]] == [["POST", "/weights"]] * 2
    assert json.loads(found["posts"][0][2]) == {"model": "org/name@main", "nodes": ["node-a", "node-b"]}
    assert {p[3] for p in found["posts"]} == {"Bearer tok"}, "with the tab's admin token, in the header"
    assert found["ok"]["cls"] == "ok" and found["ok"]["notice"] == "pre-fetch org/name@main: asked on 2 node(s)"
    assert any(HOSTILE in t and "fetching" in t for t in found["ok"]["result"]), found["ok"]["result"]
    assert any(t.startswith("node-b: failed · " + HOSTILE) for t in found["ok"]["result"])
    assert not {"img", "script"} & set(found["ok"]["tags"])
    assert found["refused"]["cls"] == "err", "a refusal is shown as one, with the API's own message"
    assert found["refused"]["notice"] == f"pre-fetch refused: 404: no live node ['{HOSTILE}']; GET /admin/nodes lists them"
    assert found["refused"]["result"].startswith("refused: 404: no live node") and found["disabled"] is False


def test_the_script_has_no_html_sink_and_every_action_goes_through_the_api():
    script = status_page.PAGE.split("<script>", 1)[1].split("</script>", 1)[0]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink
    assert "/models/${encodeURIComponent(id)}/${what}" in script and '"DELETE", "/models/" + encodeURIComponent(id)' in script
    assert 'call("POST", "/plan", body)' in script and 'call("POST", "/models", body)' in script
    assert 'call("POST", "/weights", body)' in script, "pre-fetch goes through the admin API with the token"
    assert "confirm(`Delete" in script, "deleting (it drops traffic) asks first"
