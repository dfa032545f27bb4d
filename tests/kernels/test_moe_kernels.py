"""MoE routing, block alignment and fused experts.

The torch reference (`kernels/moe_ref.py`) is checked on the CPU against HF transformers'
routers and against hand-written loops; the Triton kernels are checked against the reference
through the `device` fixture: `cuda` cases carry the `gpu` marker, `cpu` cases run under
Triton's interpreter with small shapes when pytest starts with TRITON_INTERPRET=1:
    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_moe_kernels.py -q
"""
from __future__ import annotations

import inspect
import json
import zlib

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from atom_core.kernels import moe_ref
from benchmarks.kernels import tune_moe  # noqa: E402
from atom_core.kernels.triton import moe as tm  # noqa: E402
from tests.kernels.tolerances import DTYPES, TOL, rel_err  # noqa: E402


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# ---------------------------------------------------------------------------------------------
# reference routing


def _hf_router(kind: str, num_experts: int, top_k: int, gen: torch.Generator):
    """A HF router module with random weights (and a random correction bias where it has one)."""
    import transformers as tr

    common = dict(hidden_size=32, num_experts_per_tok=top_k)
    if kind.startswith("qwen3"):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as cls
        cfg = tr.Qwen3MoeConfig(num_experts=num_experts, norm_topk_prob=kind == "qwen3_norm", **common)
    elif kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as cls
        cfg = tr.MixtralConfig(num_local_experts=num_experts, **common)
    elif kind == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as cls
        cfg = tr.DeepseekV2Config(n_routed_experts=num_experts, n_group=4, topk_group=2,
                                  topk_method="group_limited_greedy", routed_scaling_factor=1.5, **common)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

        cls = DeepseekV3TopkRouter if kind == "deepseek_v3" else Glm4MoeTopkRouter
        config_cls = tr.DeepseekV3Config if kind == "deepseek_v3" else tr.Glm4MoeConfig
        cfg = config_cls(n_routed_experts=num_experts, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5, **common)
    router = cls(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.3)
    return router


