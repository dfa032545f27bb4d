"""PlannedLaunch (kernels/triton/common.py): the first launch of a plan goes through Triton's JIT call
and keeps the compiled kernel; later ones call the compiled kernel's launcher with the plan's argument
values in parameter order and their own tensors put in, one compiled kernel per alignment pattern; the
switch, launch hooks and the interpreter keep the JIT path. A stand-in kernel records what it gets (no
GPU here); benchmarks/kernels/bench_launch_overhead.py checks the direct launch computes what the JIT path does."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from atom_core.envs import read_envs  # noqa: E402
from atom_core.kernel_config import KernelConfig  # noqa: E402
from atom_core.kernels.triton import common  # noqa: E402


def kernel_source(x_ptr, out_ptr, n, scale=1.0, BLOCK=16, flag=None):  # the parameters a stand-in kernel has
    pass


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn-handle", "meta"

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *values):
        self.log.append(("direct", (g0, g1, g2), stream, values))


class FakeJit:
    """What PlannedLaunch reads of a triton.JITFunction: arg_names, signature, [grid](...)."""

    arg_names = list(inspect.signature(kernel_source).parameters)
    signature = inspect.signature(kernel_source)

    def __init__(self, compiled=True):
        self.log, self.compiled = [], compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log) if self.compiled else None
        return launch


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(common, "_is_compiled", lambda kernel: isinstance(kernel, FakeCompiled))
    monkeypatch.setattr(common, "_current_stream", lambda device: 7)
    monkeypatch.setattr(common, "_launch_hooks_set", lambda: False)


def aligned(n=8):
    return torch.zeros(n)


def misaligned(n=8):
    return torch.zeros(n + 1)[1:]  # 4 bytes past a 16-byte boundary


def call(launch, x, out, direct: bool = True):
    launch((x, out), lambda: ((x, out, 8), dict(scale=0.5, BLOCK=32, num_warps=4)), direct)


def test_later_launches_call_the_compiled_kernel_with_values_in_parameter_order(direct):
    fn = FakeJit()
    launch = common.PlannedLaunch(fn, (3,), ("x_ptr", "out_ptr"))
    x0, o0, x1, o1 = aligned(), aligned(), aligned(), aligned()
    call(launch, x0, o0)
    call(launch, x1, o1)
    assert [entry[0] for entry in fn.log] == ["jit", "direct"]
    kind, grid, stream, values = fn.log[1]
    assert grid == (3, 1, 1) and stream == 7
    # parameter order, defaults filled in, launch options (num_warps) left out, this call's tensors
    assert values[0] is x1 and values[1] is o1 and values[2:] == (8, 0.5, 32, None)


def test_a_new_alignment_pattern_goes_through_the_jit_once(direct):
    fn = FakeJit()
    launch = common.PlannedLaunch(fn, (3, 2), ("x_ptr", "out_ptr"))
    call(launch, aligned(), aligned())
    call(launch, misaligned(), aligned())
    call(launch, misaligned(), aligned())
    call(launch, aligned(), aligned())
    assert [entry[0] for entry in fn.log] == ["jit", "jit", "direct", "direct"]


def test_direct_off_hooks_or_no_compiled_kernel_keep_the_jit_path(direct, monkeypatch):
    fn = FakeJit()
    launch = common.PlannedLaunch(fn, (3,), ("x_ptr", "out_ptr"))
    for _ in range(2):
        call(launch, aligned(), aligned(), direct=False)
    assert not launch.kernels  # nothing kept for later direct calls either
    monkeypatch.setattr(common, "_launch_hooks_set", lambda: True)
    for _ in range(2):
        call(launch, aligned(), aligned())
    assert [entry[0] for entry in fn.log] == ["jit"] * 4
    interpreted = FakeJit(compiled=False)  # TRITON_INTERPRET=1: nothing compiled to call
    launch = common.PlannedLaunch(interpreted, (3,), ("x_ptr", "out_ptr"))
    monkeypatch.setattr(common, "_launch_hooks_set", lambda: False)
    for _ in range(2):
        call(launch, aligned(), aligned())
    assert [entry[0] for entry in interpreted.log] == ["jit"] * 2


def test_the_option_reads_its_environment_variable():
    assert read_envs({}).triton_fast_launch is None and KernelConfig().triton_fast_launch is True
    assert read_envs({"ATOM_TRITON_FAST_LAUNCH": "0"}).triton_fast_launch is False
    with pytest.raises(ValueError, match="ATOM_TRITON_FAST_LAUNCH"):
        read_envs({"ATOM_TRITON_FAST_LAUNCH": "maybe"})


def test_the_attention_backend_passes_its_config_to_the_triton_wrappers():
    from atom_core.model_ops.attention_backends import PagedMHABackend

    assert PagedMHABackend("cuda").launch == {"direct_launch": True}
    assert PagedMHABackend("cuda", KernelConfig(triton_fast_launch=False)).launch == {"direct_launch": False}
    assert PagedMHABackend("cpu", KernelConfig(triton_fast_launch=False)).launch == {}  # torch_ref takes no option


class HookChain:  # Triton >= 3.5 keeps launch hooks in one of these, never None
    def __init__(self):
        self.calls = []


def test_launch_hooks_are_read_from_triton_knobs(monkeypatch):
    knobs = SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    monkeypatch.setattr("triton.knobs", knobs, raising=False)
    assert common._launch_hooks_set() is False
    knobs.runtime.launch_enter_hook = print  # older Triton: a callable
    assert common._launch_hooks_set() is True
    knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook = HookChain(), HookChain()
    assert common._launch_hooks_set() is False  # empty chains: no hook
    knobs.runtime.launch_exit_hook.calls.append(print)
    assert common._launch_hooks_set() is True


def test_the_plan_keeps_no_per_call_tensor_alive(direct):
    import weakref

    fn = FakeJit()
    launch = common.PlannedLaunch(fn, (3,), ("x_ptr", "out_ptr"))
    x, out = aligned(1 << 16), aligned(1 << 16)
    refs = weakref.ref(x), weakref.ref(out)
    call(launch, x, out)
    fn.log.clear()
    del x, out
    assert refs[0]() is None and refs[1]() is None
