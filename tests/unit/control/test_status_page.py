"""GET /admin/: the shell loads without a token, every JSON endpoint still needs one, and the
page is self-contained (its own script only, no other origin)."""

from __future__ import annotations

import base64
import hashlib
import re

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

    routes = [Route("/", page, methods=["GET"])] + [Route(p, data) for p in ("/gpus", "/nodes", "/models", "/models/x", "/load")]
    guarded = AdminGuard(Starlette(routes=routes), settings=lambda: SETTINGS)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded, root_path="/admin"), base_url="http://h")


async def test_the_shell_loads_without_a_token_and_the_data_does_not():
    async with client() as c:
        for path in ("/admin/",):
            r = await c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
            assert "Ray Hive" in r.text and "s3cret-admin-tok" not in r.text
        for path in ("/admin/gpus", "/admin/nodes", "/admin/models", "/admin/models/x", "/admin/load"):
            r = await c.get(path)
            assert r.status_code == 401, path
            assert (await c.get(path, headers={"authorization": "Bearer s3cret-admin-tok"})).status_code == 200
        assert (await c.post("/admin/", content=b"{}")).status_code == 405, "the shell is GET only"


async def test_the_page_is_self_contained_and_keeps_the_token_out_of_urls():
    async with client() as c:
        r = await c.get("/admin/")
    html, csp = r.text, r.headers["content-security-policy"]
    assert not re.search(r"(src|href)\s*=\s*[\"'](https?:)?//", html), "nothing loads from another origin"
    assert "http://" not in html and "https://" not in html
    script = html.split("<script>", 1)[1].split("</script>", 1)[0]
    digest = "sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src '{digest}'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    # the token travels in a header set by the script; the form never submits it anywhere
    assert 'Authorization: "Bearer " + token' in script and "ev.preventDefault()" in script
    assert "location.search" not in script and "?token" not in script
    assert r.headers["cache-control"] == "no-store"
    assert status_page.REFRESH_MS <= 5000
