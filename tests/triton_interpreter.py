"""Triton's interpreter, patched for speed in the test processes (tests/conftest.py calls `speed_up()`).

A kernel launch under TRITON_INTERPRET=1 (`interpreter.GridExecutor.__call__`) maps triton.language onto
numpy (`interpreter._patch_lang`: it walks tl, tl.tensor and tl.math with inspect.getmembers and swaps
every builtin), runs the grid and puts the language back. Triton 3.x repeats that walk on every call of
a @triton.jit helper from inside the kernel, once per program instance and loop iteration, although the
launch has swapped everything the helper sees: a swapped builtin is no builtin any more, so the repeat
only sets the same attributes to the same values again. In the kernel tests that repeat is a large
share of the time.

`speed_up()` skips the repeat inside a launch on this thread once the language modules the helper sees
are patched (by the launch, or by an earlier helper call of the launch: Triton leaves those in place);
any other call goes to Triton's function as before. No result changes, only the work of patching what
is patched already. On a Triton without the two functions it wraps it changes nothing.
"""
from __future__ import annotations

import inspect
import threading


class _NothingToRestore:
    def restore(self) -> None:
        pass


def speed_up() -> bool:
    """Install the skip (once); False, with nothing changed, where this Triton lacks what it wraps."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    real_patch, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if real_patch is None or executor is None:
        return False
    if getattr(real_patch, "skips_repeats", False):
        return True
    real_launch = executor.__call__
    launches = threading.local()  # this thread's launches in progress, innermost last

    def languages(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def launch(self, *args, **kwargs):
        stack = launches.__dict__.setdefault("stack", [])
        stack.append({"fn": self.fn, "languages": languages(self.fn), "patched": False})
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            stack.pop()

    def patch_lang(fn):
        stack = launches.__dict__.get("stack")
        current = stack[-1] if stack else None
        seen = languages(fn)
        if current is not None and current["patched"] and seen <= current["languages"]:
            return _NothingToRestore()
        scope = real_patch(fn)
        if current is not None and fn is current["fn"]:
            current["patched"] = True  # the launch's own patch, restored by the launch
        elif current is not None:  # a helper's (triton.language.standard sees tl.core): Triton never restores it
            current["languages"] |= seen
        return scope

    patch_lang.skips_repeats = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch
    return True
