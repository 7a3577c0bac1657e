"""Operator settings every test tier runs with: the test suite's own code hooks
(tests/unit/planning_fixtures.py) come from the ``tests`` package."""

import os

os.environ.setdefault("HIVE_HOOK_PACKAGES", "tests")
