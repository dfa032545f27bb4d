"""A pytest plugin that records the argument types of every Triton kernel launch under the interpreter,
for tests/kernels/test_rocm_compile.py (which compiles each recorded launch for AMD GPUs):

    python -m pytest -q -p tests.kernels.rocm_capture tests/kernels tests/quant

writes tests/kernels/rocm_launches.json: per kernel (module:name), up to MAX_PER_KERNEL distinct
launches, each its non-constexpr arguments' Triton types, its constexpr values and its num_warps.
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import torch

OUT = Path(__file__).with_name("rocm_launches.json")
MAX_PER_KERNEL = 2

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
           torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_launches: dict[str, list[dict]] = {}


def _arg_type(value) -> str | int | float | bool | None:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


def _record(fn, args, kwargs) -> None:
    sig = inspect.signature(fn.fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    types, constexprs = {}, {}
    for name, p in sig.parameters.items():
        value = bound.arguments.get(name)
        is_constexpr = "constexpr" in str(p.annotation)
        if is_constexpr:
            constexprs[name] = value.value if hasattr(value, "value") else value
        elif value is None:
            constexprs[name] = None  # Triton specializes a None argument away
        else:
            types[name] = _arg_type(value)
    launch = {"types": types, "constexprs": constexprs, "num_warps": kwargs.get("num_warps", 4),
              "num_stages": kwargs.get("num_stages", 2)}
    if not fn.fn.__module__.startswith("atom_core."):
        return  # a test's own probe kernel
    key = f"{fn.fn.__module__}:{fn.fn.__name__}"
    seen = _launches.setdefault(key, [])
    if launch not in seen and len(seen) < MAX_PER_KERNEL:
        seen.append(launch)


def pytest_configure(config):
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        _record(self, args, kwargs)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def pytest_sessionfinish(session, exitstatus):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:  # an xdist worker: its part, merged by the controller, which finishes last
        OUT.with_suffix(f".{worker}.part").write_text(json.dumps(_launches))
        return
    merged = dict(_launches)
    for part in sorted(OUT.parent.glob(OUT.stem + ".*.part")):
        for key, launches in json.loads(part.read_text()).items():
            seen = merged.setdefault(key, [])
            for launch in launches:
                if launch not in seen and len(seen) < MAX_PER_KERNEL:
                    seen.append(launch)
        part.unlink()
    if merged:
        OUT.write_text(json.dumps(dict(sorted(merged.items())), indent=1, sort_keys=True) + "\n")
