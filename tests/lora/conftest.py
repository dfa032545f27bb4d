from __future__ import annotations

import pytest

from tests.lora.adapters import ATTENTION, MLP, make_adapter


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lora_base"), "llama")


@pytest.fixture(scope="session")
def adapters(lora_base, tmp_path_factory):
    """Three adapters: rank 8 on everything, rank 4 on attention with rsLoRA, rank 16 on the MLP."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": make_adapter(lora_base, root / "all8", rank=8, alpha=16, seed=1),
        "attn4rs": make_adapter(lora_base, root / "attn4rs", rank=4, alpha=8, targets=ATTENTION, use_rslora=True,
                                seed=2),
        "mlp16": make_adapter(lora_base, root / "mlp16", rank=16, alpha=8, targets=MLP, seed=3),
    }
