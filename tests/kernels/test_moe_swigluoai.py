"""GPT-OSS's clamped SwiGLU ("swigluoai") in the MoE kernels.

The reference (`moe_ref.fused_moe`) is checked against HF transformers' `GptOssExperts` (its
[E, H, 2I] interleaved layout converted to ours) and against a float64 loop; the Triton GEMM1
epilogue against the reference through the `device` fixture (`cuda` cases carry the `gpu`
marker; `cpu` cases run interpreted when pytest starts with TRITON_INTERPRET=1). Inputs are
scaled so the clamps bite: a test whose pre-activations stayed inside the limit would pass
with the clamps deleted.
"""
from __future__ import annotations

import zlib

import pytest
import torch

triton = pytest.importorskip("triton")

from atom_core.kernels import moe_ref  # noqa: E402
from atom_core.kernels.triton import moe as tm  # noqa: E402
from tests.kernels.test_moe_kernels import SMALL_TILES, make_moe_inputs  # noqa: E402
from tests.kernels.tolerances import DTYPES, TOL, rel_err  # noqa: E402


def _pre_activations(args) -> torch.Tensor:
    """x @ w13[e].T + b13[e] for every routed (token, expert), float32."""
    rows = []
    for t, ids in enumerate(args["topk_ids"].tolist()):
        for e in ids:
            if 0 <= e < args["w13"].shape[0]:
                rows.append(args["w13"][e].float() @ args["hidden"][t].float() + args["w13_bias"][e].float())
    return torch.stack(rows)


def _swiglu_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, device, seed, limit):
    """Biased inputs whose gate/up pre-activations straddle +-limit (gain 3: std about 3)."""
    args = make_moe_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, device, seed, bias=True)
    args["w13"] = (args["w13"].float() * 3).to(dtype)
    pre = _pre_activations(args)
    assert (pre > limit).any() and (pre[:, inter:] < -limit).any(), "the clamps must bite for the test to mean anything"
    return args | {"activation": "swigluoai", "swiglu_limit": limit}


def naive_swiglu_moe(hidden, w13, w2, weights, ids, b13, b2, limit) -> torch.Tensor:
    """One token and one slot at a time, in float64, written from HF's `_apply_gate`."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e].double() @ hidden[t].double() + b13[e].double()
            gate, up = h[:inter].clamp(max=limit), h[inter:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            out[t] += float(weights[t, k]) * (w2[e].double() @ act + b2[e].double())
    return out


class TestReference:
    @pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
    def test_matches_naive_loop(self, dtype, tol):
        args = _swiglu_inputs(11, 6, 2, 24, 10, dtype, "cpu", seed=3, limit=2.0)
        out = moe_ref.fused_moe(**args)
        naive = naive_swiglu_moe(args["hidden"], args["w13"], args["w2"], args["topk_weights"], args["topk_ids"],
                                 args["w13_bias"], args["w2_bias"], 2.0)
        assert out.dtype == dtype and rel_err(out, naive) < tol
        unclamped = naive_swiglu_moe(args["hidden"], args["w13"], args["w2"], args["topk_weights"],
                                     args["topk_ids"], args["w13_bias"], args["w2_bias"], 1e9)
        assert rel_err(out, unclamped) > 10 * tol

    def test_matches_hf_gpt_oss_experts(self):
        """HF's experts ([E, H, 2I] with gate/up interleaved in the last dim) against ours after the
        loader's conversion (transpose, gate columns then up columns)."""
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        num_experts, hidden, inter, top_k, limit = 4, 16, 12, 2, 1.5
        config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts,
                              num_experts_per_tok=top_k, swiglu_limit=limit)
        experts = GptOssExperts(config)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        x = torch.randn(9, hidden, generator=gen)
        weights, ids = moe_ref.moe_route(torch.randn(9, num_experts, generator=gen), top_k, renormalize=True)
        with torch.no_grad():
            ref = experts(x, ids.long(), weights)
        gate_up, bias = experts.gate_up_proj.data.transpose(1, 2), experts.gate_up_proj_bias.data
        w13 = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).contiguous()
        b13 = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
        out = moe_ref.fused_moe(x, w13, experts.down_proj.data.transpose(1, 2).contiguous(), weights, ids,
                                activation="swigluoai", w13_bias=b13, w2_bias=experts.down_proj_bias.data,
                                swiglu_limit=limit)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("kwargs,match", [
        (dict(activation="swigluoai"), "swigluoai' needs swiglu_limit > 0"),
        (dict(activation="swigluoai", swiglu_limit=0.0), "needs swiglu_limit > 0"),
        (dict(swiglu_limit=7.0), "applies to activation 'swigluoai' only"),
        (dict(activation="gelu"), "expected one of: silu, swigluoai"),
    ])
    def test_rejects_bad_arguments(self, kwargs, match):
        args = make_moe_inputs(2, 4, 2, 8, 4, torch.float32, "cpu", seed=0)
        with pytest.raises(ValueError, match=match):
            moe_ref.fused_moe(**args, **kwargs)
        with pytest.raises(ValueError, match=match):
            tm.fused_moe(**args, **kwargs)  # checked before any launch: runs on the CPU too


