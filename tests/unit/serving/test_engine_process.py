"""The engine replica's process setup: the node's environment back where Ray changed it.

Each case runs in a child process (the function changes the process it runs in), with
the parent arranged the way a raylet would be.
"""

import json
import os
import subprocess
import sys
import textwrap

from tests.harness import ROOT

PY = sys.executable


def run_child(code: str, env: dict | None = None, parent_env: dict | None = None) -> dict:
    """Run ``code`` in a child Python under a shell that stands in for the raylet; return its last JSON line.

    The shell (the child's parent) has this process's environment without OMP_NUM_THREADS,
    plus ``parent_env``; the child gets ``env`` on top.
    """
    outer = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    outer.update({"PYTHONPATH": str(ROOT), **(parent_env or {})})
    inner = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    # "; true" keeps the shell alive as the child's parent (no exec of the last command)
    script = f'{inner} "$0" -c "$1"; true'
    out = subprocess.run(["bash", "-c", script, PY, textwrap.dedent(code)], env=outer, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


REPORT_ENV = """
import json, os
from hive_apps.serving.engine.base import restore_node_environment
changed = restore_node_environment()
print(json.dumps({"changed": changed, "omp": os.environ.get("OMP_NUM_THREADS")}))
"""


def test_ray_s_omp_num_threads_is_removed_when_the_node_did_not_set_it():
    got = run_child(REPORT_ENV, env={"OMP_NUM_THREADS": "1"})
    assert got == {"changed": ["OMP_NUM_THREADS"], "omp": None}


def test_omp_num_threads_the_node_set_is_kept():
    got = run_child(REPORT_ENV, env={"OMP_NUM_THREADS": "3"}, parent_env={"OMP_NUM_THREADS": "3"})
    assert got == {"changed": [], "omp": "3"}


def test_serves_log_file_keeps_writing_through_a_logging_reconfiguration(tmp_path):
    """vLLM's AsyncLLM runs logging.config.dictConfig as it starts, which closes every handler in
    the process; Serve's replica log file is one (a MemoryHandler in front of a file handler)."""
    import logging
    import logging.config
    import logging.handlers

    from hive_apps.serving.engine.base import serve_log_file_kept

    path = tmp_path / "replica.log"
    file_handler = logging.handlers.RotatingFileHandler(path)
    handler = logging.handlers.MemoryHandler(1, target=file_handler)
    serve_log = logging.getLogger("test-serve-replica")
    serve_log.addHandler(handler)
    serve_log.setLevel(logging.INFO)
    try:
        with serve_log_file_kept("test-serve-replica"):
            serve_log.info("before vLLM")
            logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})  # as vLLM does
            serve_log.info("while vLLM starts")
        serve_log.info("engine ready")
    finally:
        serve_log.removeHandler(handler)
        file_handler.close()
    assert path.read_text().splitlines() == ["before vLLM", "while vLLM starts", "engine ready"]
