"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) in plain PyTorch: the CPU path and the
oracle for `kernels/triton/gated_delta.py`, `causal_conv1d.py` and the gated norm in `norm.py`.

Sequences are packed flat: sequence i owns tokens cu_seqlens[i]:cu_seqlens[i+1]. Recurrent and
conv states live in pools indexed by per-sequence slots (state_indices, like block tables). A
sequence starts from zeros when has_initial_state[i] is False, else from its slot; every op writes
the final state back into the slot. A sequence with zero tokens leaves its slot untouched, and a
negative slot (padding in a captured batch) runs from zeros and writes nothing back.

Speculative verify steps also keep the state after each of a sequence's first P tokens (the recurrent
rule and the conv take `step_state` [rows, P, ...] and `step_indices` [N], a row per sequence, -1 for
none): after the target verifies 1 + K tokens, the state after the accepted ones is one of them
(kv_spec.keep_verified_states copies it into the slot).

Shapes: T tokens, N sequences, Hk q/k heads, Hv v heads (Hv % Hk == 0; q/k head j serves v heads
j*(Hv//Hk) .. (j+1)*(Hv//Hk)-1), Dk, Dv head dims, C conv channels, W conv width.
Per v head, in fp32:  S <- S * exp(g_t);  u = (v_t - S^T k_t) * beta_t;  S <- S + k_t u^T;
o_t = S^T (q_t * scale), with q, k l2-normalised first (eps 1e-6) when use_qk_l2norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as HF's (and FLA's) l2norm."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def check_gdn_inputs(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state) -> None:
    """Shapes and dtypes shared by both gated-delta-rule ops (the Triton ones call it too)."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, Hk, Dk], "
                         f"v {tuple(v.shape)} [T, Hv, Dv]")
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"v heads {num_v_heads} must be a multiple of q/k heads {num_k_heads}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (num_tokens, num_v_heads):
            raise ValueError(f"{name} {tuple(t.shape)} must be [T, Hv] = {(num_tokens, num_v_heads)}")
    if g.dtype != torch.float32:
        raise ValueError(f"g must be float32 log-decay, got {g.dtype}")
    if state.dim() != 4 or state.shape[1:] != (num_v_heads, k_dim, v_dim) or state.dtype != torch.float32:
        raise ValueError(f"state {tuple(state.shape)} {state.dtype} must be a float32 "
                         f"[num_slots, {num_v_heads}, {k_dim}, {v_dim}] pool")
    check_seq_meta(state_indices, cu_seqlens, has_initial_state, num_tokens)


def check_step_states(step_state, step_indices, state_indices, state_shape) -> None:
    """step_state [rows, P, *state_shape] and step_indices [N] come together (or neither)."""
    if (step_state is None) != (step_indices is None):
        raise ValueError("step_state and step_indices come together")
    if step_state is None:
        return
    if step_state.dim() != 2 + len(state_shape) or tuple(step_state.shape[2:]) != tuple(state_shape):
        raise ValueError(f"step_state {tuple(step_state.shape)} must be [rows, P, {', '.join(map(str, state_shape))}]")
    if step_indices.shape != state_indices.shape or step_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"step_indices {tuple(step_indices.shape)} {step_indices.dtype} must be int [N] like "
                         f"state_indices {tuple(state_indices.shape)}")


def check_seq_meta(state_indices, cu_seqlens, has_initial_state, num_tokens: int) -> None:
    num_seqs = state_indices.shape[0]
    if state_indices.dim() != 1 or cu_seqlens.shape != (num_seqs + 1,) or has_initial_state.shape != (num_seqs,):
        raise ValueError(f"state_indices {tuple(state_indices.shape)}, cu_seqlens {tuple(cu_seqlens.shape)} and "
                         f"has_initial_state {tuple(has_initial_state.shape)} must be [N], [N + 1], [N]")
    if has_initial_state.dtype != torch.bool:
        raise ValueError(f"has_initial_state must be bool, got {has_initial_state.dtype}")
    for name, t in (("state_indices", state_indices), ("cu_seqlens", cu_seqlens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    del num_tokens  # cu_seqlens[-1] <= T is the caller's contract: checking it would sync the device


def _sequences(state_indices, cu_seqlens, has_initial_state):
    """(index, start, end, slot, starts_from_slot) per sequence that has tokens."""
    bounds, slots, has_init = cu_seqlens.tolist(), state_indices.tolist(), has_initial_state.tolist()
    for i, slot in enumerate(slots):
        if bounds[i + 1] > bounds[i]:
            yield i, bounds[i], bounds[i + 1], slot, has_init[i] and slot >= 0


def _prepare(q, k, v, g, beta, start, end, scale, use_qk_l2norm):
    """fp32 per-v-head views of one sequence: q*scale, k [Hv, L, Dk], v [Hv, L, Dv], g, beta [Hv, L]."""
    group = v.shape[1] // q.shape[1]
    qs, ks = (x[start:end].float() for x in (q, k))
    if use_qk_l2norm:
        qs, ks = l2norm(qs), l2norm(ks)
    qs, ks = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (qs * scale, ks))
    vs = v[start:end].float().transpose(0, 1)
    return qs, ks, vs, g[start:end].float().t(), beta[start:end].float().t()


def _initial_state(state, slot, from_slot):
    return state[slot].clone() if from_slot else state.new_zeros(state.shape[1:])


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] float32 log-decay
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    state_indices: torch.Tensor,  # [N] int
    cu_seqlens: torch.Tensor,  # [N + 1] int
    has_initial_state: torch.Tensor,  # [N] bool
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    step_state: torch.Tensor | None = None,  # [rows, P, Hv, Dk, Dv] float32: the state after token t < P
    step_indices: torch.Tensor | None = None,  # [N] int: each sequence's row in step_state (-1: none)
) -> torch.Tensor:
    """The gated delta rule token by token; returns o [T, Hv, Dv] in v's dtype (rows outside every
    sequence are zero)."""
    check_gdn_inputs(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state)
    check_step_states(step_state, step_indices, state_indices, state.shape[1:])
    step_rows = step_indices.tolist() if step_state is not None else None
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for i, start, end, slot, from_slot in _sequences(state_indices, cu_seqlens, has_initial_state):
        qs, ks, vs, gs, bs = _prepare(q, k, v, g, beta, start, end, scale, use_qk_l2norm)
        s = _initial_state(state, slot, from_slot)  # [Hv, Dk, Dv]
        for t in range(end - start):
            s = s * gs[:, t].exp()[:, None, None]
            u = (vs[:, t] - torch.einsum("hkv,hk->hv", s, ks[:, t])) * bs[:, t, None]
            s = s + ks[:, t, :, None] * u[:, None, :]
            out[start + t] = torch.einsum("hkv,hk->hv", s, qs[:, t])
            if step_rows is not None and step_rows[i] >= 0 and t < step_state.shape[1]:
                step_state[step_rows[i], t] = s
        if slot >= 0:
            state[slot] = s
    return out.to(v.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """The same result as fused_recurrent_gated_delta_rule, computed chunk by chunk (CHUNK_SIZE
    tokens from each sequence's start) in the WY / UT form the Triton kernel uses."""
    check_gdn_inputs(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state)
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for _, start, end, slot, from_slot in _sequences(state_indices, cu_seqlens, has_initial_state):
        qs, ks, vs, gs, bs = _prepare(q, k, v, g, beta, start, end, scale, use_qk_l2norm)
        s = _initial_state(state, slot, from_slot)
        for c in range(0, end - start, CHUNK_SIZE):
            chunk = slice(c, min(c + CHUNK_SIZE, end - start))
            o, s = _chunk_step(qs[:, chunk], ks[:, chunk], vs[:, chunk], gs[:, chunk], bs[:, chunk], s)
            out[start + c:start + c + o.shape[1]] = o.transpose(0, 1)
        if slot >= 0:
            state[slot] = s
    return out.to(v.dtype)


def _chunk_step(q, k, v, g, beta, s):
    """One chunk of L tokens for every head: q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L], s [H, Dk, Dv].

    With G the cumulative log-decay inside the chunk, the chunk's L delta-rule updates collapse to
    (I + A) U = beta*v - beta*exp(G)*k S, A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i
    (the UT transform); T = (I + A)^-1 gives W = T (beta exp(G) k) and U = T (beta v), so that
    v_new = U - W S, o = exp(G) q S + tril(q k^T exp(G_i - G_j)) v_new and
    S' = exp(G_L) S + (exp(G_L - G) k)^T v_new.
    """
    length = q.shape[1]
    cum = g.cumsum(-1)  # [H, L]
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(
        torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1), float("-inf")).exp()
    a = (beta[:, :, None] * (k @ k.transpose(1, 2)) * decay).tril(-1)
    w, u = (torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # the diagonal is read as 1
            for rhs in (k * (beta * cum.exp())[:, :, None], v * beta[:, :, None]))
    v_new = u - w @ s
    o = (q * cum.exp()[:, :, None]) @ s + ((q @ k.transpose(1, 2)) * decay) @ v_new
    s = s * cum[:, -1].exp()[:, None, None] + (k * (cum[:, -1:] - cum).exp()[:, :, None]).transpose(1, 2) @ v_new
    return o, s


