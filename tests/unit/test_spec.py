import pytest
from pydantic import ValidationError

from hive_apps.spec import ModelSpec


def spec(**kw):
    return ModelSpec(**{"model_id": "m1", "model": "/models/x", **kw})


def test_defaults():
    s = spec()
    assert s.replicas == 1 and s.gpu is None and s.engine.value == "vllm" and s.pins == []


@pytest.mark.parametrize("bad", ["Upper", "-lead", "trail-", "a_b", "", "x" * 64])
def test_model_id_must_be_slug(bad):
    with pytest.raises(ValidationError, match="lowercase slug"):
        spec(model_id=bad)


@pytest.mark.parametrize("reserved", ["admin", "v1", "hive-registry", "hive-x"])
def test_model_id_reserved(reserved):
    with pytest.raises(ValidationError, match="reserved"):
        spec(model_id=reserved)


@pytest.mark.parametrize("n", [0, -2])
def test_replicas_positive_or_all(n):
    with pytest.raises(ValidationError, match="replicas|>= 1"):
        spec(replicas=n)


def test_gpu_names_checked():
    with pytest.raises(ValidationError, match="node>:gpu<index>"):
        spec(gpu="gpu0")
    with pytest.raises(ValidationError, match="same device twice"):
        spec(gpu=["a:gpu0", "a:gpu0"], replicas=2)
    with pytest.raises(ValidationError, match="empty list"):
        spec(gpu=[])


def test_pins_and_replicas_must_agree():
    assert spec(gpu=["a:gpu0", "b:gpu1"], replicas=2).pins == ["a:gpu0", "b:gpu1"]
    assert spec(gpu=["a:gpu0", "a:gpu1"], replicas=1).replicas == 1  # one TP group
    with pytest.raises(ValidationError, match="replicas=2 for one replica per device"):
        spec(gpu=["a:gpu0", "b:gpu1"], replicas=3)
    with pytest.raises(ValidationError, match="pins one device"):
        spec(gpu="a:gpu0", replicas=2)


def test_unknown_field_and_owned_kwargs_rejected():
    with pytest.raises(ValidationError, match="Extra inputs"):
        spec(replica=2)
    with pytest.raises(ValidationError, match="set by the hive"):
        spec(vllm_kwargs={"model": "other"})


def test_model_id_must_match_in_full():
    import pytest
    from pydantic import ValidationError

    from hive_apps.spec import ModelSpec

    for bad in ("admin\n", "qwen\n", "ok\nadmin"):
        with pytest.raises(ValidationError, match="lowercase slug"):
            ModelSpec(model_id=bad, model="x")


def test_lifecycle_timeouts_are_refused_until_built():
    import pytest
    from pydantic import ValidationError

    from hive_apps.spec import ModelSpec

    for field in ("sleep_timeout", "idle_timeout"):
        with pytest.raises(ValidationError, match=f"{field} is not supported yet"):
            ModelSpec(model_id="m", model="x", **{field: 60})
    assert ModelSpec(model_id="m", model="x").sleep_timeout is None
