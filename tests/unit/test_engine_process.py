"""The engine replica's process setup: the node's environment back, and Ray's daemon priority.

Each case runs in a child process (the functions change the process they run in), with
the parent arranged the way a raylet would be.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.harness import ROOT

PY = sys.executable


def run_child(code: str, env: dict | None = None, parent_env: dict | None = None, nice: int = 0) -> dict:
    """Run ``code`` in a child Python under a shell that stands in for the raylet; return its last JSON line.

    The shell (the child's parent) has this process's environment without OMP_NUM_THREADS,
    plus ``parent_env``, at this process's niceness; the child gets ``env`` on top, at +``nice``.
    """
    outer = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    outer.update({"PYTHONPATH": str(ROOT), **(parent_env or {})})
    inner = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    # "; true" keeps the shell alive as the child's parent (no exec of the last command)
    script = f'{inner} nice -n {nice} "$0" -c "$1"; true'
    out = subprocess.run(["bash", "-c", script, PY, textwrap.dedent(code)], env=outer, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


REPORT_ENV = """
import json, os
from hive_apps.engine.base import restore_node_environment
changed = restore_node_environment()
print(json.dumps({"changed": changed, "omp": os.environ.get("OMP_NUM_THREADS")}))
"""


def test_ray_s_omp_num_threads_is_removed_when_the_node_did_not_set_it():
    got = run_child(REPORT_ENV, env={"OMP_NUM_THREADS": "1"})
    assert got == {"changed": ["OMP_NUM_THREADS"], "omp": None}


def test_omp_num_threads_the_node_set_is_kept():
    got = run_child(REPORT_ENV, env={"OMP_NUM_THREADS": "3"}, parent_env={"OMP_NUM_THREADS": "3"})
    assert got == {"changed": [], "omp": "3"}


RENICE = """
import json, os, subprocess, sys, threading
from hive_apps.engine.base import raise_engine_priority
stop = threading.Event()
t = threading.Thread(target=stop.wait); t.start()   # a thread that exists before the renice
before = os.getpriority(os.PRIO_PROCESS, 0)
raise_engine_priority()
threads = {int(tid): os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}
child = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                       capture_output=True, text=True).stdout.strip()
stop.set(); t.join()
print(json.dumps({"before": before, "threads": sorted(set(threads.values())), "nthreads": len(threads),
                  "child": int(child), "parent": os.getpriority(os.PRIO_PROCESS, os.getppid())}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering niceness needs root or CAP_SYS_NICE")
def test_engine_takes_the_raylet_s_priority_on_every_thread_and_its_children():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    got = run_child(RENICE, nice=12)
    assert got["before"] == min(19, base + 12)
    assert got["parent"] == base and got["nthreads"] >= 2
    assert got["threads"] == [base]
    assert got["child"] == base


@pytest.mark.skipif(os.geteuid() == 0, reason="root may always lower niceness")
def test_without_permission_the_engine_keeps_its_niceness():
    got = run_child(RENICE, nice=12)
    assert got["threads"] == [got["before"]] and got["before"] > got["parent"]
