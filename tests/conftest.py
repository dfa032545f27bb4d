import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(autouse=True)
def _reset_cli_debug_flag():
    """`atomctl --debug` sets a process-wide flag; in-process CLI tests must not inherit it."""
    from atomctl.errors import DEBUG

    DEBUG["enabled"] = False
    yield
    DEBUG["enabled"] = False