SWIGLU_CASES = {  # (num_experts, top_k, hidden, inter, tokens)
    "small": (4, 2, 64, 48, 7),
    "odd_dims": (5, 3, 72, 40, 19),
    "many_experts": (16, 4, 64, 32, 33),
}
SWIGLU_CASES_GPU = {  # gpt-oss-20b / -120b expert shapes
    "gpt_oss_20b_decode": (32, 4, 2880, 2880, 1),
    "gpt_oss_20b_b64": (32, 4, 2880, 2880, 64),
    "gpt_oss_20b_prefill": (32, 4, 2880, 2880, 2048),
    "gpt_oss_120b_b16": (128, 4, 2880, 2880, 16),
}


class TestKernel:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(SWIGLU_CASES) + [pytest.param(n, marks=pytest.mark.gpu)
                                                           for n in SWIGLU_CASES_GPU])
    def test_matches_reference(self, device, name, dtype):
        case = SWIGLU_CASES.get(name) or SWIGLU_CASES_GPU[name]
        if device == "cpu" and name not in SWIGLU_CASES:
            pytest.skip("GPU size")
        if dtype == torch.float32 and case[4] > 64:
            pytest.skip("fp32 at prefill size: no new coverage")
        limit = 2.0 if name in SWIGLU_CASES else 7.0
        args = _swiglu_inputs(*case[4:], *case[:4], dtype=dtype, device=device, seed=zlib.crc32(name.encode()),
                              limit=limit)
        ref = moe_ref.fused_moe(**args)
        for config in [None, SMALL_TILES] if name in SWIGLU_CASES else [None]:
            out = torch.full_like(args["hidden"], float("nan"))
            tm.launch_fused_moe(**args, config=config, out=out)
            assert rel_err(out, ref) < TOL[dtype], f"config {config}"

    def test_limit_is_a_runtime_argument(self, device):
        """Two limits through the same compiled kernel give the two references' results."""
        args = _swiglu_inputs(7, 4, 2, 32, 16, torch.float32, device, seed=5, limit=1.0)
        for limit in (1.0, 2.5):
            case = args | {"swiglu_limit": limit}
            assert rel_err(tm.fused_moe(**case), moe_ref.fused_moe(**case)) < TOL[torch.float32]

    def test_compiles_as_opaque_op(self, device):
        args = _swiglu_inputs(5, 4, 2, 32, 16, torch.float32, device, seed=4, limit=1.0)
        compiled = torch.compile(lambda a: tm.fused_moe(**a), backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(args), tm.fused_moe(**args))
        op_args = tuple(args[k] for k in ("hidden", "w13", "w2", "topk_weights", "topk_ids", "activation",
                                          "w13_bias", "w2_bias", "swiglu_limit"))
        torch.library.opcheck(tm.fused_moe_op, op_args, test_utils=("test_schema", "test_faketensor"))
