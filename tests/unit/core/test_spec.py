import pytest
from pydantic import ValidationError

from hive_apps.core.spec import ModelSpec


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

    from hive_apps.core.spec import ModelSpec

    for bad in ("admin\n", "qwen\n", "ok\nadmin"):
        with pytest.raises(ValidationError, match="lowercase slug"):
            ModelSpec(model_id=bad, model="x")


def test_lifecycle_fields_must_agree():
    import pytest
    from pydantic import ValidationError

    from hive_apps.core.spec import ModelSpec

    with pytest.raises(ValidationError, match="idle_timeout=60 must be greater than sleep_timeout=60"):
        ModelSpec(model_id="m", model="x", sleep_timeout=60, idle_timeout=60)
    for field, value in (("priority", 3), ("keep_resident", True)):
        with pytest.raises(ValidationError, match=f"{field} only orders or prevents evictions"):
            ModelSpec(model_id="m", model="x", **{field: value})
    for bad in (0, -1):
        with pytest.raises(ValidationError, match="sleep_timeout"):
            ModelSpec(model_id="m", model="x", sleep_timeout=bad)
    ok = ModelSpec(model_id="m", model="x", sleep_timeout=30, idle_timeout=600, priority=2, keep_resident=True)
    assert ok.can_sleep and ok.priority == 2
    assert ModelSpec(model_id="m", model="x", idle_timeout=600).can_sleep is False  # destroyed, never slept


def test_model_folders_stay_under_the_operators_root(monkeypatch, tmp_path):
    import pytest
    from pydantic import ValidationError

    from hive_apps.core.settings import HiveSettings
    from hive_apps.core.spec import ModelSpec

    root = tmp_path / "models"
    (root / "tiny").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("HIVE_MODEL_ROOT", str(root))
    policy = HiveSettings()  # HIVE_MODEL_ROOT read from the environment, as a root reads it

    def spec(model: str) -> ModelSpec:  # a deploy body, as the admin validates it
        return ModelSpec.under_policy({"model_id": "m", "model": model}, policy)

    assert spec(str(root / "tiny")).model == str(root / "tiny")
    assert spec("Qwen/Qwen3-0.6B").model == "Qwen/Qwen3-0.6B"  # a cached HF name
    messages = []
    for bad in ("/etc", str(root / "link"), "/no/such/folder"):
        with pytest.raises(ValidationError) as e:
            spec(bad)
        messages.append(str(e.value).split("model\n")[1].split("[")[0].replace(bad, "<path>"))
    assert len(set(messages)) == 1 and "HIVE_MODEL_ROOT" in messages[0]  # the same, existing or not
    with pytest.raises(ValidationError, match="'..'"):
        spec("org/../../etc")


def test_aliases_are_other_free_slugs():
    assert spec().aliases == [] and spec().env == {}
    assert spec(aliases=["chat", "gpt-4o"]).aliases == ["chat", "gpt-4o"]
    for aliases, words in ((["m1"], "lists the model_id 'm1'"), (["a", "a"], "same alias twice"),
                           (["Chat"], "alias 'Chat': must be a lowercase slug"), (["x\n"], "lowercase slug"),
                           (["v1"], "'v1' is reserved"), (["hive-gw"], "reserved"),
                           ([f"a{i}" for i in range(17)], "lists 17 aliases; at most 16")):
        with pytest.raises(ValidationError, match=words):
            spec(aliases=aliases)
    assert len(spec(aliases=[f"a{i}" for i in range(16)]).aliases) == 16


def test_env_names_and_values_are_checked_and_the_deny_list_binds_without_a_policy():
    from hive_apps.core.engine_env import MAX_VALUE_CHARS

    assert spec(env={"ANY_NAME": "x"}).env == {"ANY_NAME": "x"}  # without a policy the allow-list is the operator's
    for env, words in (({"CUDA_VISIBLE_DEVICES": "1"}, "CUDA_VISIBLE_DEVICES is refused: the hive pins"),
                       ({"cuda_visible_devices": "1"}, "refused"), ({"LD_PRELOAD": "/x.so"}, "native libraries"),
                       ({"PYTHONPATH": "/x"}, "LD_|PYTHON|Python code"), ({"HIVE_API_KEYS": ""}, "hive's own"),
                       ({"RAY_ADDRESS": "x"}, "Ray's own"), ({"HF_TOKEN": "x"}, "Hugging Face"),
                       ({"AWS_PROFILE": "x"}, "S3 credentials"), ({"VLLM_PLUGINS": "x"}, "plugins"),
                       ({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}, "unpickle"),
                       ({"1BAD": "x"}, "not a variable name"), ({"A=B": "x"}, "not a variable name"),
                       ({"NCCL_DEBUG": "a\0b"}, "without NUL"), ({"NCCL_DEBUG": "x" * (MAX_VALUE_CHARS + 1)}, "at most 4096"),
                       ({f"V{i}": "1" for i in range(65)}, "sets 65 variables; at most 64")):
        with pytest.raises(ValidationError, match=words):
            spec(env=env)
    with pytest.raises(ValidationError, match="valid string"):
        spec(env={"NCCL_DEBUG": 1})


def test_env_under_the_operators_allow_list():
    from hive_apps.core.settings import HiveSettings

    body = {"model_id": "m1", "model": "/models/x"}
    ok = ModelSpec.under_policy({**body, "env": {"VLLM_USE_V2_MODEL_RUNNER": "1", "NCCL_P2P_DISABLE": "1"}},
                                HiveSettings())
    assert ok.env == {"VLLM_USE_V2_MODEL_RUNNER": "1", "NCCL_P2P_DISABLE": "1"}
    with pytest.raises(ValidationError, match="HIVE_ENGINE_ENV_ALLOW=MY_KNOB"):
        ModelSpec.under_policy({**body, "env": {"MY_KNOB": "1"}}, HiveSettings())
    widened = HiveSettings(engine_env_allow=["MY_*", "OTHER"])
    assert ModelSpec.under_policy({**body, "env": {"MY_KNOB": "1", "OTHER": "2"}}, widened).env["OTHER"] == "2"
    with pytest.raises(ValidationError, match="OTHER_X is not among"):
        ModelSpec.under_policy({**body, "env": {"OTHER_X": "1"}}, widened)
    with pytest.raises(ValidationError, match="HF_HOME is refused"):  # the deny-list wins over any pattern
        ModelSpec.under_policy({**body, "env": {"HF_HOME": "/tmp"}}, HiveSettings(engine_env_allow=["*"]))


def test_the_env_allow_setting_takes_names_and_prefix_patterns(monkeypatch):
    from hive_apps.core.settings import HiveSettings, SettingsError

    monkeypatch.setenv("HIVE_ENGINE_ENV_ALLOW", "MY_KNOB, NCCL_*")
    assert HiveSettings.from_env().engine_env_allow == ["MY_KNOB", "NCCL_*"]
    monkeypatch.setenv("HIVE_ENGINE_ENV_ALLOW", "A*B,ok")
    with pytest.raises(SettingsError, match="HIVE_ENGINE_ENV_ALLOW.*A\\*B"):
        HiveSettings.from_env()