HF_ROUTE_ARGS = {  # our moe_route arguments for each HF router above
    "qwen3": dict(scoring="softmax"),
    "qwen3_norm": dict(scoring="softmax", renormalize=True),
    "mixtral": dict(scoring="softmax", renormalize=True),
    "deepseek_v2": dict(scoring="softmax", num_expert_group=4, topk_group=2, routed_scaling_factor=1.5),
    "deepseek_v3": dict(scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
                        routed_scaling_factor=2.5),
    "glm4_moe": dict(scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
}


def sort_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


class TestReferenceRouting:
    @pytest.mark.parametrize("kind", HF_ROUTE_ARGS)
    def test_matches_hf_router(self, kind):
        gen = seeded(kind)
        router = _hf_router(kind, 16, 4, gen)
        hidden = torch.randn(37, 32, generator=gen)
        with torch.no_grad():
            logits, hf_weights, hf_ids = router(hidden)
        args = dict(HF_ROUTE_ARGS[kind])
        if hasattr(router, "e_score_correction_bias"):
            args["correction_bias"] = router.e_score_correction_bias
        weights, ids = moe_ref.moe_route(logits, 4, **args)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32
        ours, hf = sort_by_id(weights, ids), sort_by_id(hf_weights.float(), hf_ids)
        assert torch.equal(ours[1], hf[1])
        torch.testing.assert_close(ours[0], hf[0], rtol=1e-6, atol=1e-7)

    def test_ties_go_to_lower_expert_ids(self):
        logits = torch.zeros(3, 8)
        logits[1, 5:] = 1.0  # three tied winners for two slots
        weights, ids = moe_ref.moe_route(logits, 2)
        assert ids.tolist() == [[0, 1], [5, 6], [0, 1]]
        torch.testing.assert_close(weights[0], torch.full((2,), 1 / 8))
        weights, _ = moe_ref.moe_route(logits, 2, renormalize=True)
        torch.testing.assert_close(weights, torch.full((3, 2), 0.5))

    def test_group_mask_excludes_a_strong_expert_of_a_weak_group(self):
        # 4 groups of 2. Group 3 holds the single best expert (7) but the worst top-2 sum.
        logits = torch.tensor([[2.0, 1.9, 1.0, 1.1, -5.0, -5.0, -9.0, 6.0]])
        _, ids = moe_ref.moe_route(logits, 3, scoring="sigmoid", num_expert_group=4, topk_group=2)
        assert sorted(ids[0].tolist()) == [0, 1, 3]
        _, ungrouped = moe_ref.moe_route(logits, 3, scoring="sigmoid")
        assert 7 in ungrouped[0].tolist()

    def test_top_k_beyond_kept_experts_takes_masked_ones_like_hf(self):
        logits = torch.tensor([[3.0, 2.0, 0.5, 0.4, -1.0, -2.0]])  # 3 groups of 2, keep 1 group
        weights, ids = moe_ref.moe_route(logits, 3, scoring="sigmoid", num_expert_group=3, topk_group=1)
        assert ids[0].tolist() == [0, 1, 2]  # the masked pick: lowest id among the -inf choices
        torch.testing.assert_close(weights[0], torch.sigmoid(logits[0, :3]))  # unbiased scores
        weights, ids = moe_ref.moe_route(logits, 3, scoring="softmax", num_expert_group=3, topk_group=1)
        assert ids[0].tolist() == [0, 1, 2] and weights[0, 2].item() == 0.0  # DeepSeek-V2 masks to 0

    def test_top_k_equal_to_num_experts_returns_every_expert(self):
        logits = torch.randn(4, 6, generator=seeded("all"))
        weights, ids = moe_ref.moe_route(logits, 6, renormalize=True)
        assert (ids.sort(dim=-1).values == torch.arange(6)).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones(4))
        assert (weights[:, :-1] >= weights[:, 1:]).all()  # largest first

    def test_renormalize_and_scaling(self):
        logits = torch.randn(5, 16, generator=seeded("scale")).to(torch.bfloat16)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = moe_ref.moe_route(logits, 4, routed_scaling_factor=2.0)
        torch.testing.assert_close(weights, 2.0 * probs.gather(1, ids.long()))
        weights, _ = moe_ref.moe_route(logits, 4, renormalize=True, routed_scaling_factor=2.0)
        torch.testing.assert_close(weights.sum(-1), torch.full((5,), 2.0))

    @pytest.mark.parametrize("kwargs,match", [
        (dict(scoring="tanh"), "expected one of: softmax, sigmoid"),
        (dict(num_expert_group=3, topk_group=1), "must divide"),
        (dict(num_expert_group=4, topk_group=5), "topk_group"),
        (dict(top_k=9), "top_k"),
    ])
    def test_rejects_bad_arguments(self, kwargs, match):
        args = dict(top_k=2) | kwargs
        with pytest.raises(ValueError, match=match):
            moe_ref.moe_route(torch.zeros(2, 8), **args)


# ---------------------------------------------------------------------------------------------
# reference alignment and fused experts


