"""Compile every recorded Triton kernel launch (rocm_launches.json) for an AMD GPU, offline:

    python -m tests.kernels.rocm_compile gfx942 [KERNEL ...]

Prints one JSON object: per kernel (module:name), "ok" or the compiler's error's last line. Needs
Triton's AMD backend (triton/backends/amd, with its bundled LLVM and lld), not a ROCm runtime or GPU.
Run it without TRITON_INTERPRET: the interpreter hands out no JITFunctions to compile.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

LAUNCHES = Path(__file__).with_name("rocm_launches.json")
WAVE_SIZE = 64  # CDNA (gfx9xx) wavefronts


def rocm_constexprs(launch: dict) -> dict:
    """The recorded constexprs with the interpreter's workarounds set back to what the wrappers pass on
    ROCm (they choose these from `_INTERPRETED` and torch.version.hip): bf16 dots in bf16, no float32
    upcast, IEEE products only for float32 activations, the e4m3 dot widened to bf16 (moe_fp8.dot_mode)."""
    constexprs = dict(launch["constexprs"])
    for name in ("DOT_IN_FP32", "UPCAST"):
        if name in constexprs:
            constexprs[name] = False
    if "IEEE" in constexprs:
        constexprs["IEEE"] = launch["types"].get("x_ptr") == "*fp32"
    if "DOT_MODE" in constexprs:
        constexprs["DOT_MODE"] = 1
    return constexprs


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
    constexprs = rocm_constexprs(launch)
    signature = {p.name: "constexpr" if p.name in constexprs else launch["types"][p.name] for p in fn.params}
    source = ASTSource(fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)  # LLVM reports some errors (inline asm constraints) on stderr and goes on
        try:
            kernel = triton.compile(source, target=GPUTarget("hip", arch, WAVE_SIZE), options=options)
        except Exception as e:  # the compiler raises several types (CompilationError, RuntimeError from MLIR)
            lines = [line for line in str(e).strip().splitlines() if line.strip()]
            return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        errors = [line.strip() for line in log if line.lstrip().lower().startswith("error")]
    if errors:
        return errors[0][:400]
    return "ok" if kernel.asm.get("hsaco") else "no hsaco"


def main(argv: list[str]) -> None:
    arch, only = argv[0], set(argv[1:])
    recorded = json.loads(LAUNCHES.read_text())
    results = {key: compile_launch(key, representative(launches), arch)
               for key, launches in recorded.items() if not only or key in only}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
