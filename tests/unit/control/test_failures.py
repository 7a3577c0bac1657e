from hive_apps.control.admin.failures import failure_reason, root_cause

TRACE = (
    "Failed to update the deployments ['engine-r0']. | The deployment failed to start 3 times in a row.\n"
    "Traceback (most recent call last):\n"
    + "".join(f'  File "/a/very/long/path/number/{i}/module.py", line {i}, in f\n    x()\n' for i in range(80))
    + 'RuntimeError: simulated engine start failure (sim_fail_start)\n'
)


def test_root_cause_is_the_last_exception_line():
    assert root_cause(TRACE) == "RuntimeError: simulated engine start failure (sim_fail_start)"
    assert root_cause("ValueError: a\nKeyError: 'b'") == "KeyError: 'b'"
    assert root_cause("vllm.v1.engine.exceptions.EngineDeadError: dead") == \
        "vllm.v1.engine.exceptions.EngineDeadError: dead"


def test_no_exception_line_means_plain_truncation():
    assert root_cause("replica not ready yet") is None
    assert failure_reason("x" * 50, limit=10) == "x" * 10


def test_reason_keeps_the_cause_when_the_trace_is_long():
    assert len(TRACE) > 2000
    reason = failure_reason(TRACE)
    assert reason.startswith("RuntimeError: simulated engine start failure (sim_fail_start) | details: Failed")
    assert len(reason) <= 2000
    assert failure_reason(TRACE, limit=30) == "RuntimeError: simulated engine"
