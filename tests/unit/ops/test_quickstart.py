"""The quickstart's guard before `serve deploy` (``hive_apps/ops/quickstart.py``): a declarative deploy
replaces the cluster's whole Serve config, so on a cluster that runs declarative apps the hive's
config does not list it stops, unless told ``--force``. The Serve status lookup is mocked at its seam
(``serve_applications``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import httpx
import pytest

from hive_apps.ops import quickstart

HIVE_APPS = {"hive-registry", "hive-planner", "hive-admin", "hive-gateway"}


def test_the_config_it_deploys_is_the_hives():
    assert quickstart.CONFIG.is_file()
    assert quickstart.config_app_names() == HIVE_APPS


@pytest.mark.parametrize("apps, refused", [
    ({}, None),  # Serve not running yet
    ({name: "declarative" for name in HIVE_APPS}, None),  # the hive itself, deployed before
    ({"hive-admin": "declarative", "qwen3": "imperative"}, None),  # model apps (serve.run) survive a deploy
    ({"hive-admin": "declarative", "shop": "declarative", "blog": "declarative"}, ["blog", "shop"]),
])
def test_declarative_apps_the_config_does_not_list_refuse_the_deploy(monkeypatch, apps, refused):
    monkeypatch.setattr(quickstart, "serve_applications", lambda dashboard: apps)
    reason = quickstart.deploy_refusal("http://dash:8265")
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and "blog, shop" in reason and "--force" in reason and "delete" in reason


def test_a_cluster_whose_apps_cannot_be_listed_refuses_too(monkeypatch):
    def unreachable(dashboard):
        raise httpx.ConnectError("connection refused")

    monkeypatch.setattr(quickstart, "serve_applications", unreachable)
    reason = quickstart.deploy_refusal("http://dash:8265")
    assert reason is not None and "http://dash:8265" in reason and "--force" in reason


def test_serve_applications_reads_each_apps_source(monkeypatch):
    body = {"applications": {"hive-admin": {"source": "declarative"}, "m": {"source": "imperative"}, "x": {}}}

    def get(url, timeout):
        assert url == "http://dash:8265/api/serve/applications/"
        return httpx.Response(200, json=body, request=httpx.Request("GET", url))

    monkeypatch.setattr(quickstart.httpx, "get", get)
    assert quickstart.serve_applications("http://dash:8265/") == {"hive-admin": "declarative", "m": "imperative",
                                                                  "x": "unknown"}


class Deployed(Exception):
    """Raised by the fake `serve deploy`: the test ends there."""


@pytest.fixture
def main_until_deploy(monkeypatch, tmp_path):
    """``quickstart.main`` on a cluster that already runs (the head is not started), stopped at `serve deploy`."""
    calls: list[list[str]] = []

    def run(cmd, **kw):
        calls.append(list(cmd))
        if cmd[:2] == ["serve", "deploy"]:
            raise Deployed
        raise AssertionError(f"unexpected command {cmd}")

    monkeypatch.setattr(quickstart, "get_settings", lambda: SimpleNamespace(model_cache_dir=tmp_path))
    monkeypatch.setattr(quickstart, "ensure_ray_head", lambda env: False)
    monkeypatch.setattr(quickstart.subprocess, "run", run)
    monkeypatch.setattr(quickstart, "serve_applications", lambda dashboard: {"shop": "declarative"})
    monkeypatch.delenv("RAY_DASHBOARD_ADDRESS", raising=False)

    def main(*argv: str) -> int:
        monkeypatch.setattr(sys, "argv", ["quickstart", "--model", str(tmp_path), *argv])
        return quickstart.main()

    return main, calls


def test_main_stops_before_serve_deploy_without_force(main_until_deploy, capsys):
    main, calls = main_until_deploy
    assert main() == 2
    assert calls == []
    assert "shop" in capsys.readouterr().err


def test_main_deploys_with_force(main_until_deploy):
    main, calls = main_until_deploy
    with pytest.raises(Deployed):
        main("--force")
    assert calls == [["serve", "deploy", str(quickstart.CONFIG)]]
