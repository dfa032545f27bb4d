"""The `device` fixture every kernel test uses: `cuda` cases carry the `gpu` marker; `cpu` cases
run the Triton kernels under its interpreter, only when the pytest process was started with
TRITON_INTERPRET=1 (it must be set before triton is imported)."""
import pytest

from tests.kernels.tolerances import INTERPRET


@pytest.fixture(params=[
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(INTERPRET, reason="interpreter mode")]),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run on CPU")),
])
def device(request) -> str:
    return request.param