def causal_conv1d(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, W]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1] in x's dtype, updated in place
    state_indices: torch.Tensor,  # [N] int
    cu_seqlens: torch.Tensor,  # [N + 1] int
    has_initial_state: torch.Tensor,  # [N] bool
    activation: str | None = "silu",
    step_state: torch.Tensor | None = None,  # [rows, P, C, W - 1]: the state after token t < P
    step_indices: torch.Tensor | None = None,  # [N] int: each sequence's row in step_state (-1: none)
) -> torch.Tensor:
    """Depthwise causal conv over each sequence, continuing from the last W-1 inputs in its conv
    state; y[t, c] = act(bias[c] + sum_w weight[c, w] * x[t - W + 1 + w, c]) in fp32, cast to
    x's dtype. The state gets the sequence's last W-1 inputs (older state where it is shorter)."""
    check_conv_inputs(x, weight, bias, conv_state, state_indices, cu_seqlens, has_initial_state, activation)
    check_step_states(step_state, step_indices, state_indices, conv_state.shape[1:])
    step_rows = step_indices.tolist() if step_state is not None else None
    out = torch.zeros_like(x)
    width = weight.shape[1]
    for i, start, end, slot, from_slot in _sequences(state_indices, cu_seqlens, has_initial_state):
        prev = conv_state[slot] if from_slot else conv_state.new_zeros(conv_state.shape[1:])
        xs = torch.cat([prev, x[start:end].t()], dim=1)  # [C, W - 1 + L]
        y = F.conv1d(xs.float()[None], weight.float()[:, None], None if bias is None else bias.float(),
                     groups=x.shape[1])[0]
        out[start:end] = (F.silu(y) if activation == "silu" else y).t().to(x.dtype)
        if step_rows is not None and step_rows[i] >= 0:
            for t in range(min(end - start, step_state.shape[1])):  # inputs up to token t: xs[:, :W - 1 + t + 1]
                step_state[step_rows[i], t] = xs[:, t + 1:t + width]
        if slot >= 0:
            conv_state[slot] = xs[:, xs.shape[1] - (width - 1):]
    return out


