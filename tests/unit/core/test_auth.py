from hive_apps.core.auth import bearer_token, check_admin_token, check_api_key
from hive_apps.core.settings import HiveSettings


def test_bearer_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token(None) is None


def test_fails_closed_when_nothing_configured():
    s = HiveSettings()
    assert "HIVE_API_KEYS" in check_api_key(s, "Bearer x")
    assert "HIVE_ADMIN_TOKEN" in check_admin_token(s, None)
    open_ = HiveSettings(auth_disabled=True)
    assert check_api_key(open_, None) is None and check_admin_token(open_, None) is None


def test_keys_and_token_checked():
    s = HiveSettings(admin_token="adm", api_keys=["k1", "k2"])
    assert check_api_key(s, "Bearer k2") is None
    assert "invalid" in check_api_key(s, "Bearer nope")
    assert check_admin_token(s, "Bearer adm") is None
    assert "invalid" in check_admin_token(s, "Bearer k1")


def test_key_file_is_reread(tmp_path):
    f = tmp_path / "keys"
    f.write_text("a\n")
    s = HiveSettings(api_keys_file=f)
    assert check_api_key(s, "Bearer a") is None
    f.write_text("b\n")
    assert check_api_key(s, "Bearer a") is not None
    assert check_api_key(s, "Bearer b") is None


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("HIVE_API_KEYS", "x, y,")
    monkeypatch.setenv("HIVE_MEMORY_BUDGET_FRACTION", "0.8")
    s = HiveSettings.from_env()
    assert s.api_keys == ["x", "y"] and s.memory_budget_fraction == 0.8


def test_booleans_mean_the_same_everywhere(monkeypatch):
    for raw, value in [("0", False), ("off", False), ("no", False), ("false", False),
                       ("1", True), ("on", True), ("yes", True), ("TRUE", True)]:
        monkeypatch.setenv("HIVE_SELF_HEAL", raw)
        monkeypatch.setenv("HIVE_AUTH_DISABLED", raw)
        s = HiveSettings.from_env()
        assert s.self_heal is value and s.auth_disabled is value, raw


def test_a_bad_value_names_the_variable_and_what_it_accepts(monkeypatch):
    import pytest

    from hive_apps.core.settings import SettingsError

    monkeypatch.setenv("HIVE_SELF_HEAL", "maybe")
    monkeypatch.setenv("HIVE_MONITOR_INTERVAL_S", "-1")
    with pytest.raises(SettingsError) as e:
        HiveSettings.from_env()
    assert "HIVE_SELF_HEAL='maybe'" in str(e.value) and "on/off" in str(e.value)
    assert "HIVE_MONITOR_INTERVAL_S='-1'" in str(e.value)


def test_comment_lines_in_the_key_file_are_not_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# rotated 2026-12-01\nreal-key\n\n")
    s = HiveSettings(api_keys_file=f)
    assert s.current_api_keys() == {"real-key"}
    assert check_api_key(s, "Bearer # rotated 2026-12-01") is not None
