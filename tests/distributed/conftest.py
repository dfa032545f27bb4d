import pytest


@pytest.fixture(scope="session")
def tiny_dist_models(tmp_path_factory):
    """Tiny random models for the multi-rank tests, built once: arch -> directory."""
    from tests.tiny_models import build_tiny_model

    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_tiny_model(tmp_path_factory.mktemp(f"dist_{arch}"), arch)
        return cache[arch]

    return get
