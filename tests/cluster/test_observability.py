"""Observability on the simulated cluster: request ids through the logs, no secrets in them,
Prometheus metrics exported, and the status page."""

import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import SIM_MODEL
from tests.harness import ADMIN_TOKEN, API_KEY, scrape_metrics

pytestmark = pytest.mark.cluster


def serve_logs(hive) -> str:
    """Every Serve log line of the cluster (proxy, controller, every replica), as one text."""
    logs = Path(hive.cluster.head_node.get_logs_dir_path())
    files = [*logs.glob("serve/*.log"), *logs.glob("worker-*.out"), *logs.glob("worker-*.err")]
    return "\n".join(f.read_text(errors="replace") for f in files)


def engine_line(text: str, request_id: str) -> bool:
    """The engine's line for `request_id` (the proxy's and router's lines carry the id too): its own
    port's access line, or Serve's line for the call when the request went over a Serve handle (a
    gateway replica's first request to a replica whose port it has not learnt yet)."""
    return any(("request_id=" + request_id in ln and "/v1/chat/completions 200" in ln)
               or ("_engine-r" in ln and request_id in ln and "CALL forward_" in ln and " OK " in ln)
               for ln in text.splitlines())


def wait_for_logs(hive, *needles: str, engine_id: str, timeout_s: float = 30) -> str:
    """Waits for every needle and for the engine's own line: each process's log file is written on
    its own schedule, so the proxy's line for an id can land seconds before the engine's."""
    deadline = time.time() + timeout_s
    while True:
        text = serve_logs(hive)
        if (all(n in text for n in needles) and engine_line(text, engine_id)) or time.time() > deadline:
            return text
        time.sleep(0.5)


def test_one_request_id_through_proxy_router_and_engine_and_no_secrets_in_the_logs(clean):
    hive = clean
    r = hive.deploy(model_id="traced", model=SIM_MODEL, engine="sim", gpu="node-a:gpu0",
                    vllm_kwargs={"sim_tokens_per_s": 2000})
    assert r.status_code == 200, r.text
    prompt = f"PROMPT-{uuid.uuid4().hex}"
    body = {"model": "traced", "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]}

    mine = f"client:{uuid.uuid4().hex}"
    for path in ("/v1/chat/completions", "/traced/v1/chat/completions"):
        out = hive.api.post(path, json=body, headers={"x-request-id": mine})
        assert out.status_code == 200, out.text
        assert out.headers.get_list("x-request-id") == [mine], "a well-formed client id comes back as sent, once"
    bad = "not well formed " + uuid.uuid4().hex
    out = hive.api.post("/v1/chat/completions", json=body, headers={"x-request-id": bad})
    assert out.status_code == 200, out.text
    (replaced,) = out.headers.get_list("x-request-id")
    assert replaced != bad and len(replaced) <= 128 and " " not in replaced
    made = hive.api.post("/v1/chat/completions", json=body).headers["x-request-id"]

    text = wait_for_logs(hive, f"request_id={mine}", replaced, made, engine_id=mine)
    lines = [ln for ln in text.splitlines() if mine in ln]
    assert engine_line(text, mine), "the engine logs the request with the client's id"
    assert any("proxy" in ln.lower() or "Gateway" in ln for ln in lines), "the gateway/proxy lines carry the same id"
    assert replaced in text and made in text  # the proxy and the gateway log the ids they made
    assert bad.split()[-1] not in text, "a malformed id is never logged"
    for secret in (API_KEY, ADMIN_TOKEN, prompt):
        assert secret not in text, f"{secret!r} leaked into the Serve logs"


def test_metrics_reach_prometheus_with_the_dashboards_names(clean):
    from hive_apps.ops import metrics

    hive = clean
    r = hive.deploy(model_id="measured", model=SIM_MODEL, engine="sim", gpu="node-b:gpu0",
                    vllm_kwargs={"sim_tokens_per_s": 2000})
    assert r.status_code == 200, r.text
    body = {"model": "measured", "max_tokens": 2, "messages": [{"role": "user", "content": "count me"}]}
    assert hive.api.post("/v1/chat/completions", json=body).status_code == 200
    assert hive.api.post("/measured/v1/chat/completions", json=body).status_code == 200
    def request_lines(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.startswith("ray_hive_requests_total{") and 'model="measured"' in ln
                and 'code="200"' in ln]

    wanted = ['ray_hive_gpu_memory_bytes{', 'device="node-b:gpu0"', 'ray_hive_model_status{',
              'ray_hive_replica_planned_seqs{', 'ray_hive_deploy_seconds_bucket{', 'ray_hive_tokens_total{']
    deadline = time.time() + 45  # Ray's agents export what processes reported every few seconds
    while True:
        text = scrape_metrics(hive)
        entries = {'entry="gateway"' in ln for ln in request_lines(text)}
        if (all(w in text for w in wanted) and entries == {True, False}) or time.time() > deadline:
            break
        time.sleep(2)
    missing = [w for w in wanted if w not in text]
    assert not missing, f"not exported yet: {missing}"
    assert entries == {True, False}, ("a request through /v1 and one through /measured/v1 are counted",
                                      [ln for ln in text.splitlines() if ln.startswith("ray_hive_requests")])
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("ray_hive_")}
    assert exported <= metrics.exported_names(), exported - metrics.exported_names()
    reserved = [ln for ln in text.splitlines() if ln.startswith("ray_hive_gpu_memory_bytes{")
                and 'device="node-b:gpu0"' in ln and 'kind="reserved"' in ln]
    assert reserved and float(reserved[0].rsplit(" ", 1)[1]) > 0


