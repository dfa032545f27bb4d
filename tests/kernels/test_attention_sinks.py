"""Sliding windows and attention sinks in the torch reference paged attention (the CPU path),
against a dense per-sequence computation written the way HF's GPT-OSS eager attention is."""
import pytest
import torch

from atom_core.kernels import torch_ref


def _dense(q, k, v, q_positions, scale, window, sinks):
    """q [q_len, H, D], k/v [L, KH, D]: HF-style: mask, concat the sink column, softmax, drop it."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, q_len, L]
    kp = torch.arange(k.shape[1])[None, :]
    qp = q_positions[:, None]
    mask = kp > qp
    if window is not None:
        mask |= kp <= qp - window
    scores = scores.masked_fill(mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return (probs @ v).transpose(0, 1)


# (context already cached, new query tokens) per sequence: prefill, chunk with context, decodes
SEQS = [(0, 13), (9, 6), (20, 1), (3, 1), (31, 1), (0, 1)]


@pytest.mark.parametrize("window", [None, 1, 8, 128])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_windows_and_sinks(window, with_sinks):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block, num_blocks = 4, 2, 16, 4, 64
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g)
    lens = [c + n for c, n in SEQS]
    max_blocks = max((n + block - 1) // block for n in lens)
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = perm[: len(SEQS) * max_blocks].view(len(SEQS), max_blocks).int()
    qsl = torch.tensor([0] + [n for _, n in SEQS]).cumsum(0).int()
    query = torch.randn(int(qsl[-1]), heads, dim, generator=g)
    sinks = torch.randn(heads, generator=g) * 2 if with_sinks else None
    scale = dim**-0.5
    out = torch_ref.paged_attention(query, k_cache, v_cache, block_tables, qsl, torch.tensor(lens).int(), scale,
                                    max(n for _, n in SEQS), max(lens), sliding_window=window, sinks=sinks)
    for s, (ctx, n) in enumerate(SEQS):
        seq_len = ctx + n
        blocks = block_tables[s, : (seq_len + block - 1) // block].long()
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:seq_len]
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        expected = _dense(query[rows], k, v, torch.arange(ctx, seq_len), scale, window, sinks)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


def test_window_changes_the_result_and_sinks_damp_it():
    """The cases above are not vacuous: window 1 differs from full attention, and a large sink
    pulls every output toward 0 (its probability mass carries no value)."""
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(8, 4, 1, 8, generator=g)
    v_cache = torch.randn(8, 4, 1, 8, generator=g)
    tables = torch.arange(8).view(1, 8).int()
    q = torch.randn(10, 2, 8, generator=g)
    args = (q, k_cache, v_cache, tables, torch.tensor([0, 10]).int(), torch.tensor([10]).int(), 0.3, 10, 10)
    full = torch_ref.paged_attention(*args)
    assert not torch.allclose(full, torch_ref.paged_attention(*args, sliding_window=1))
    damped = torch_ref.paged_attention(*args, sinks=torch.full((2,), 30.0))
    assert damped.abs().max() < 1e-6 * full.abs().max() + 1e-9


def _case(device, seqs, dtype, block=4, heads=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in seqs]
    max_blocks = max((n + block - 1) // block for n in lens)
    num_blocks = len(seqs) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(seqs) * max_blocks].view(len(seqs), max_blocks).int()
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).int()
    query = torch.randn(int(qsl[-1]), heads, dim, generator=g).to(dtype)
    args = [t.to(device) for t in (query, k_cache, v_cache, tables, qsl, torch.tensor(lens).int())]
    return args + [dim**-0.5, max(n for _, n in seqs), max(lens)]


@pytest.mark.parametrize("window", [None, 1, 8, 128, 10_000])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_triton_window_matches_reference(device, window, splits, with_sinks):
    """Triton prefill (with cached context, chunks crossing the window), decode and split-KV
    decode with a sliding window against the torch reference (windows 1, 8, 128, > context)."""
    pytest.importorskip("triton")
    from atom_core.kernels.triton.attention import launch_paged_attention

    seqs = SEQS if device == "cpu" else [(0, 200), (150, 37), (300, 1), (3, 1), (700, 1), (0, 1)]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    args = _case(device, seqs, dtype)
    sinks = (torch.randn(args[0].shape[1], generator=torch.Generator().manual_seed(3)) * 2).to(device) \
        if with_sinks else None
    if window is None and not with_sinks:
        pytest.skip("plain causal attention: tests/kernels/test_triton_kernels.py")
    got = launch_paged_attention(*args, num_kv_splits=splits, sliding_window=window, sinks=sinks)
    ref = torch_ref.paged_attention(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args],
                                    sliding_window=window, sinks=None if sinks is None else sinks.cpu())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=tol, rtol=tol)