def check_conv_inputs(x, weight, bias, conv_state, state_indices, cu_seqlens, has_initial_state, activation) -> None:
    if activation not in ("silu", None):
        raise ValueError(f"unknown conv activation {activation!r}; expected one of: 'silu', None")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"x {tuple(x.shape)} must be [T, C] and weight {tuple(weight.shape)} [C, W] with W >= 2")
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [C] = [{x.shape[1]}]")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (x.shape[1], weight.shape[1] - 1):
        raise ValueError(f"conv_state {tuple(conv_state.shape)} must be "
                         f"[num_slots, {x.shape[1]}, {weight.shape[1] - 1}]")
    if conv_state.dtype != x.dtype:
        raise ValueError(f"conv_state dtype {conv_state.dtype} must be x's {x.dtype}")
    check_seq_meta(state_indices, cu_seqlens, has_initial_state, x.shape[0])


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3NextRMSNormGated: (weight * rms_normalise(x) in x's dtype) * silu(z) in fp32, cast
    to x's dtype. x, z [..., D]; weight [D]."""
    if z.shape != x.shape or weight.shape != (x.shape[-1],):
        raise ValueError(f"z {tuple(z.shape)} must match x {tuple(x.shape)} and weight {tuple(weight.shape)} be [D]")
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * xf.to(x.dtype)) * F.silu(z.float())).to(x.dtype)
