"""GPTQ and AWQ INT4 checkpoints on a tiny Llama.

No CPU tool writes these formats (AutoGPTQ, GPTQModel and AutoAWQ quantize on CUDA), so the
test writes the public layouts itself, with the tools' own packing loops transcribed below
(AutoGPTQ `QuantLinear.pack`, AutoAWQ `WQLinear_GEMM.from_linear`), from a round-to-nearest
asymmetric quantization. HF transformers cannot load GPTQ/AWQ on a CPU without those tools, so
the reference is HF loading the same model with the dequantized weights ((q - zero) * scale,
the formats' definition): tokens must match exactly (the same float32 weights on both sides).
"""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_core import LLMEngine, SamplingParams
from tests.models.harness import hf_greedy

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32


def _rtn(w: torch.Tensor, group: int):
    """Asymmetric 4-bit RTN per group: (q [N, K] int, zeros [G, N] int, scales [G, N] fp16)."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-5).half()
    zeros = torch.clamp(torch.round(-lo / scales.float()), 0, 15)
    q = torch.clamp(torch.round(wg / scales.float()[..., None]) + zeros[..., None], 0, 15).reshape(n, k).int()
    return q, zeros.int().t().contiguous(), scales.t().contiguous()


def _dequant(q, zeros, scales, group):
    z = zeros.t().float().repeat_interleave(group, 1)
    return (q.float() - z) * scales.t().float().repeat_interleave(group, 1)


def _gptq_pack(q, zeros, bits=4):
    """AutoGPTQ QuantLinear.pack (qlinear_cuda_old), transcribed."""
    intweight = q.t().contiguous().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    zeros = (zeros - 1).numpy().astype(np.uint32)  # v1 format stores zero - 1
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32))


def _awq_pack(q, zeros, bits=4):
    """AutoAWQ WQLinear_GEMM.from_linear packing, transcribed."""
    intweight = q.t().contiguous().to(torch.int32)  # [K, N]
    pack_num, order_map = 32 // bits, [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 32 * bits), dtype=torch.int32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight[:, col] |= intweight[:, col * pack_num + order_map[i]] << (i * bits)
    zeros = zeros.to(torch.int32)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=torch.int32)
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzeros[:, col] |= zeros[:, col * pack_num + order_map[i]] << (i * bits)
    return qweight, qzeros


def _write(base, out, fmt):
    """out/<fmt>: the quantized checkpoint; out/<fmt>-dequant: the same weights dequantized."""
    quant_dir, deq_dir = out / fmt, out / f"{fmt}-dequant"
    shutil.copytree(base, quant_dir)
    shutil.copytree(base, deq_dir)
    state = load_file(str(base / "model.safetensors"))
    quant, deq = {}, {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if module.rsplit(".", 1)[-1] not in LINEARS:
            quant[name] = deq[name] = t
            continue
        q, zeros, scales = _rtn(t.float(), GROUP)
        deq[name] = _dequant(q, zeros, scales, GROUP)
        if fmt == "gptq":
            qweight, qzeros = _gptq_pack(q, zeros)
            quant[f"{module}.g_idx"] = torch.arange(t.shape[1], dtype=torch.int32) // GROUP
        else:
            qweight, qzeros = _awq_pack(q, zeros)
        quant.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": scales})
    save_file(quant, str(quant_dir / "model.safetensors"))
    save_file(deq, str(deq_dir / "model.safetensors"))
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
         "checkpoint_format": "gptq"} if fmt == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": None})
    (quant_dir / "config.json").write_text(json.dumps(cfg))
    return quant_dir, deq_dir


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_matches_hf_on_the_dequantized_weights(tiny_llama, tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    quant_dir, deq_dir = _write(tiny_llama, tmp_path, fmt)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 9, 40)]
    hf = AutoModelForCausalLM.from_pretrained(str(deq_dir), dtype=torch.float32).eval()
    ref = hf_greedy(hf, prompts, 10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for engine in (LLMEngine(str(quant_dir)), LLMEngine(str(quant_dir), max_num_batched_tokens=16)):
        assert [o["token_ids"] for o in engine.generate(prompts, params)] == ref


def test_repacks_into_the_canonical_layout(tiny_llama, tmp_path):
    from transformers import AutoConfig

    from atom_core.loader import build_model
    from atom_core.quant import get_quant_config

    quant_dir, _ = _write(tiny_llama, tmp_path, "awq")
    cfg = AutoConfig.from_pretrained(str(quant_dir))
    model = build_model(cfg, quant_dir, torch.float32, "cpu", quant_config=get_quant_config(cfg))
    qkv = model.model.layers[0].self_attn.qkv_proj  # q 64 + k 32 + v 32 outputs, K = 64
    assert qkv.w4_qweight.shape == (128, 8) and qkv.w4_zeros.shape == qkv.w4_scales.shape == (128, 2)
    assert not hasattr(qkv, "qweight")


def test_gptq_act_order_g_idx_is_rejected(tiny_llama, tmp_path):
    quant_dir, _ = _write(tiny_llama, tmp_path, "gptq")
    state = load_file(str(quant_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(quant_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="desc_act"):
        LLMEngine(str(quant_dir))


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size=48"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
])
def test_unsupported_configs_name_the_problem(qc, message):
    from types import SimpleNamespace

    from atom_core.quant import get_quant_config

    with pytest.raises(ValueError, match=message):
        get_quant_config(SimpleNamespace(quantization_config=qc))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_gpu_engine_matches_hf_on_the_dequantized_weights(tiny_llama, tmp_path, fmt):
    """The Triton W4A16 kernels in the engine (fp32, eager) against HF on the GPU."""
    from transformers import AutoModelForCausalLM

    quant_dir, deq_dir = _write(tiny_llama, tmp_path, fmt)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 9, 40, 70)]
    hf = AutoModelForCausalLM.from_pretrained(str(deq_dir), dtype=torch.float32).eval()  # on the CPU
    ref = hf_greedy(hf, prompts, 10)
    engine = LLMEngine(str(quant_dir), device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=256)
    got = [o["token_ids"] for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10,
                                                                          ignore_eos=True))]
    assert got == ref


@pytest.mark.gpu
def test_gpu_graphs_and_compile_equal_eager(tiny_llama, tmp_path):
    """W4A16 under torch.compile and CUDA graphs (the kernels run as atom:: custom ops)."""
    quant_dir, _ = _write(tiny_llama, tmp_path, "gptq")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 9, 40, 70, 3, 5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", num_kv_blocks=256, cudagraph_capture_sizes=(1, 2, 4, 8))
    eager = LLMEngine(str(quant_dir), enforce_eager=True, **common).generate(prompts, params)
    fast = LLMEngine(str(quant_dir), level=3, **common).generate(prompts, params)
    assert [o["token_ids"] for o in fast] == [o["token_ids"] for o in eager]