def chromium():
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver, "the status page test needs Debian's chromium and chromium-driver (.ci/run installs them)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "status-page.png"  # README shows it


def screenshot_path() -> Path | None:
    """Where the README's screenshot goes: HIVE_STATUS_SCREENSHOT=1 writes docs/status-page.png (the
    file README shows); any other value names the file. Unset: no screenshot."""
    import os

    value = os.environ.get("HIVE_STATUS_SCREENSHOT", "")
    if not value or value.lower() in ("0", "false", "no"):
        return None
    return SCREENSHOT if value.lower() in ("1", "true", "yes") else Path(value)


def save_screenshot(browser) -> None:
    """The whole page, not only the window: the window is made as tall as the page first."""
    path = screenshot_path()
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, max(1000, min(int(height) + 40, 4000)))
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(path))


def test_status_page_in_headless_chromium_shows_models_on_their_gpus(clean):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    hive = clean
    for model_id, gpu in (("alpha", "node-a:gpu0"), ("beta", "node-b:gpu1")):
        r = hive.deploy(model_id=model_id, model=SIM_MODEL, engine="sim", gpu=gpu, vllm_kwargs={"sim_tokens_per_s": 500})
        assert r.status_code == 200, r.text

    browser = chromium()
    try:
        browser.get(hive.url + "/admin/")
        assert browser.find_elements(By.CSS_SELECTOR, "[data-device]") == [], "no data before the token"
        browser.find_element(By.ID, "token").send_keys(ADMIN_TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#auth button").click()
        wait = WebDriverWait(browser, 20, poll_frequency=0.2)
        on = lambda dev, rep: browser.find_elements(By.CSS_SELECTOR, f'[data-device="{dev}"] [data-replica="{rep}"]')  # noqa: E731
        wait.until(lambda _: on("node-a:gpu0", "alpha/r0") and on("node-b:gpu1", "beta/r0"))
        assert ADMIN_TOKEN not in browser.current_url
        shown = {e.get_attribute("data-device") for e in browser.find_elements(By.CSS_SELECTOR, "[data-device]")}
        assert shown == set(hive.gpus()), "every device of the simulated cluster is drawn"
        nodes = {e.get_attribute("data-node") for e in browser.find_elements(By.CSS_SELECTOR, "[data-node]")}
        assert {"head", "node-a", "node-b"} <= nodes
        chips = {(e.find_element(By.XPATH, "ancestor::*[@data-device]").get_attribute("data-device"), e.text)
                 for e in browser.find_elements(By.CSS_SELECTOR, "[data-replica]")}
        assert chips == {("node-a:gpu0", "alpha/r0"), ("node-b:gpu1", "beta/r0")}, "each replica on its own GPU only"
        reserved = browser.find_element(By.CSS_SELECTOR, '[data-device="node-a:gpu0"] .bar .res')
        assert float(reserved.value_of_css_property("width").rstrip("px")) > 0
        status = {e.get_attribute("data-model"): e.find_element(By.CSS_SELECTOR, "[data-status]").text
                  for e in browser.find_elements(By.CSS_SELECTOR, "tr[data-model]")}
        assert status == {"alpha": "ready", "beta": "ready"}
        load = browser.find_element(By.CSS_SELECTOR, 'tr[data-model="alpha"] [data-load]')
        planned = hive.admin.get("/models/alpha").json()["replicas"]["r0"]["settings"]["max_num_seqs"]
        assert load.get_attribute("data-load") == "0" and f"0 / {planned} sequences" in load.text  # idle, of its plan

        assert hive.admin.delete("/models/beta").status_code in (200, 202)
        wait.until(lambda _: not browser.find_elements(By.CSS_SELECTOR, 'tr[data-model="beta"]')
                   and not on("node-b:gpu1", "beta/r0"))
        assert on("node-a:gpu0", "alpha/r0") and browser.find_elements(By.CSS_SELECTOR, 'tr[data-model="alpha"]')
        assert "refresh failed" not in browser.find_element(By.ID, "state").text
    finally:
        browser.quit()


def test_ray_dashboard_shows_each_engine_deployments_plan(clean):
    hive = clean
    assert hive.deploy(model_id="shown", model=SIM_MODEL, engine="sim", gpu="node-b:gpu1").status_code == 200
    apps = httpx.get(f"{hive.dashboard_url}/api/serve/applications/", timeout=30).json()["applications"]
    engine = apps["shown"]["deployments"]["engine-r0"]
    plan = engine["deployment_config"]["user_config"]["plan"]
    assert plan["devices"] == ["node-b:gpu1"] and plan["node"] == "node-b" and plan["max_num_seqs"] >= 1


def test_status_page_history_plan_actions_and_hostile_text_in_headless_chromium(clean, tmp_path):
    """Issue 31: charts of the hive's own history (requests/s, tokens/s, p50 TTFT) that change after
    traffic, the why of a placement (rejected devices), sleep and wake from the page, a deploy from the
    form that ends in a ready model, a pre-fetch and a refused one, a value with markup drawn as text;
    saves the README's screenshot (docs/status-page.png) when HIVE_STATUS_SCREENSHOT=1."""
    import json
    import shutil

    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    hive = clean
    hostile = '<img src=x onerror="document.title=1">'
    folder = tmp_path / hostile  # a model folder whose name is markup: the page shows it as the model's source
    shutil.copytree(SIM_MODEL, folder)
    r = hive.deploy(model_id="busy", model=SIM_MODEL, engine="sim", vllm_kwargs={"sim_tokens_per_s": 2000},
                    gpu="node-b:gpu1")
    assert r.status_code == 200, r.text
    r = hive.deploy(model_id="napper", model=str(folder), engine="sim", sleep_timeout=3600,
                    vllm_kwargs={"sim_tokens_per_s": 2000, "sim_sleep_mode": False})  # placed by the planner: some devices rejected
    assert r.status_code == 200, r.text
    body = {"model": "busy", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(20):
        assert hive.api.post("/v1/chat/completions", json=body).status_code == 200

    browser = chromium()
    try:
        browser.get(hive.url + "/admin/")
        browser.find_element(By.ID, "token").send_keys(ADMIN_TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#auth button").click()
        # the page redraws its rows every refresh: an element found a moment ago can be gone, so every
        # lookup and click is retried until it holds (a stale element is ignored and looked up again)
        wait = WebDriverWait(browser, 60, poll_frequency=0.5,
                             ignored_exceptions=[StaleElementReferenceException, IndexError])
        row = lambda m: browser.find_elements(By.CSS_SELECTOR, f'tr[data-model="{m}"]')  # noqa: E731

        def click(model: str, action: str) -> None:
            def once(_) -> bool:
                row(model)[0].find_element(By.CSS_SELECTOR, f'[data-action="{action}"]').click()
                return True
            wait.until(once)

        status = lambda m: row(m)[0].find_element(By.CSS_SELECTOR, "[data-status]").get_attribute("data-status")  # noqa: E731
        wait.until(lambda _: row("busy") and row("napper"))

        # history: the admin samples every 10 s; charts appear for the model and the devices, and show the traffic
        wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, 'tr[data-model="busy"] [data-chart^="requests/s"] polyline'))
        assert browser.find_elements(By.CSS_SELECTOR, '[data-device="node-b:gpu1"] [data-chart] polyline')
        hist = hive.admin.get("/history").json()
        assert hist["models"]["busy"] and "node-b:gpu1" in hist["devices"], hist
        assert "kept by the hive since" in browser.find_element(By.ID, "since").text

        # tokens/s and p50 TTFT come from the counters' change between two samples: traffic goes on
        # (a request each poll) until the page's tokens/s chart draws a point above zero
        def chart_max(label: str) -> float:
            charts = browser.find_elements(By.CSS_SELECTOR, f'tr[data-model="busy"] [data-chart^="{label}"]')
            return float(charts[0].get_attribute("data-max") or 0) if charts else 0.0

        def traffic_shows(_) -> bool:
            assert hive.api.post("/v1/chat/completions", json=body).status_code == 200
            return chart_max("tokens/s") > 0 and chart_max("p50 TTFT") > 0

        WebDriverWait(browser, 120, poll_frequency=0.5, ignored_exceptions=[StaleElementReferenceException]).until(traffic_shows)
        assert browser.find_elements(By.CSS_SELECTOR, 'tr[data-model="busy"] [data-chart^="tokens/s"] polyline')
        assert browser.find_elements(By.CSS_SELECTOR, 'tr[data-model="busy"] [data-chart^="p50 TTFT"] polyline')
        pts = hive.admin.get("/history").json()["models"]["busy"]
        assert any(p["generation_tokens_per_s"] > 0 and p["prompt_tokens_per_s"] > 0 for p in pts), pts
        assert any(p["ttft_p50_s"] is not None and 0 < p["ttft_p50_s"] < 5 for p in pts), pts
        assert "tok/s out" in row("busy")[0].find_element(By.CSS_SELECTOR, "[data-tokens]").text

        # a value with markup is text: no element came of it, and the tab's title is untouched
        wait.until(lambda _: hostile in row("napper")[0].text)
        assert not browser.find_elements(By.CSS_SELECTOR, "#models img, #nodes img") and browser.title == "Ray Hive status"

        # the why of a placement: the detail view lists the devices the planner did not choose
        click("napper", "detail")
        wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, '[data-detail="napper"] [data-plan-replica="r0"]'))
        rejected = wait.until(lambda _: ({e.get_attribute("data-rejected")  # a 1-tuple: an empty set is an answer
                                          for e in browser.find_elements(By.CSS_SELECTOR, "[data-rejected]")},))[0]
        api_rejected = {x["device"] for x in hive.admin.get("/models/napper").json()["rejected"]}
        assert rejected == api_rejected, (rejected, api_rejected)

        # sleep now, then wake now, from the page (sleeping drops no traffic: no confirmation asked)
        click("napper", "sleep")
        wait.until(lambda _: status("napper") == "sleeping" and row("napper")[0].find_elements(By.CSS_SELECTOR, "[data-action=wake]"))
        assert wait.until(lambda _: row("napper")[0].find_element(By.CSS_SELECTOR, "[data-status] time")
                          .get_attribute("title"))  # "for 3 s", hover: when
        click("napper", "wake")
        wait.until(lambda _: status("napper") == "ready")
        assert hive.admin.get("/models/napper").json()["last_wake"] is not None
        # the wake shows in the history with its duration (the page reads the history every fifth refresh)
        wait.until(lambda _: int(row("napper")[0].find_element(By.CSS_SELECTOR, "[data-wakes]").get_attribute("data-wakes")) >= 1)
        assert " s" in row("napper")[0].find_element(By.CSS_SELECTOR, "[data-wakes]").text

        # deploy from the form: the dry run shows the plan (the same /admin/plan answer), the JSON body
        # is shown for a script, and the deploy ends in a ready model
        form = {"d-model_id": "formed", "d-model": SIM_MODEL}
        for field_id, value in form.items():
            browser.find_element(By.ID, field_id).clear()
            browser.find_element(By.ID, field_id).send_keys(value)
        Select(browser.find_element(By.ID, "d-engine")).select_by_visible_text("sim")
        browser.find_element(By.ID, "d-extra").clear()
        browser.find_element(By.ID, "d-extra").send_keys('{"vllm_kwargs": {"sim_tokens_per_s": 2000}}')
        shown = json.loads(wait.until(lambda _: browser.find_element(By.ID, "d-body").text))
        assert shown["model_id"] == "formed" and shown["engine"] == "sim" and shown["vllm_kwargs"] == {"sim_tokens_per_s": 2000}
        browser.find_element(By.ID, "d-preview").click()
        wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, '#d-plan [data-plan-replica="r0"]'))
        assert "nothing was reserved" in browser.find_element(By.ID, "notice").text
        assert "formed" not in {m["model_id"] for m in hive.admin.get("/models").json()["models"]}, "a dry run deploys nothing"
        browser.find_element(By.ID, "d-submit").click()
        wait.until(lambda _: "deploy formed" in browser.find_element(By.ID, "notice").text)
        WebDriverWait(browser, 120, poll_frequency=0.5, ignored_exceptions=[StaleElementReferenceException, IndexError]) \
            .until(lambda _: status("formed") == "ready")
        assert hive.admin.get("/models/formed").json()["status"] == "ready"
        assert hive.api.post("/v1/chat/completions", json={**body, "model": "formed"}).status_code == 200

        # pre-fetch: a local folder is a stat on each node (no download), then a source the hub does not
        # have is refused with the API's own message
        browser.find_element(By.ID, "w-model").send_keys(SIM_MODEL)
        browser.find_element(By.ID, "w-nodes").send_keys("node-a")
        browser.find_element(By.ID, "w-submit").click()
        wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, '#w-result [data-prefetch="node-a"]'))
        assert "node-a: ready" in browser.find_element(By.ID, "w-result").text
        assert "pre-fetch" in browser.find_element(By.ID, "notice").text
        browser.find_element(By.ID, "w-model").clear()
        browser.find_element(By.ID, "w-model").send_keys("hive-test/no-such-repo")
        browser.find_element(By.ID, "w-nodes").clear()
        browser.find_element(By.ID, "w-submit").click()
        wait.until(lambda _: "pre-fetch refused: 404" in browser.find_element(By.ID, "notice").text)
        assert browser.find_element(By.ID, "notice").get_attribute("class") == "err"

        save_screenshot(browser)  # after traffic, a wake and a deploy: charts, plan and actions all drawn

        # a refused action shows the API's message: delete asks first (it drops traffic), then goes
        click("busy", "delete")
        browser.switch_to.alert.accept()
        wait.until(lambda _: not row("busy"))
        assert "delete busy" in browser.find_element(By.ID, "notice").text
        assert "refresh failed" not in browser.find_element(By.ID, "state").text
    finally:
        browser.quit()
