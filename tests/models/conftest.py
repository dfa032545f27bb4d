import pytest


def _tiny(tmp_path_factory, arch):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    return _tiny(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory):
    return _tiny(tmp_path_factory, "mixtral")


@pytest.fixture(scope="session")
def tiny_glm4_moe(tmp_path_factory):
    return _tiny(tmp_path_factory, "glm4_moe")
