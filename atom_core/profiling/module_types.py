"""Module types of the summary sheet: which kind of work a (module, kernel) pair is.

First rule that matches wins (module = the module range name, leaf = its last component):

0. vision encoder: the module path runs through a vision tower or its projector (a component named
   visual, vision_tower, vision_model, mm_projector or multi_modal_projector): all of an image's
   encoding, whatever its kernels, so a multimodal prefill shows the encoder as its own module.
1. communication: kernel or module name mentions nccl/rccl, all_reduce, all_gather,
   reduce_scatter, all_to_all or a custom all-reduce.
2. norms: the leaf contains `norm` (input_layernorm, q_norm, ...) or the kernel is an
   RMSNorm/LayerNorm kernel, including Inductor's fused RMSNorm (`triton_..._mean_..._rsqrt_N`).
3. GEMMs: the leaf is a projection: ends in `proj`, or is lm_head, gate, router, dense,
   fc1, fc2, c_attn, c_fc.
4. attention: the kernel is an attention/rope/KV-cache kernel (attn, attention, flash, paged,
   fmha, rotary, rope, reshape_and_cache, kv_cache), or the module path has a component
   with `attn`/`attention` in it or named rotary_emb.
5. MLP/MoE: the kernel is a MoE/activation kernel (moe, expert, silu, gelu, act_and_mul,
   topk), or the module path has mlp, moe, expert, ffn, feed_forward or act_fn in it.
6. GEMMs: the kernel is a matmul or matrix-vector product (gemm, gemv, matmul, cutlass,
   cublas, nvjet, xmma, wgmma, aten::mm/addmm/bmm/linear).
7. other: everything else (embedding, sampler, copies, `<no module>`, `<cuda graph>`).
"""
from __future__ import annotations

import re
from typing import Literal

ModuleType = Literal["attention", "MLP/MoE", "norms", "GEMMs", "communication", "vision encoder", "other"]
MODULE_TYPES: tuple[ModuleType, ...] = ("attention", "MLP/MoE", "norms", "GEMMs", "communication", "vision encoder",
                                        "other")

_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|mm_projector|multi_modal_projector)(\.|$)")

_COMM = re.compile(r"nccl|rccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|custom_?ar\b", re.I)
# Inductor names its fused RMSNorm by the ops inside: triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0
_NORM_KERNEL = re.compile(r"rms_?norm|layer_?norm|^triton_\w*_mean_\w*_rsqrt", re.I)
_PROJ_LEAF = re.compile(r"(proj|^lm_head|^gate|^router|^dense|^fc[12]|^c_attn|^c_fc)$")
_ATTN_KERNEL = re.compile(r"attn|attention|flash|paged|fmha|rotary|rope|reshape_and_cache|kv_cache", re.I)
_ATTN_MODULE = re.compile(r"(^|\.)(\w*attn\w*|\w*attention\w*|rotary_emb)(\.|$)")
_MLP_KERNEL = re.compile(r"moe|expert|silu|gelu|act_and_mul|topk", re.I)
_MLP_MODULE = re.compile(r"mlp|moe|expert|ffn|feed_forward|act_fn")
_GEMM_KERNEL = re.compile(r"gemm|gemv|matmul|cutlass|cublas|nvjet|xmma|wgmma|aten::(mm|addmm|bmm|linear)$", re.I)


def module_type(module: str, kernel: str) -> ModuleType:
    """The summary bucket of one kernel row (rules in the module doc)."""
    leaf = module.rsplit(".", 1)[-1]
    if _VISION.search(module):
        return "vision encoder"
    if _COMM.search(kernel) or _COMM.search(module):
        return "communication"
    if "norm" in leaf or _NORM_KERNEL.search(kernel):
        return "norms"
    if _PROJ_LEAF.search(leaf):
        return "GEMMs"
    if _ATTN_KERNEL.search(kernel) or _ATTN_MODULE.search(module):
        return "attention"
    if _MLP_KERNEL.search(kernel) or _MLP_MODULE.search(module):
        return "MLP/MoE"
    if _GEMM_KERNEL.search(kernel):
        return "GEMMs"
    return "other"
