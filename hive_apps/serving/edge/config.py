"""The edge's HAProxy configuration, as text: pure, so a unit test reads what HAProxy will run.

The edge takes every request on ``HIVE_EDGE_PORT``. A JSON ``POST`` to ``/v1/...`` or
``/<model_id>/v1/...`` whose body fits HAProxy's buffer is shown to the gateway replica beside it
(``hive_edge.lua`` -> ``POST /hive/route`` on loopback), which decides once: an engine replica
(its address, its port token, the path vLLM serves) or "not mine". An engine-bound request then
goes to that replica's own port from HAProxy, and its answer streams back from there: no Python
process relays a byte. Everything else (errors, holds while a model wakes, aliases, adapters,
split requests, bodies too large, non-JSON, other paths) goes to Serve's ingress unchanged, where
the gateway and the routers answer it as they always did.
"""

from __future__ import annotations

from dataclasses import dataclass

from hive_apps.core.openai_errors import openai_error
from hive_apps.serving import request_ids
from hive_apps.serving.routing.http import PASSED_HEADERS

ROUTE_PATH = "/hive/route"
"""The gateway replica's decision endpoint (loopback only, token-guarded)."""
DECIDE_TOKEN_HEADER = "x-hive-edge-token"
# What the decision answers, as response headers the Lua action copies into HAProxy variables.
DST_HEADER, PORT_HEADER, TOKEN_HEADER = "x-hive-dst", "x-hive-dst-port", "x-hive-dst-token"
PATH_HEADER, REPLICA_HEADER, ROUTE_HEADER = "x-hive-dst-path", "x-hive-replica", "x-hive-route"
FORWARDED_PATH_HEADER = "x-hive-path"  # the client's path, as the decision is asked
EDGE_HEADER = "x-hive-edge"  # on an answer that came from the engine through the edge (1), not the Serve path
ENGINE_HEADERS = (*sorted(PASSED_HEADERS), request_ids.HEADER, "content-length", "transfer-encoding", "host")
"""The only request headers an engine gets from a client: the Serve path's (``routing/http.py``
PASSED_HEADERS) and the request id, with the message's framing; never its API key, cookies or x-hive-*."""
REQUEST_ID = f"^{request_ids.PATTERN}$"  # the client's own id is kept when well formed, as on the Serve path
UNAVAILABLE = bytes(openai_error(503, "the engine replica chosen for this request did not answer; retry").body).decode()
"""HAProxy's own answer when the chosen engine replica refuses the connection (it died since the last load poll)."""
BUFSIZE = 64 * 1024
"""HAProxy's buffer: the largest request body the edge routes itself (chat turns, completions). A
larger one (long contexts, inline images) goes the Serve path, which takes up to 16 MiB."""


@dataclass(frozen=True)
class EdgeConfig:
    port: int  # HIVE_EDGE_PORT, on every interface of the node
    serve_addr: str  # host:port of Serve's ingress: what the edge does not route itself
    read_timeout_s: float  # HIVE_ENGINE_READ_TIMEOUT_S: an engine silent this long ends the request
    client_timeout_s: int = 30  # a client silent this long while it sends its request
    threads: int = 1
    bufsize: int = BUFSIZE


def _quoted(text: str) -> str:
    """``text`` inside an HAProxy double-quoted string (no ``%``: these strings are not log formats)."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def render(cfg: EdgeConfig, lua_path: str) -> str:
    """HAProxy's configuration; ``lua_path``: where ``hive_edge.lua`` is."""
    keep = "|".join(ENGINE_HEADERS)
    return f"""\
global
    maxconn 4096
    nbthread {cfg.threads}
    tune.bufsize {cfg.bufsize}
    lua-load {lua_path}
    httpclient.retries 0
    httpclient.timeout.connect 2s
    close-spread-time 1s  # on a soft stop, idle keep-alive connections close within 1 s, not at their timeout

defaults
    mode http
    timeout connect 2s
    timeout client {cfg.client_timeout_s}s
    timeout server {int(cfg.read_timeout_s)}s
    timeout http-request 60s
    timeout http-keep-alive 90s
    option http-no-delay
    option http-buffer-request

frontend edge
    bind :{cfg.port}
    # the client's own id when well formed, else HAProxy's; sent on, and back in the answer
    unique-id-format %{{+X}}o%ci%cp%fp%Ts%ms%rt%pid
    http-request set-var(txn.rid) req.hdr(x-request-id) if {{ req.hdr(x-request-id) -m reg {REQUEST_ID} }}
    http-request set-var(txn.rid) unique-id unless {{ var(txn.rid) -m found }}
    http-request set-header x-request-id %[var(txn.rid)]
    http-response set-header x-request-id %[var(txn.rid)]
    acl openai path_reg ^/([^/]+/)?v1/
    acl json req.hdr(content-type) -m beg -i application/json
    http-request lua.hive_route if METH_POST openai json
    use_backend engine if {{ var(txn.hive_dst) -m found }}
    default_backend serve

backend engine
    http-request set-dst var(txn.hive_dst)
    http-request set-dst-port var(txn.hive_port)
    http-request set-path %[var(txn.hive_path)]
    http-request del-header ^(?!({keep})$) -m reg
    http-request set-header x-hive-engine-token %[var(txn.hive_token)]
    http-response set-header x-hive-replica %[var(txn.hive_replica)]
    http-response set-header x-hive-route %[var(txn.hive_route)]
    http-response set-header {EDGE_HEADER} 1
    # An engine that died since the last load poll (at most about a second): HAProxy cannot send the
    # request elsewhere with the client's key already dropped, so the client gets a 503 it retries.
    retries 0
    http-error status 503 content-type application/json string "{_quoted(UNAVAILABLE)}" hdr retry-after 1
    server engine 0.0.0.0:0

backend serve
    server serve {cfg.serve_addr}
"""
