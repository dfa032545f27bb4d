"""The LoRA shrink/expand Triton kernels against their torch references (Triton's interpreter on the
CPU, tests/conftest.py), and the grouped layout."""
from __future__ import annotations

import pytest
import torch

from atom_core.kernels import lora_ref
from atom_core.kernels.triton import lora as triton_lora


def _case(num_tokens: int, k: int, slots: int, rank: int, slice_sizes: list[int], device: str, dtype=torch.float32,
          seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g).to(device, dtype)
    a = torch.randn(slots, len(slice_sizes) * rank, k, generator=g).to(device, dtype)
    b = torch.randn(slots, sum(slice_sizes), rank, generator=g).to(device, dtype)
    y = torch.randn(num_tokens, sum(slice_sizes), generator=g).to(device, dtype)
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g).to(device, torch.int32)
    offsets = (0, *torch.tensor(slice_sizes).cumsum(0).tolist())
    return x, a, b, y, token_slots, tuple(offsets)


class TestLayout:
    def test_groups_tokens_by_slot_and_counts_each(self):
        meta = lora_ref.lora_layout(torch.tensor([1, -1, 0, 1, 2, -1, 0], dtype=torch.int32), 4)
        assert meta.slot_num_tokens.tolist() == [2, 2, 1, 0]
        assert meta.slot_start.tolist() == [0, 2, 4, 5]
        assert meta.sorted_token_ids.tolist()[:5] == [2, 6, 0, 3, 4]  # stable within a slot; no-adapter rows last


class TestReferences:
    def test_shrink_and_expand_match_a_per_token_loop(self):
        x, a, b, y, token_slots, offsets = _case(9, 12, 3, 4, [5, 3], "cpu")
        meta = lora_ref.lora_layout(token_slots, 3)
        v = lora_ref.lora_shrink(x, a, meta)
        out = y.clone()
        lora_ref.lora_expand(out, v, b, meta, offsets, 4)
        for t in range(9):
            s = int(token_slots[t])
            want = y[t].clone()
            if s >= 0:
                for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
                    want[lo:hi] += b[s, lo:hi] @ (a[s, i * 4:(i + 1) * 4] @ x[t])
            torch.testing.assert_close(out[t], want)


# Small fp32 cases under the interpreter; on a CUDA machine test_real_shapes_on_gpu checks the compiled
# kernels (in bf16: tl.dot rounds fp32 inputs to tf32 there, beyond these cases' tolerance).
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter cases")


@interpreter_only
@pytest.mark.parametrize("num_tokens,k,slots,rank,slices", [
    (7, 40, 3, 8, [24]),            # one slice, ragged K and N
    (20, 64, 2, 16, [32, 16, 16]),  # qkv-like, tokens over one block per slot
    (5, 48, 4, 4, [40, 40]),        # gate_up-like, a slice wider than one N block
    (6, 1100, 2, 4, [8]),           # K split in two (decode-sized steps): partials summed by the expand
])
class TestTritonMatchesReference:
    def test_shrink(self, num_tokens, k, slots, rank, slices):
        x, a, _, _, token_slots, _ = _case(num_tokens, k, slots, rank, slices, "cpu")
        meta = lora_ref.lora_layout(token_slots, slots)
        got = triton_lora.lora_shrink(x, a, meta)
        want = lora_ref.lora_shrink(x, a, meta)
        rows = token_slots >= 0
        torch.testing.assert_close(got.sum(0)[rows], want.sum(0)[rows], rtol=1e-4, atol=1e-4)

    def test_expand(self, num_tokens, k, slots, rank, slices):
        x, a, b, y, token_slots, offsets = _case(num_tokens, k, slots, rank, slices, "cpu")
        meta = lora_ref.lora_layout(token_slots, slots)
        got, want = y.clone(), y.clone()
        # The Triton shrink's partials (rows of no adapter left unwritten), summed by the expand.
        triton_lora.lora_expand(got, triton_lora.lora_shrink(x, a, meta), b, meta, offsets, rank)
        lora_ref.lora_expand(want, lora_ref.lora_shrink(x, a, meta), b, meta, offsets, rank)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # rows of no adapter untouched


@interpreter_only
class TestTritonChecks:
    def test_expand_refuses_slices_that_do_not_cover_y(self):
        x, a, b, y, token_slots, offsets = _case(4, 16, 2, 4, [8, 8], "cpu")
        meta = lora_ref.lora_layout(token_slots, 2)
        v = lora_ref.lora_shrink(x, a, meta)
        with pytest.raises(ValueError, match="slice_offsets"):
            triton_lora.lora_expand(y, v, b, meta, (0, 8), 4)

    def test_refuses_a_layout_for_another_slot_count(self):
        x, a, _, _, token_slots, _ = _case(4, 16, 2, 4, [8], "cpu")
        with pytest.raises(ValueError, match="does not fit"):
            triton_lora.lora_shrink(x, a, lora_ref.lora_layout(token_slots, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 32, 512, 4096])
def test_real_shapes_on_gpu(num_tokens):
    """Llama-3-8B's qkv (4096 -> 4096 + 2 x 1024) at rank 16 with 8 slots, in bf16, with A and B scaled
    as trained adapters are (x A^T and v B^T of the order of their inputs), so that bf16's rounding is
    measured against the size of what is added: the kernel rounds v to bf16 for its dot, the reference
    keeps it in float32, and both round the sum once."""
    x, a, b, y, token_slots, offsets = _case(num_tokens, 4096, 8, 16, [4096, 1024, 1024], "cuda", torch.bfloat16)
    a, b = a / 64, b / 4  # 1/sqrt(K), 1/sqrt(rank)
    meta = lora_ref.lora_layout(token_slots, 8)
    v = triton_lora.lora_shrink(x, a, meta)
    rows = token_slots >= 0
    torch.testing.assert_close(v.sum(0)[rows], lora_ref.lora_shrink(x, a, meta)[0, rows], rtol=2e-2, atol=2e-2)
    got, want = y.clone(), y.clone()
    triton_lora.lora_expand(got, v, b, meta, offsets, 16)
    lora_ref.lora_expand(want, v, b, meta, offsets, 16)
    scale = (want.float() - y.float()).abs().max().item()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(got[~rows], y[~rows], rtol=0, atol=0)  # rows of no adapter untouched
