"""Does this GPU's Triton get the first chunked gated-delta kernels' state update right?

    python -m benchmarks.kernels.gdn_transpose_dot_probe

That kernel (replaced; see kernels/triton/gated_delta.py's docstring) updated its state with
tl.dot(tl.trans(k_tail), v_new): k_tail a [64, K] tile in registers, v_new = u - w @ s a dot result. On the
H200 (Triton 3.6) it gave wrong outputs at every key width from 64 up and was right at 16. At 16 that dot is
too small for a warpgroup MMA and Triton emits mma.sync; from 64 up it is a wgmma whose left operand is the
register transpose, stored to a column-major shared tile and read back with ldmatrix.trans. This runs that
step alone (bf16, 4 warps) for K = 16, 64 and 128 and prints its relative error against torch; exit status 1
if it is wrong at any K. The current kernels compile to no ldmatrix.trans at all (test_gdn_triton.py's sm_90
compile test checks that), and their own GPU tests check them stage by stage.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

BT, BV = 64, 32


@triton.jit
def _state_update_kernel(k_ptr, w_ptr, s_ptr, u_ptr, out_ptr, K: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """out = (k * decay)^T (u - w s): k, w [BT, K] and u [BT, BV] in the dot dtype, s [K, BV] fp32; out
    [K, BV] fp32."""
    DT = k_ptr.dtype.element_ty
    rows, kc, vc = tl.arange(0, BT), tl.arange(0, K), tl.arange(0, BV)
    w = tl.load(w_ptr + rows[:, None] * K + kc[None, :])
    s = tl.load(s_ptr + kc[:, None] * BV + vc[None, :])
    u = tl.load(u_ptr + rows[:, None] * BV + vc[None, :]).to(tl.float32)
    v_new = (u - tl.dot(w, s.to(DT))).to(DT)
    k_tail = tl.load(k_ptr + rows[:, None] * K + kc[None, :]).to(tl.float32) * tl.exp(-0.01 * rows)[:, None]
    tl.store(out_ptr + kc[:, None] * BV + vc[None, :], tl.dot(tl.trans(k_tail).to(DT), v_new))


def probe(k_dim: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> float:
    """Relative L2 error of the kernel's update against torch on the same rounded operands. (Triton's
    interpreter has no working bf16 dot: there, dtype=float32 checks the indexing.)"""
    gen = torch.Generator().manual_seed(k_dim)
    k, w = (torch.randn(BT, k_dim, generator=gen).to(dtype) for _ in range(2))
    s = torch.randn(k_dim, BV, generator=gen) * 0.1
    u = torch.randn(BT, BV, generator=gen).to(dtype)
    out = torch.empty(k_dim, BV, device=device)
    _state_update_kernel[(1,)](*(t.to(device) for t in (k, w, s, u)), out, K=k_dim, BT=BT, BV=BV, num_warps=4)
    v_new = (u.float() - w.float() @ s.to(dtype).float()).to(dtype).float()
    decay = torch.exp(-0.01 * torch.arange(BT, dtype=torch.float32))
    want = (k.float() * decay[:, None]).to(dtype).float().t() @ v_new
    return ((out.cpu() - want).norm() / want.norm()).item()


def main() -> int:
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}: (k decay)^T (u - w s) as the first "
          "chunk kernels computed it, relative error against torch")
    errors = {}
    for k_dim in (16, 64, 128):
        errors[k_dim] = probe(k_dim)
        print(f"K={k_dim:4d}  {errors[k_dim]:.3e}", flush=True)
    return 1 if max(errors.values()) > 1e-2 else 0


if __name__ == "__main__":
    sys.exit(main())
