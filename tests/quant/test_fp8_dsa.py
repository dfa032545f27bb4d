"""Block-FP8 DeepSeek-V3.2 / GLM-5 checkpoints (the published models' format) through the FP8 path.

The checkpoint is the tiny DSA model (index_topk 8 below the prompts: the selection drops tokens)
rewritten in DeepSeek-V3's block-FP8 layout (tests/quant/test_fp8_models.py): the MLA projections,
the experts and the indexer's wq_b and wk in e4m3 with a weight_scale_inv per 128x128 block, the
indexer's weights_proj, the router, norms and embeddings unquantized (as the published
checkpoints store them). The oracle is HF on the same weights dequantized (q x scale, written as
a float checkpoint: no HF FP8 integration involved) with each quantized Linear's input
fake-quantized per token per 128 columns, as the format prescribes; the criterion is
test_fp8_models.py's (teacher-forced logits within EPS_LOGITS, every generated token
near-greedy under the oracle).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_core import LLMEngine
from atom_core.quant.fp8_ops import FP8_DTYPE, dequantize_fp8_block
from tests.models.test_deepseek_v32 import build_tiny_dsa
from tests.quant.test_fp8_models import QUANTIZED, _build, _check_against, hf_reference, write_block_fp8

DSA_QUANTIZED = QUANTIZED + ("wq_b", "wk")  # the indexer's projections; weights_proj stays unquantized


def write_dequantized(src, dst) -> None:
    """The block-FP8 checkpoint in `src` as float32 weights (q x its block's scale) in `dst`."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale_inv")
        out[name] = dequantize_fp8_block(t, scale, (128, 128)) if scale is not None else t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module", params=["v32", "glm5"])
def dsa_fp8(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"fp8-dsa-{request.param}")
    write_block_fp8(build_tiny_dsa(out / "bf16", request.param), out / "fp8", quantized=DSA_QUANTIZED)
    write_dequantized(out / "fp8", out / "dequantized")
    return out


def test_block_fp8_checkpoint_matches_the_dequantized_model(dsa_fp8):
    path = dsa_fp8 / "fp8"
    model = _build(path)
    attn = model.model.layers[0].self_attn
    for linear in (attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.indexer.wq_b, attn.indexer.wk):
        assert linear.weight.dtype == FP8_DTYPE, linear.prefix
    assert attn.indexer.weights_proj.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == FP8_DTYPE
    engines = [LLMEngine(str(path)), LLMEngine(str(path), max_num_batched_tokens=16, max_num_seqs=2)]
    _check_against(hf_reference(dsa_fp8 / "dequantized", quantized=DSA_QUANTIZED), model, engines)
