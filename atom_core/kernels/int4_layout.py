"""The int4 kernel layout's constants and check, shared by the W4A16 kernels (kernels/triton/w4a16*.py)
and the repacking that writes the layout at load (quant/int_ops.py). Here, below quant/, because
the kernels must not import quant/.

qweight int32 [N, K/8] holds 8 nibbles a word; the kernel layout reorders the nibbles inside
chunks of INT4_INTERLEAVE words (quant/int_ops.py's docstring), `interleave` = 1 names the
canonical layout.
"""
from __future__ import annotations

INT4_PER_INT32 = 8
INT4_INTERLEAVE = 4  # words a chunk of the kernel layout: 4 words (16 bytes) a GEMV thread loads


def check_interleave(interleave: int, k: int) -> None:
    if interleave not in (1, INT4_INTERLEAVE) or k % (INT4_PER_INT32 * interleave):
        raise ValueError(f"int4 interleave {interleave} with K={k}: expected 1 (canonical) or {INT4_INTERLEAVE} "
                         f"with K a multiple of {INT4_PER_INT32 * INT4_INTERLEAVE}")
