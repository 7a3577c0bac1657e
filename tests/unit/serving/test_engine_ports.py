"""HIVE_ENGINE_PORT_RANGE: engine replicas listen inside a fixed range (NetworkPolicy), else anywhere."""

import contextlib
import socket
from urllib.parse import urlparse

import pytest

from hive_apps.core.ports import PortRangeError, listen_in_range, parse_port_range
from hive_apps.core.settings import HiveSettings, get_settings


def free_block(n: int) -> int:
    """The first of ``n`` consecutive ports that are free on 127.0.0.1 right now."""
    for low in range(30000, 60000, 97):
        with contextlib.ExitStack() as stack:
            try:
                for p in range(low, low + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return low
    raise RuntimeError("no free block of ports")


def test_parse_accepts_ranges_and_single_ports():
    assert parse_port_range("20000-20999") == (20000, 20999)
    assert parse_port_range(" 20000 - 20001 ") == (20000, 20001)
    assert parse_port_range("20000") == (20000, 20000)


@pytest.mark.parametrize("text", ["", "abc", "20000:20999", "20000-", "-5", "20999-20000", "0-10", "65000-70000", "1-2-3"])
def test_parse_rejects_malformed_ranges_and_says_how_to_write_one(text):
    with pytest.raises(PortRangeError, match="HIVE_ENGINE_PORT_RANGE") as e:
        parse_port_range(text)
    assert "20000-20999" in str(e.value)


def test_picks_the_first_free_port_and_skips_taken_ones():
    low = free_block(4)
    taken = socket.socket()
    taken.bind(("127.0.0.1", low))
    taken.listen()
    other = socket.socket()  # bound, not listening, no SO_REUSEADDR: still taken
    other.bind(("127.0.0.1", low + 1))
    try:
        first = listen_in_range((low, low + 3), host="127.0.0.1")
        second = listen_in_range((low, low + 3), host="127.0.0.1")  # the first replica's port is taken now
        assert first.getsockname()[1] == low + 2
        assert second.getsockname()[1] == low + 3
        with socket.create_connection(("127.0.0.1", low + 2), timeout=2):
            pass  # already listening: a client can connect before uvicorn takes the socket
        first.close()
        second.close()
    finally:
        taken.close()
        other.close()


def test_an_exhausted_range_is_a_clear_error():
    low = free_block(2)
    holders = [listen_in_range((low, low + 1), host="127.0.0.1") for _ in range(2)]
    try:
        with pytest.raises(PortRangeError, match=rf"no free port in HIVE_ENGINE_PORT_RANGE={low}-{low + 1}.*widen the range"):
            listen_in_range((low, low + 1), host="127.0.0.1")
    finally:
        for h in holders:
            h.close()


def test_without_a_range_any_free_port():
    s = listen_in_range(None, host="127.0.0.1")
    assert s.getsockname()[1] > 0
    s.close()


def test_setting_reads_the_variable_and_refuses_a_bad_one(monkeypatch):
    monkeypatch.delenv("HIVE_ENGINE_PORT_RANGE", raising=False)
    assert HiveSettings.from_env().engine_port_range is None
    monkeypatch.setenv("HIVE_ENGINE_PORT_RANGE", "21000-21099")
    assert HiveSettings.from_env().engine_port_range == (21000, 21099)
    monkeypatch.setenv("HIVE_ENGINE_PORT_RANGE", "21000..21099")
    with pytest.raises(ValueError, match="LOW-HIGH"):
        HiveSettings.from_env()


async def test_an_engine_replica_serves_inside_the_range(monkeypatch):
    from tests.unit.serving.test_engine_http import engine

    low = free_block(3)
    monkeypatch.setenv("HIVE_ENGINE_PORT_RANGE", f"{low}-{low + 2}")
    get_settings.cache_clear()
    try:
        e = await engine(sim_tokens_per_s=5000)
        port = urlparse(e.endpoint().url).port
        assert low <= port <= low + 2
        await e.http.stop()
    finally:
        get_settings.cache_clear()
