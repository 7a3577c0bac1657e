"""Operator settings every test tier runs with: the test suite's own code hooks
(tests/unit/planning_fixtures.py) come from the ``tests`` package. And ``clean``, for the tiers
that run a hive (each package's ``hive`` fixture is its own)."""

import os

import pytest

os.environ.setdefault("HIVE_HOOK_PACKAGES", "tests")


@pytest.fixture
def clean(hive):
    """Every test starts and ends with no model deployed."""
    hive.admin.delete("/models")
    yield hive
    hive.admin.delete("/models")
