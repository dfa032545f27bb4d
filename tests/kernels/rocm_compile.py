"""Compile every recorded Triton kernel launch (rocm_launches.json) for an AMD GPU, offline:

    python -m tests.kernels.rocm_compile gfx942 [KERNEL ...]

Prints one JSON object: per kernel (module:name), "ok" or the compiler's error's last line. Needs
Triton's AMD backend (triton/backends/amd, with its bundled LLVM and lld), not a ROCm runtime or GPU.
Run it without TRITON_INTERPRET: the interpreter hands out no JITFunctions to compile.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

LAUNCHES = Path(__file__).with_name("rocm_launches.json")
WAVE_SIZE = 64  # CDNA (gfx9xx) wavefronts


def representative(launches: list[dict]) -> dict:
    """The launch whose argument types are closest to serving's: most bf16 / fp8 pointers."""
    return max(launches, key=lambda x: sum(t in ("*bf16", "*fp8e4nv") for t in x["types"].values()))


def jit_function(key: str):
    from triton.runtime.autotuner import Autotuner, Heuristics

    module, name = key.split(":")
    fn = getattr(importlib.import_module(module), name)
    while isinstance(fn, (Autotuner, Heuristics)):
        fn = fn.fn
    return fn


def compile_launch(key: str, launch: dict, arch: str) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(key)
    signature = {p.name: "constexpr" if p.name in launch["constexprs"] else launch["types"][p.name] for p in fn.params}
    source = ASTSource(fn, signature=signature, constexprs=launch["constexprs"])
    options = {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}
    try:
        kernel = triton.compile(source, target=GPUTarget("hip", arch, WAVE_SIZE), options=options)
    except Exception as e:  # the compiler raises several types (CompilationError, RuntimeError from MLIR passes)
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
    return "ok" if kernel.asm.get("hsaco") else "no hsaco"


def main(argv: list[str]) -> None:
    arch, only = argv[0], set(argv[1:])
    recorded = json.loads(LAUNCHES.read_text())
    results = {key: compile_launch(key, representative(launches), arch)
               for key, launches in recorded.items() if not only or key in only}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
