-- The edge's one decision per request (hive_apps/serving/edge/config.py): show the request to the
-- gateway replica beside this HAProxy and, when it names an engine replica, route there.
-- Any other answer, or none, leaves the request to Serve's ingress (the config's default backend).

local DECIDE_URL = os.getenv("HIVE_EDGE_DECIDE_URL")
local DECIDE_TOKEN = os.getenv("HIVE_EDGE_DECIDE_TOKEN")
local TIMEOUT_MS = 5000

local function first(headers, name)
    local values = headers and headers[name]
    if values == nil then
        return nil
    end
    return values[0] or values[1]
end

core.register_action("hive_route", {"http-req"}, function(txn)
    local body = txn.sf:req_body() or ""
    local declared = tonumber(txn.sf:req_hdr("content-length"))
    if declared == nil or #body ~= declared then
        return -- chunked, or larger than the buffer: the Serve path reads it whole
    end
    local asked = txn.http:req_get_headers()
    local headers = {
        ["x-hive-edge-token"] = {DECIDE_TOKEN},
        ["x-hive-path"] = {txn.sf:path()},
        ["content-type"] = {first(asked, "content-type") or ""},
        ["x-request-id"] = {txn:get_var("txn.rid") or ""},
    }
    for _, name in ipairs({"authorization", "origin"}) do
        local value = first(asked, name)
        if value ~= nil then
            headers[name] = {value}
        end
    end
    local ok, res = pcall(function()
        return core.httpclient():post{url = DECIDE_URL, headers = headers, body = body, timeout = TIMEOUT_MS}
    end)
    if not ok or res == nil or res.status ~= 200 then
        return
    end
    local dst, port = first(res.headers, "x-hive-dst"), first(res.headers, "x-hive-dst-port")
    local token, path = first(res.headers, "x-hive-dst-token"), first(res.headers, "x-hive-dst-path")
    if dst == nil or port == nil or token == nil or path == nil then
        return
    end
    txn:set_var("txn.hive_port", tonumber(port))
    txn:set_var("txn.hive_token", token)
    txn:set_var("txn.hive_path", path)
    txn:set_var("txn.hive_replica", first(res.headers, "x-hive-replica") or "")
    txn:set_var("txn.hive_route", first(res.headers, "x-hive-route") or "")
    txn:set_var("txn.hive_dst", dst) -- last: its presence sends the request to the engine
end)
