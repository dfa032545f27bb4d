"""Depthwise causal conv1d with a per-sequence state (the short conv of gated DeltaNet), Triton.
Same signature and semantics as `kernels.gdn_ref.causal_conv1d`.

Every output row depends only on W inputs, so `_causal_conv1d_kernel` runs all tokens of the flat
batch at once (a tile of tokens x channels per program; each row finds its sequence through a
token -> sequence map built on the device), reading the W-1 inputs before a sequence's first token
from its conv state. `_conv_state_kernel` then writes each sequence's last W-1 inputs into its slot:
a second launch, so no program overwrites a state another is still reading. Grids follow from shapes
and nothing syncs the host, so decode (one token a sequence) is the same call and CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.gdn_ref import check_conv_inputs, check_step_states
from atom_core.kernels.triton.common import check_last_dim_contiguous, check_same_device, next_pow2


@triton.jit(do_not_specialize=["num_tokens", "num_seqs"])
def _causal_conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, y_ptr, seq_of_ptr, cu_ptr, idx_ptr, has_init_ptr, num_tokens, num_seqs,
    stride_xt, stride_yt, stride_ss, stride_sc, channels,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    col_ok = cols < channels
    seq = tl.load(seq_of_ptr + rows, mask=rows < num_tokens, other=num_seqs)
    in_seq = seq < num_seqs  # rows past cu_seqlens[-1] (padding) get zeros
    start = tl.load(cu_ptr + seq, mask=in_seq, other=0)
    slot = tl.load(idx_ptr + seq, mask=in_seq, other=-1)
    from_slot = in_seq & (tl.load(has_init_ptr + seq, mask=in_seq, other=0).to(tl.int32) != 0) & (slot >= 0)
    pos = rows - start  # position inside the sequence
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(WIDTH):
        rel = pos - (WIDTH - 1) + j  # input position this tap reads; negative ones are in the state
        ok = in_seq[:, None] & col_ok[None, :]
        xv = tl.load(x_ptr + (rows + j - (WIDTH - 1)).to(tl.int64)[:, None] * stride_xt + cols[None, :],
                     mask=ok & (rel >= 0)[:, None], other=0.0)
        sv = tl.load(state_ptr + slot.to(tl.int64)[:, None] * stride_ss + cols[None, :] * stride_sc
                     + (WIDTH - 1 + rel)[:, None], mask=ok & ((rel < 0) & from_slot)[:, None], other=0.0)
        w = tl.load(w_ptr + cols * WIDTH + j, mask=col_ok, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(in_seq[:, None], acc, 0.0)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_yt + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows < num_tokens)[:, None] & col_ok[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, cu_ptr, idx_ptr, has_init_ptr, stride_xt, stride_ss, stride_sc, channels,
    STATE_LEN: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    bos = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - bos
    slot = tl.load(idx_ptr + seq)
    if (length == 0) | (slot < 0):
        return
    from_slot = tl.load(has_init_ptr + seq).to(tl.int32) != 0
    j = tl.arange(0, BS)
    rel = length - STATE_LEN + j  # sequence position of the input that lands in state column j
    ok = (cols < channels)[:, None] & (j < STATE_LEN)[None, :]
    base = state_ptr + slot.to(tl.int64) * stride_ss + cols[:, None] * stride_sc
    xv = tl.load(x_ptr + (bos + rel).to(tl.int64)[None, :] * stride_xt + cols[:, None],
                 mask=ok & (rel >= 0)[None, :], other=0.0)
    # An older input still in the window (sequences shorter than the state) moves left by `length`.
    sv = tl.load(base + (j + length)[None, :], mask=tl.where(from_slot, ok & (rel < 0)[None, :], False), other=0.0)
    # The store overwrites columns other threads of this program read above: every read first.
    tl.debug_barrier()
    tl.store(base + j[None, :], tl.where((rel >= 0)[None, :], xv, sv), mask=ok)


@triton.jit
def _conv_step_states_kernel(
    x_ptr, state_ptr, step_ptr, cu_ptr, idx_ptr, has_init_ptr, step_idx_ptr, stride_xt, stride_ss, stride_sc,
    stride_pr, stride_pp, stride_pc, channels, STATE_LEN: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr,
):
    """Verify steps: the conv state after token p of each sequence (program axis 2), i.e. what
    _conv_state_kernel would write for the sequence cut after p + 1 tokens, into its step row.
    It reads the slot's old state, so it runs before _conv_state_kernel overwrites it."""
    seq, step = tl.program_id(0), tl.program_id(2)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    bos = tl.load(cu_ptr + seq)
    length = tl.minimum(tl.load(cu_ptr + seq + 1) - bos, step + 1)
    row = tl.load(step_idx_ptr + seq)
    if (step >= tl.load(cu_ptr + seq + 1) - bos) | (row < 0):
        return
    slot = tl.load(idx_ptr + seq)
    from_slot = (tl.load(has_init_ptr + seq).to(tl.int32) != 0) & (slot >= 0)
    j = tl.arange(0, BS)
    rel = length - STATE_LEN + j
    ok = (cols < channels)[:, None] & (j < STATE_LEN)[None, :]
    xv = tl.load(x_ptr + (bos + rel).to(tl.int64)[None, :] * stride_xt + cols[:, None],
                 mask=ok & (rel >= 0)[None, :], other=0.0)
    old = state_ptr + slot.to(tl.int64) * stride_ss + cols[:, None] * stride_sc
    sv = tl.load(old + (j + length)[None, :], mask=tl.where(from_slot, ok & (rel < 0)[None, :], False), other=0.0)
    out = step_ptr + row.to(tl.int64) * stride_pr + step * stride_pp + cols[:, None] * stride_pc
    tl.store(out + j[None, :], tl.where((rel >= 0)[None, :], xv, sv), mask=ok)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    state_indices: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    activation: str | None = "silu", step_state: torch.Tensor | None = None, step_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [T, C] in x's dtype; conv_state updated in place (and step_state, in verify steps). See
    kernels.gdn_ref.causal_conv1d."""
    check_conv_inputs(x, weight, bias, conv_state, state_indices, cu_seqlens, has_initial_state, activation)
    check_step_states(step_state, step_indices, state_indices, conv_state.shape[1:])
    if step_state is not None and (step_state.stride(3) != 1 or step_state.device != conv_state.device):
        raise ValueError(f"step_state needs a contiguous last dim on {conv_state.device}, got strides "
                         f"{step_state.stride()} on {step_state.device}")
    check_last_dim_contiguous("x", x)
    if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        raise ValueError("weight and bias must be contiguous")
    if conv_state.stride(2) != 1:
        raise ValueError(f"conv_state needs a contiguous last dim, got strides {conv_state.stride()}")
    check_same_device(x=x, weight=weight, conv_state=conv_state, state_indices=state_indices,
                      cu_seqlens=cu_seqlens, has_initial_state=has_initial_state)
    num_tokens, channels = x.shape
    num_seqs = state_indices.shape[0]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return y
    width = weight.shape[1]
    # seq_of[t] = the sequence that owns row t; num_seqs for rows past cu_seqlens[-1].
    seq_of = (torch.searchsorted(cu_seqlens, torch.arange(num_tokens, device=x.device, dtype=cu_seqlens.dtype),
                                 right=True) - 1).to(torch.int32)
    block_t, block_c = 16, min(128, next_pow2(channels))
    _causal_conv1d_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))](
        x, weight, bias, conv_state, y, seq_of, cu_seqlens, state_indices, has_initial_state, num_tokens, num_seqs,
        x.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1), channels,
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu", BT=block_t, BC=block_c, num_warps=4,
    )
    if num_seqs and step_state is not None and step_state.shape[1]:
        _conv_step_states_kernel[(num_seqs, triton.cdiv(channels, block_c), step_state.shape[1])](
            x, conv_state, step_state, cu_seqlens, state_indices, has_initial_state, step_indices, x.stride(0),
            conv_state.stride(0), conv_state.stride(1), step_state.stride(0), step_state.stride(1),
            step_state.stride(2), channels, STATE_LEN=width - 1, BS=next_pow2(width - 1), BC=block_c, num_warps=4,
        )
    if num_seqs:
        _conv_state_kernel[(num_seqs, triton.cdiv(channels, block_c))](
            x, conv_state, cu_seqlens, state_indices, has_initial_state, x.stride(0), conv_state.stride(0),
            conv_state.stride(1), channels, STATE_LEN=width - 1, BS=next_pow2(width - 1), BC=block_c, num_warps=4,
        )
    return y
