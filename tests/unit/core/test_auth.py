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


def test_admin_token_file_is_reread_and_holds_old_and_new_while_rotating(tmp_path):
    f = tmp_path / "admin"
    f.write_text("old\n")
    s = HiveSettings(admin_token_file=f)
    assert check_admin_token(s, "Bearer old") is None
    f.write_text("# rotating\nnew\nold\n")
    assert check_admin_token(s, "Bearer new") is None and check_admin_token(s, "Bearer old") is None
    f.write_text("new\n")
    assert "invalid" in check_admin_token(s, "Bearer old") and check_admin_token(s, "Bearer new") is None


def test_a_token_file_that_is_missing_or_empty_closes_even_with_auth_disabled(tmp_path):
    f = tmp_path / "admin"
    for s in (HiveSettings(admin_token_file=f, auth_disabled=True), HiveSettings(api_keys_file=f, auth_disabled=True)):
        assert "holds no" in (check_admin_token(s, "Bearer x") if s.admin_token_file else check_api_key(s, "Bearer x"))
    f.write_text("# nothing yet\n\n")
    assert "holds no" in check_admin_token(HiveSettings(admin_token_file=f, auth_disabled=True), "Bearer x")
    f.write_bytes(b"\xff\xfe")  # not UTF-8: no token, not a crash
    assert "holds no" in check_admin_token(HiveSettings(admin_token_file=f), "Bearer x")


def test_monitor_secret_file_is_reread_and_node_tokens_follow_it(tmp_path):
    from hive_apps.core.auth import check_monitor_token, monitor_token_node, node_monitor_token

    f = tmp_path / "monitor"
    f.write_text("s1\n")
    s = HiveSettings(monitor_token_file=f)
    t1, t2 = node_monitor_token("s1", "node-a"), node_monitor_token("s2", "node-a")
    assert monitor_token_node(s, f"Bearer {t1}") == "node-a" and monitor_token_node(s, f"Bearer {t2}") is None
    f.write_text("s2\ns1\n")  # rotating: agents move to s2's tokens one by one
    assert s.current_monitor_secrets() == ("s2", "s1")
    assert monitor_token_node(s, f"Bearer {t1}") == "node-a" == monitor_token_node(s, f"Bearer {t2}")
    f.write_text("s2\n")
    assert monitor_token_node(s, f"Bearer {t1}") is None and check_monitor_token(s, f"Bearer {t2}") is None
    assert "not an agent's token" in check_monitor_token(s, "Bearer s2")
    f.unlink()
    assert "HIVE_MONITOR_TOKEN_FILE" in check_monitor_token(s, f"Bearer {t2}")


def test_a_token_and_its_file_together_are_refused(monkeypatch, tmp_path):
    import pytest

    from hive_apps.core.settings import SettingsError

    monkeypatch.setenv("HIVE_ADMIN_TOKEN", "adm")
    monkeypatch.setenv("HIVE_ADMIN_TOKEN_FILE", str(tmp_path / "admin"))
    with pytest.raises(SettingsError) as e:
        HiveSettings.from_env()
    assert "set HIVE_ADMIN_TOKEN or HIVE_ADMIN_TOKEN_FILE, not both" in str(e.value)
    monkeypatch.delenv("HIVE_ADMIN_TOKEN")
    monkeypatch.setenv("HIVE_MONITOR_TOKEN_FILE", str(tmp_path / "monitor"))
    s = HiveSettings.from_env()
    assert s.admin_token_file == tmp_path / "admin" and s.monitor_token_file == tmp_path / "monitor"
