"""Builders the unit tests share: local stand-ins for the remote services weights come from, one
per test module (a module's tests may leave state in them; another module's never see it).

The unit tier's other shared builders are plain modules beside this one: ``helpers.py`` (plans and
replica plans), ``planning_fixtures.py`` (devices, profiles, hooks), ``fake_cluster.py`` (the
in-memory cluster the registry and the admin run on), ``fake_nvml.py``.
"""

import logging

import pytest
from moto.server import ThreadedMotoServer

from tests.fixtures.fake_hub import FakeHub


@pytest.fixture(scope="module")
def moto_s3_url():
    """moto's S3 (and IAM) server on a free local port: the real boto3 talks to it."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def fake_hub():
    """The suite's Hub-compatible server (``tests/fixtures/fake_hub.py``), no token required."""
    with FakeHub() as hub:
        yield hub