def check_alignment(topk_ids, block_size, num_experts, sorted_ids, expert_ids, num_post) -> None:
    """The alignment contract, from first principles."""
    flat = topk_ids.flatten().long().cpu()
    num_assignments = flat.numel()
    n = int(num_post)
    used, blocks = sorted_ids.cpu()[:n].long(), expert_ids.cpu().long()
    assert n % block_size == 0
    assert sorted_ids.numel() == moe_ref.max_padded_slots(num_assignments, num_experts, block_size)
    valid = (flat >= 0) & (flat < num_experts)
    real = used[used < num_assignments]
    assert torch.equal(real.sort().values, valid.nonzero().squeeze(1)), "each kept (token, k) exactly once"
    assert (used[used >= num_assignments] == num_assignments).all(), "pads hold the sentinel"
    owner = blocks[:n // block_size].repeat_interleave(block_size)
    assert (owner[used < num_assignments] == flat[real]).all(), "each row sits in a block of its expert"
    assert (blocks[:n // block_size].diff() >= 0).all(), "one run per expert, in expert order"
    assert (blocks[n // block_size:] == -1).all()
    counts = torch.bincount(flat[valid], minlength=num_experts)
    assert n == int(((counts + block_size - 1) // block_size * block_size).sum()), "runs padded to block_size, no more"
    for e in blocks[:n // block_size].unique().tolist():
        rows = used[(owner == e) & (used < num_assignments)]
        assert (rows.diff() > 0).all(), "ascending (token, k) order within an expert"


class TestReferenceAlignment:
    @pytest.mark.parametrize("num_tokens,top_k,num_experts,block_size", [(1, 1, 1, 16), (9, 2, 8, 4), (50, 4, 16, 16)])
    def test_invariants(self, num_tokens, top_k, num_experts, block_size):
        gen = seeded(num_tokens, num_experts)
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
        if num_experts > 1:
            ids[ids == num_experts - 1] = 0  # an expert no token picks
        check_alignment(ids, block_size, num_experts, *moe_ref.moe_align_block_size(ids, block_size, num_experts))

    def test_drops_ids_outside_the_expert_range(self):
        ids = torch.tensor([[0, -1], [4, 2], [2, 2]], dtype=torch.int32)
        sorted_ids, expert_ids, num_post = moe_ref.moe_align_block_size(ids, 4, 4)
        check_alignment(ids, 4, 4, sorted_ids, expert_ids, num_post)
        assert sorted_ids[:int(num_post)].tolist() == [0, 6, 6, 6, 3, 4, 5, 6]


def naive_moe(hidden, w13, w2, weights, ids, b13=None, b2=None) -> torch.Tensor:
    """One token and one slot at a time, in float64."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e].double() @ hidden[t].double() + (0 if b13 is None else b13[e].double())
            y = w2[e].double() @ (F.silu(h[:inter]) * h[inter:]) + (0 if b2 is None else b2[e].double())
            out[t] += float(weights[t, k]) * y
    return out


def make_moe_inputs(num_tokens, num_experts, top_k, hidden_size, inter, dtype, device, seed, bias=False):
    """Random inputs with routed weights; expert 1 is never picked and one slot is dropped (-1).
    Weights scale by fan-in, so activations stay O(1) at every size."""
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    logits = randn(num_tokens, num_experts)
    if num_experts > top_k + 1:
        logits[:, 1] = -1e4
    weights, ids = moe_ref.moe_route(logits, top_k, renormalize=True)
    if num_tokens > 2:
        ids[2, -1] = -1
    return dict(hidden=randn(num_tokens, hidden_size).to(dtype),
                w13=(randn(num_experts, 2 * inter, hidden_size) * hidden_size ** -0.5).to(dtype),
                w2=(randn(num_experts, hidden_size, inter) * inter ** -0.5).to(dtype),
                topk_weights=weights, topk_ids=ids,
                w13_bias=randn(num_experts, 2 * inter).to(dtype) if bias else None,
                w2_bias=randn(num_experts, hidden_size).to(dtype) if bias else None)


class TestReferenceFusedMoe:
    @pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
    def test_matches_naive_loop(self, dtype, tol):
        args = make_moe_inputs(11, 6, 2, 24, 10, dtype, "cpu", seed=3, bias=True)
        out = moe_ref.fused_moe(**args)
        assert out.dtype == dtype
        naive = naive_moe(args["hidden"], args["w13"], args["w2"], args["topk_weights"], args["topk_ids"],
                          args["w13_bias"], args["w2_bias"])
        assert rel_err(out, naive) < tol
        assert out[2].ne(0).any()  # the token with a dropped slot still gets its other expert

    def test_rejects_unknown_activation(self):
        args = make_moe_inputs(2, 4, 2, 8, 4, torch.float32, "cpu", seed=0)
        with pytest.raises(ValueError, match="expected one of: silu"):
            moe_ref.fused_moe(**args, activation="gelu")


# ---------------------------------------------------------------------------------------------
# config tables and the tuner's pure parts (CPU)


class TestConfigTable:
    def test_json_round_trip_picks_nearest_bucket(self, tmp_path):
        small = tm.MoeConfig(16, tm.GemmTile(32, 128, 1, 4, 5), tm.GemmTile(64, 256, 1, 4, 3))
        large = tm.MoeConfig(128, tm.GemmTile(128, 64, 16, 8, 3), tm.GemmTile(256, 64, 16, 8, 3))
        name = tm.config_file_name(128, 2048, 768, torch.bfloat16, "cpu")
        assert name == "E=128,N=768,K=2048,dtype=bfloat16,device=cpu.json"
        tune_moe.write_config_table(tmp_path / name, {1: small, 4096: large}, {"top_k": 8})

        def pick(tokens, top_k=8):
            return tm.get_moe_config(128, 2048, 768, top_k, torch.bfloat16, tokens, "cpu", tmp_path)

        assert pick(1) == small and pick(100) == small and pick(3000) == large and pick(10**6) == large
        assert pick(3000, top_k=2) == small  # 3000 tokens x 2 slots ~ 750 tokens x 8 slots
        assert json.loads((tmp_path / name).read_text())["configs"]["4096"]["gemm1"]["group_m"] == 16

    def test_missing_table_falls_back_to_defaults_by_rows_per_expert(self, tmp_path):
        decode = tm.get_moe_config(128, 2048, 768, 8, torch.bfloat16, 4, "cpu", tmp_path)
        prefill = tm.get_moe_config(128, 2048, 768, 8, torch.bfloat16, 8192, "cpu", tmp_path)
        assert decode.block_m == 16 and prefill.block_m > decode.block_m
        fp32 = tm.get_moe_config(128, 2048, 768, 8, torch.float32, 8192, "cpu", tmp_path)
        assert fp32.gemm1.block_k <= 32 and fp32.gemm1.num_stages <= 3

    def test_malformed_table_raises(self, tmp_path):
        path = tmp_path / tm.config_file_name(8, 64, 32, torch.float16, "cpu")
        path.write_text(json.dumps({"configs": {"1": {"block_m": 16}}}))
        with pytest.raises(ValueError, match="malformed MoE config table"):
            tm.get_moe_config(8, 64, 32, 2, torch.float16, 1, "cpu", tmp_path)

    def test_shipped_tables_parse(self):
        for path in sorted(tm.CONFIG_DIR.glob("*.json")):
            configs, top_k = tm.load_config_table(path)
            assert configs and top_k, path.name
            assert all(c.block_m in (16, 32, 64, 128) for c in configs.values()), path.name


class TestTuner:
    @pytest.mark.parametrize("cfg,expected", [
        (dict(num_experts=128, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
              num_experts_per_tok=8, torch_dtype="bfloat16"), (128, 2048, 768, 8)),  # Qwen3-30B-A3B
        (dict(num_local_experts=8, hidden_size=4096, intermediate_size=14336, num_experts_per_tok=2),
         (8, 4096, 14336, 2)),  # Mixtral-8x7B
        (dict(n_routed_experts=256, hidden_size=7168, moe_intermediate_size=2048, intermediate_size=18432,
              num_experts_per_tok=8, torch_dtype="bfloat16"), (256, 7168, 2048, 8)),  # DeepSeek-V3
    ])
    def test_shape_from_hf_config(self, cfg, expected):
        s = tune_moe.shape_from_hf_config(cfg)
        assert (s.num_experts, s.hidden_size, s.inter, s.top_k) == expected and s.dtype == torch.bfloat16

    def test_dense_config_is_rejected(self):
        with pytest.raises(ValueError, match="no routed experts"):
            tune_moe.shape_from_hf_config(dict(hidden_size=4096, intermediate_size=14336))

    def test_parses_explicit_sizes_and_requires_them_without_preset(self, tmp_path):
        shape, sizes, out, _ = tune_moe.parse_args(
            "--num-experts 8 --hidden 4096 --intermediate 14336 --top-k 2 --dtype float16 --batch-sizes 4,1,4 "
            f"--out {tmp_path}".split())
        assert shape == tune_moe.MoeShape(8, 4096, 14336, 2, torch.float16) and sizes == [1, 4] and out == tmp_path
        with pytest.raises(SystemExit):
            tune_moe.parse_args(["--num-experts", "8"])
        with pytest.raises(ValueError, match="no preset 'nope'"):
            tune_moe.parse_args(["--preset", "nope"])

    def test_candidates_fit_shared_memory_and_registers(self):
        assert tune_moe.block_m_candidates(1, 8, 128) == [16]
        assert tune_moe.block_m_candidates(8192, 8, 128) == [16, 32, 64, 128]
        for block_m in (16, 128):
            tiles = tune_moe.tile_candidates(block_m, 512.0, 768, 2048, torch.bfloat16, gemm1=True)
            assert tiles
            for t in tiles:
                assert t.num_stages * (block_m * t.block_k + 2 * t.block_k * t.block_n) * 2 <= tune_moe.SMEM_BYTES
                assert block_m * t.block_n * 2 <= tune_moe.MAX_ACC_ELEMENTS


@pytest.mark.parametrize("name", ["moe_route", "moe_align_block_size", "fused_moe"])
def test_both_providers_expose_the_same_signature(name):
    from atom_core.kernels import torch_ref
    from atom_core.kernels import triton as tk

    params = lambda fn: [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]  # noqa: E731
    assert params(getattr(torch_ref, name)) == params(getattr(tk, name))


# ---------------------------------------------------------------------------------------------
# Triton kernels vs the reference


ROUTE_CASES = {  # name: (num_experts, top_k, moe_route kwargs, logits kind)
    "mixtral": (8, 2, dict(renormalize=True), "randn"),
    "qwen3_no_norm": (128, 8, dict(), "randn"),
    "top_k_is_all_non_pow2": (6, 6, dict(renormalize=True), "randn"),
    "ties": (16, 4, dict(renormalize=True), "ties"),
    "deepseek_v3_groups_bias": (32, 4, dict(scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
                                            routed_scaling_factor=2.5, bias=True), "randn"),
    "sigmoid_ties_and_masked_picks": (12, 5, dict(scoring="sigmoid", num_expert_group=6, topk_group=2), "ties"),
    "deepseek_v2_groups_of_20": (160, 6, dict(num_expert_group=8, topk_group=3, routed_scaling_factor=1.5), "randn"),
    "e512_k16": (512, 16, dict(scoring="sigmoid", bias=True), "randn"),
}


class TestRouteKernel:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", ROUTE_CASES)
    def test_matches_reference(self, device, name, dtype):
        num_experts, top_k, kwargs, kind = ROUTE_CASES[name]
        kwargs = dict(kwargs)
        num_tokens = 8192 if device == "cuda" else 5
        gen = seeded(name, str(dtype))
        # Logits and bias on a grid of 1/64 (exact in bf16): equal values tie exactly in both
        # providers, and distinct ones differ far beyond the ulps by which exp/sigmoid may differ.
        if kind == "ties":  # few distinct values: many ties, straddling the top-k cut
            logits = torch.randint(-2, 2, (num_tokens, num_experts), generator=gen).float()
        else:
            logits = (torch.randn(num_tokens, num_experts, generator=gen) * 96).round().clamp(-255, 255) / 64
        if kwargs.pop("bias", False):
            kwargs["correction_bias"] = (torch.randint(-8, 8, (num_experts,), generator=gen) / 64).to(device)
        logits = logits.to(dtype).to(device)
        ref_w, ref_ids = moe_ref.moe_route(logits, top_k, **kwargs)
        weights, ids = tm.moe_route(logits, top_k, **kwargs)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)

    def test_strided_logits(self, device):
        logits = torch.randn(7, 40, generator=seeded("strided")).to(device)[:, :32]
        ref = moe_ref.moe_route(logits, 3, renormalize=True)
        out = tm.moe_route(logits, 3, renormalize=True)
        assert torch.equal(out[1], ref[1])
        torch.testing.assert_close(out[0], ref[0])


ALIGN_CASES = [  # (num_tokens, top_k, num_experts, block_size); T*K > 1024 takes the multi-chunk path
    (1, 1, 1, 16), (1, 8, 128, 16), (13, 2, 8, 4), (37, 4, 16, 16), (300, 8, 64, 16), (129, 8, 160, 32),
]
ALIGN_CASES_GPU = [(8192, 8, 128, 64), (4096, 2, 8, 128), (256, 8, 512, 16), (8192, 8, 256, 128), (3000, 6, 64, 32)]


class TestAlignKernel:
    @pytest.mark.parametrize("case", ALIGN_CASES + [pytest.param(c, marks=pytest.mark.gpu) for c in ALIGN_CASES_GPU],
                             ids=lambda c: "T{}-K{}-E{}-bs{}".format(*c))
    def test_matches_reference_into_poisoned_buffers(self, device, case):
        num_tokens, top_k, num_experts, block_size = case
        if device == "cpu" and num_tokens > 1000:
            pytest.skip("GPU size")
        gen = seeded(case)
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
        ids[::7, 0] = -1  # dropped (expert parallel) slots
        ids[ids == num_experts // 2] = 0  # an expert no token picks
        ids = ids.to(device)
        ref_sorted, ref_experts, ref_post = moe_ref.moe_align_block_size(ids, block_size, num_experts)
        sorted_ids = torch.full_like(ref_sorted, -7)
        expert_ids = torch.full_like(ref_experts, -7)
        num_post = torch.full_like(ref_post, -7)
        tm.launch_moe_align(ids, block_size, num_experts, sorted_ids, expert_ids, num_post)
        n = int(ref_post)
        assert int(num_post) == n
        assert torch.equal(sorted_ids[:n], ref_sorted[:n])
        assert torch.equal(expert_ids, ref_experts)
        check_alignment(ids, block_size, num_experts, sorted_ids, expert_ids, num_post)


MOE_CASES = {  # (num_experts, top_k, hidden, inter, tokens)
    "small": (4, 2, 64, 48, 7),
    "odd_dims_bias": (5, 3, 72, 40, 19),
    "single_expert": (1, 1, 32, 16, 5),
    "many_experts": (16, 4, 64, 32, 33),
}
MOE_CASES_GPU = {
    "qwen3_30b_decode": (128, 8, 2048, 768, 1),
    "qwen3_30b_b7": (128, 8, 2048, 768, 7),
    "qwen3_30b_b64": (128, 8, 2048, 768, 64),
    "qwen3_30b_b257": (128, 8, 2048, 768, 257),
    "qwen3_30b_prefill": (128, 8, 2048, 768, 8192),
    "mixtral_decode": (8, 2, 4096, 14336, 1),
    "mixtral_b33": (8, 2, 4096, 14336, 33),
    "mixtral_prefill": (8, 2, 4096, 14336, 4096),
    "deepseek_v2_lite": (64, 6, 2048, 1408, 1000),
    "odd_dims_bias_large": (20, 3, 200, 72, 500),
}
SMALL_TILES = tm.MoeConfig(16, tm.GemmTile(32, 32, 2, 4, 2), tm.GemmTile(32, 32, 2, 4, 2))  # multi-step K loops


class TestFusedMoeKernel:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", list(MOE_CASES) + [pytest.param(n, marks=pytest.mark.gpu) for n in MOE_CASES_GPU])
    def test_matches_reference(self, device, name, dtype):
        case = MOE_CASES.get(name) or MOE_CASES_GPU[name]
        if device == "cpu" and name not in MOE_CASES:
            pytest.skip("GPU size")
        if dtype == torch.float32 and case[3] > 4096:
            pytest.skip("fp32 Mixtral weights: 2.8 GB for no new coverage")
        args = make_moe_inputs(*case[4:], *case[:4], dtype=dtype, device=device, seed=zlib.crc32(name.encode()),
                               bias="bias" in name)
        ref = moe_ref.fused_moe(**args)
        configs = [None, SMALL_TILES] if name in MOE_CASES else [None]
        for config in configs:  # None: the table or the defaults
            out = torch.full_like(args["hidden"], float("nan"))
            tm.launch_fused_moe(**args, config=config, out=out)
            assert rel_err(out, ref) < TOL[dtype], f"config {config}"

    @pytest.mark.parametrize("block_m", [16, 32, 64])
    def test_every_stage_writes_the_rows_it_owns(self, device, block_m):
        """Stage by stage into NaN buffers: GEMM2 must read only rows GEMM1 wrote, the sum only
        rows GEMM2 wrote; a missed row shows up as NaN in the output."""
        args = make_moe_inputs(9, 4, 3, 32, 24, torch.float32, device, seed=block_m)
        num_tokens, top_k = args["topk_ids"].shape
        sorted_ids, expert_ids, num_post = tm.moe_align_block_size(args["topk_ids"], block_m, 4)
        act = torch.full((sorted_ids.shape[0], 24), float("nan"), device=device)
        tile = tm.GemmTile(16, 16, 1, 4, 2)
        tm.moe_gemm1(args["hidden"], args["w13"], None, sorted_ids, expert_ids, num_post, top_k, block_m, tile, act)
        assert not act[:int(num_post)].isnan().any()
        partial = torch.full((num_tokens * top_k, 32), float("nan"), device=device)
        tm.moe_gemm2(act, args["w2"], None, args["topk_weights"], sorted_ids, expert_ids, num_post, block_m, tile,
                     partial)
        dropped = ~((args["topk_ids"] >= 0) & (args["topk_ids"] < 4)).flatten()
        assert dropped.any() and partial[dropped].isnan().all() and not partial[~dropped].isnan().any()
        out = tm.moe_sum(partial, args["topk_ids"], 4, torch.full_like(args["hidden"], float("nan")))
        assert rel_err(out, moe_ref.fused_moe(**args)) < TOL[torch.float32]

    def test_public_entry_point_int64_ids_and_empty_batch(self, device):
        args = make_moe_inputs(6, 4, 2, 32, 16, torch.bfloat16, device, seed=1)
        out = tm.fused_moe(**args)
        assert rel_err(out, moe_ref.fused_moe(**args)) < TOL[torch.bfloat16]
        assert torch.equal(tm.fused_moe(**(args | {"topk_ids": args["topk_ids"].long()})), out)  # e.g. torch.topk's ids
        empty = {k: (v[:0] if k in ("hidden", "topk_weights", "topk_ids") else v) for k, v in args.items()}
        assert tm.fused_moe(**empty).shape == (0, 32)

    def test_rejects_bad_arguments(self, device):
        args = make_moe_inputs(3, 4, 2, 32, 16, torch.float32, device, seed=2)
        with pytest.raises(ValueError, match="expected one of: silu"):
            tm.fused_moe(**args, activation="gelu")
        with pytest.raises(ValueError, match="w13"):
            tm.fused_moe(**(args | {"w13": args["w13"][:, :20]}))
        with pytest.raises(ValueError, match="topk_weights must be float32"):
            tm.fused_moe(**(args | {"topk_weights": args["topk_weights"].half()}))

    def test_compiles_as_opaque_ops(self, device):
        """fullgraph: Dynamo must not trace into the Triton launches, only into the fake impls."""
        args = make_moe_inputs(5, 4, 2, 32, 16, torch.float32, device, seed=4)
        logits = torch.randn(5, 4, generator=seeded("compile")).to(device)

        def layer(x, router_logits):
            weights, ids = tm.moe_route(router_logits, 2, renormalize=True)
            return tm.fused_moe(x, args["w13"], args["w2"], weights, ids)

        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(args["hidden"], logits), layer(args["hidden"], logits))
        torch.library.opcheck(tm.fused_moe_op, (args["hidden"], args["w13"], args["w2"], args["topk_weights"],
                                                args["topk_ids"]), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_fused_moe_replays_in_cuda_graph():
    """Route + fused_moe captured once and replayed on new inputs: proves no host sync, and that
    the static grids cover whatever routing the new inputs produce."""
    args = make_moe_inputs(64, 128, 8, 2048, 768, torch.bfloat16, "cuda", seed=7)
    x = args["hidden"].clone()
    logits = torch.randn(64, 128, generator=seeded("graph")).cuda()

    def step():
        weights, ids = tm.moe_route(logits, 8, renormalize=True)
        return tm.fused_moe(x, args["w13"], args["w2"], weights, ids)

    step()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        gen = seeded("replay", seed)
        logits.copy_(torch.randn(64, 128, generator=gen) * (1 + 4 * seed))  # later rounds: skewed routing
        x.copy_(torch.randn(64, 2048, generator=gen).to(torch.bfloat16))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)  # deterministic pipeline: same bits
