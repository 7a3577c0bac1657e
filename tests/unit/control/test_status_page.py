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
        "/gpus", "/nodes", "/models", "/models/x", "/load", "/history", "/models/x/sleep", "/models/x/wake")]
    guarded = AdminGuard(Starlette(routes=routes), settings=lambda: SETTINGS)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded, root_path="/admin"), base_url="http://h")


async def test_the_shell_loads_without_a_token_and_the_data_does_not():
    async with client() as c:
        for path in ("/admin/",):
            r = await c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
            assert "Ray Hive" in r.text and "s3cret-admin-tok" not in r.text
        for path in ("/admin/gpus", "/admin/nodes", "/admin/models", "/admin/models/x", "/admin/load", "/admin/history"):
            r = await c.get(path)
            assert r.status_code == 401, path
            assert (await c.get(path, headers={"authorization": "Bearer s3cret-admin-tok"})).status_code == 200
        for method, path in (("POST", "/admin/models/x/sleep"), ("POST", "/admin/models/x/wake"),
                             ("DELETE", "/admin/models/x"), ("POST", "/admin/models")):  # the page's actions
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
globalThis.fetch = async (url) => ({ ok: true, json: async () => DATA[url.replace("/admin", "").split("?")[0]] || {} });
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
    point = {"t": now - 60, "requests": 6, "requests_per_s": 0.1, "running": 1, "waiting": 0, "capacity": 8, "resident": True}
    return {
        "/nodes": {"nodes": [{"node_name": HOSTILE, "cpu_count": 8, "host_used_bytes": 1, "host_total_bytes": 2,
                              "error": HOSTILE, "weights_disk": None}]},
        "/gpus": {"devices": [device]}, "/models": {"models": [model]}, "/load": {"models": {}},
        "/models/" + quote(HOSTILE, safe="()!'*"): model,  # as encodeURIComponent writes it
        "/history": {"now": now, "since": now - 7200, "restarts": [now - 600], "minute_s": 60, "keep_s": 5400,
                     "models": {HOSTILE: [point, {**point, "t": now}]},
                     "devices": {HOSTILE: [{"t": now, "total_bytes": 2**34, "reserved_bytes": 2**30, "used_bytes": 2**30,
                                            "dormant_bytes": 0}]},
                     "wakes": {HOSTILE: [{"at": now - 890, "how": "parked", "total_s": 10.0}]}},
    }


def run_page(script: str, after: str, now: float) -> dict:
    """The page's own script in node over the stub DOM and ``hostile_data``; ``after`` runs once it drew."""
    js = (DOM_STUB + f"const DATA = {json.dumps(hostile_data(now))};\n" + script +
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
      }));""", now)
    assert found["sinks"] == [], "nothing is ever handed to an HTML parser"
    assert not {"img", "script"} & set(found["tags"]), found["tags"]
    assert not [a for a in found["attrs"] if a.lower().startswith("on")], "no event handler attribute is ever set"
    assert any(HOSTILE in t for t in found["texts"]), "the markup is shown, as text"
    assert found["state"].startswith("updated"), found["state"]
    assert found["charts"] >= 3, "a device chart and a model's two charts"
    assert found["rejected"] == [f"{HOSTILE}: {HOSTILE}"], "the detail view lists the rejected devices"
    assert found["actions"] == ["detail", "wake", "delete"], "a sleeping model offers wake, not sleep"
    texts = " ".join(found["texts"])
    assert str(int(now - 180)) not in texts and str(int(now))[:6] not in texts, "no raw epoch is drawn"
    assert any(text == "for 3 min" and title for text, title in found["times"]), found["times"]


def test_the_script_has_no_html_sink_and_every_action_goes_through_the_api():
    script = status_page.PAGE.split("<script>", 1)[1].split("</script>", 1)[0]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink
    assert "/models/${encodeURIComponent(id)}/${what}" in script and '"DELETE", "/models/" + encodeURIComponent(id)' in script
    assert 'call("POST", "/plan", body)' in script and 'call("POST", "/models", body)' in script
    assert "confirm(`Delete" in script, "deleting (it drops traffic) asks first"
