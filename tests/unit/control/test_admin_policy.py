"""The operator's policy binds every deploy body (``core/spec.py``): a ``ModelSpec`` built without
settings in its validation context is checked for shape only, so the admin validates what a user
sends under its own settings (``under_policy``), on every route that takes a spec."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hive_apps.core.settings import HiveSettings
from hive_apps.core.spec import SETTINGS as POLICY
from hive_apps.core.spec import ModelSpec
from tests.unit.control.test_admin_app import NODES, SETTINGS, SIM_MODEL, admin_on, sim_spec
from tests.unit.fake_cluster import FakeCluster

REMOTE_CODE = {"trust_remote_code": True}


def test_without_settings_only_the_shape_is_checked():
    body = {"model_id": "m", "model": SIM_MODEL, "vllm_kwargs": {**REMOTE_CODE, "some_new_arg": 1}}
    assert ModelSpec.model_validate(body).vllm_kwargs == body["vllm_kwargs"]  # the operator's to allow
    with pytest.raises(ValidationError, match="refused: it runs the model repository"):
        ModelSpec.model_validate(body, context={POLICY: HiveSettings(trust_remote_code=False)})
    with pytest.raises(ValidationError, match="set by the hive"):  # never taken, whatever the policy
        ModelSpec.model_validate({**body, "vllm_kwargs": {"served_model_name": "x"}})
    with pytest.raises(ValidationError, match="must be an integer"):  # a type is shape
        ModelSpec.model_validate({**body, "vllm_kwargs": {"max_num_seqs": "many"}})
    with pytest.raises(TypeError):
        ModelSpec.model_validate(body, context={POLICY: {"trust_remote_code": True}})


@pytest.mark.parametrize("route", ["/models", "/plan"])
async def test_every_route_that_takes_a_spec_checks_it_against_the_admins_settings(route, tmp_path):
    async with admin_on(FakeCluster(NODES), SETTINGS) as admin:  # no remote code (the default)
        r = await admin.client.post(route, json=sim_spec("rc", vllm_kwargs=REMOTE_CODE))
        assert r.status_code == 422 and "trust_remote_code is refused" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["field"] == "vllm_kwargs"
    root = tmp_path / "models"
    root.mkdir()
    async with admin_on(FakeCluster(NODES), SETTINGS.model_copy(update={"model_root": root})) as admin:
        r = await admin.client.post(route, json=sim_spec("out"))  # the fixture's folder is not under the root
        assert r.status_code == 422 and "HIVE_MODEL_ROOT" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["field"] == "model"
    async with admin_on(FakeCluster(NODES), SETTINGS.model_copy(update={"trust_remote_code": True})) as admin:
        r = await admin.client.post(route, json=sim_spec("rc", vllm_kwargs=REMOTE_CODE))
        assert r.status_code in (200, 202), r.text  # what the policy allows passes
