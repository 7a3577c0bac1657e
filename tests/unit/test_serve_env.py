"""The Serve settings every hive runs with (hive_apps/serve_env.py)."""

import inspect

from hive_apps import serve_env
from hive_apps.serve_env import HA_PROXY, SERVE_ENV, ray_head_env


def test_each_setting_is_one_that_this_rays_serve_reads():
    """A renamed or dropped variable would silently do nothing."""
    import ray.serve._private.constants as constants

    source = inspect.getsource(constants)
    for name in [*SERVE_ENV, HA_PROXY]:
        assert f'"{name}"' in source, name


def test_the_head_gets_the_settings_and_haproxy_but_what_the_user_set_wins(monkeypatch):
    monkeypatch.setattr(serve_env, "haproxy_available", lambda: True)
    env = ray_head_env({"PATH": "/bin", "RAY_SERVE_LOG_TO_STDERR": "1"})
    assert env["PATH"] == "/bin" and env["RAY_SERVE_LOG_TO_STDERR"] == "1"
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert env[HA_PROXY] == "1"
    assert ray_head_env({HA_PROXY: "0"})[HA_PROXY] == "0"
    monkeypatch.setattr(serve_env, "haproxy_available", lambda: False)
    assert HA_PROXY not in ray_head_env({})
