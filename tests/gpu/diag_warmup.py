"""Why a second engine start re-compiles attention variants: time warm_up_variants in a fresh
process, after an Inductor compile like level 3 does. Run twice; the second should be ~0 s."""
import os
import sys
import time

import torch

from atom_core.kernels.triton.attention import warm_up_variants

heads = int(sys.argv[1]) if len(sys.argv) > 1 else 32
print("TRITON_CACHE_DIR before:", os.environ.get("TRITON_CACHE_DIR"))
f = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1, dynamic=True)
f(torch.randn(64, device="cuda"))
print("TRITON_CACHE_DIR after inductor:", os.environ.get("TRITON_CACHE_DIR"))
k = torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
start = time.perf_counter()
n = warm_up_variants(k, k.clone(), heads, torch.bfloat16, 8192)
torch.cuda.synchronize()
print(f"warm_up_variants heads={heads}: {n} launches in {time.perf_counter() - start:.2f} s")
