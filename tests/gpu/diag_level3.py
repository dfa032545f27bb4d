"""Diagnose a level-3 (compile + CUDA graphs) failure: synchronous launches, real traceback."""
import os
import sys
import tempfile
import traceback

import torch  # noqa: E402

from atom_core import LLMEngine, SamplingParams  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

path = build_tiny_model(tempfile.mkdtemp(), "qwen3")
for sizes in [tuple(int(x) for x in a.split(',')) for a in sys.argv[1:]] or [(1,), (2, 1)]:
    try:
        e = LLMEngine(str(path), device="cuda", dtype="float32", num_kv_blocks=256, level=3, cudagraph_capture_sizes=sizes)
        print(sizes, "OK", e.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))[0]["token_ids"])
    except Exception:
        tb = traceback.format_exc().splitlines()
        print(sizes, "FAILED\n" + "\n".join(l for l in tb if "site-packages/torch/_" not in l)[-3000:])
