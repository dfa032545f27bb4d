"""Triton compile cost of the attention warm-up: (1) does a second process find our kernels in
the disk cache after an Inductor compile (the engine pins TRITON_CACHE_DIR; this script does
the same), (2) how much threads save on a cold cache. Run twice; the second `pinned` line
should be ~0 s."""
import os
import sys
import tempfile
import time

import torch

from atom_core.kernels.triton.attention import warm_up_variants
from atom_core.kernels.triton.common import pin_triton_cache_dir

heads = int(sys.argv[1]) if len(sys.argv) > 1 else 32
print("TRITON_CACHE_DIR pinned:", pin_triton_cache_dir(0))
f = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1, dynamic=True)
f(torch.randn(64, device="cuda"))
print("TRITON_CACHE_DIR after inductor:", os.environ.get("TRITON_CACHE_DIR"))
k = torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)


def timed(label, threads):
    start = time.perf_counter()
    n = warm_up_variants(k, k.clone(), heads, torch.bfloat16, 8192, threads=threads)
    torch.cuda.synchronize()
    print(f"{label}: {n} variants, threads={threads}: {time.perf_counter() - start:.2f} s")


timed("pinned cache", 1)
if "--cold" in sys.argv:
    for threads, dtype_heads in ((1, 16), (8, 64)):  # other head counts: other variants, cold
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
        heads = dtype_heads
        timed(f"cold cache, heads={heads}", threads)
