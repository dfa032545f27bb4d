"""MoE checkpoints load by rule: per-expert names (gate/up/down_proj, Mixtral's w1/w3/w2) and
HF's fused layout into the stacked w13 / w2, the router's float32 correction bias, the MTP
layer GLM checkpoints carry, and clear errors for a missing or stray expert tensor."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from atom_core.loader import build_model


def read(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def rewrite(src, dst, tensors):
    """A copy of model dir `src` whose weights are `tensors`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def build(path, dtype=torch.float32):
    return build_model(AutoConfig.from_pretrained(str(path)), path, dtype, "cpu")


@pytest.mark.parametrize("arch,block,names", [
    ("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    ("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
    ("glm4_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
])
def test_per_expert_tensors_stack_into_w13_and_w2(request, arch, block, names):
    path = request.getfixturevalue(f"tiny_{arch}")
    ckpt, experts = read(path), build(path).model.layers[2].get_submodule(f"{block}.experts")
    gate, up, down = names
    for e in (0, 5, 7):
        prefix = f"model.layers.2.{block}.experts.{e}"
        expected = torch.cat([ckpt[f"{prefix}.{gate}.weight"], ckpt[f"{prefix}.{up}.weight"]])
        assert torch.equal(experts.w13_weight[e], expected)
        assert torch.equal(experts.w2_weight[e], ckpt[f"{prefix}.{down}.weight"])


def test_hf_fused_expert_layout_loads_the_same(tiny_qwen3_moe, tmp_path):
    """transformers 5 holds experts as experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]."""
    ckpt, fused = read(tiny_qwen3_moe), {}
    for name, t in ckpt.items():
        if ".experts." not in name:
            fused[name] = t
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([ckpt[f"{p}.{e}.gate_proj.weight"], ckpt[f"{p}.{e}.up_proj.weight"]]) for e in range(8)])
        fused[f"{p}.down_proj"] = torch.stack([ckpt[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    a, b = build(tiny_qwen3_moe), build(rewrite(tiny_qwen3_moe, tmp_path / "fused", fused))
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name


def test_missing_expert_shard_is_named(tiny_mixtral, tmp_path):
    ckpt = read(tiny_mixtral)
    del ckpt["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    with pytest.raises(ValueError, match=r"block_sparse_moe.experts.w13_weight \(shards expert 3 w3\)"):
        build(rewrite(tiny_mixtral, tmp_path / "partial", ckpt))


def test_expert_beyond_num_experts_is_unexpected(tiny_qwen3_moe, tmp_path):
    ckpt = read(tiny_qwen3_moe)
    ckpt["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.8.gate_proj.weight' has no matching"):
        build(rewrite(tiny_qwen3_moe, tmp_path / "extra", ckpt))


def test_glm_mtp_layer_is_skipped_and_correction_bias_stays_fp32(tiny_glm4_moe, tmp_path):
    ckpt = read(tiny_glm4_moe)
    ckpt["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # the MTP layer after the last one
    ckpt["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    model = build(rewrite(tiny_glm4_moe, tmp_path / "mtp", ckpt), torch.bfloat16)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, ckpt["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # HF routes in fp32
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.bfloat16
