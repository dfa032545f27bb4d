"""The `device` fixture every kernel test uses: `cuda` cases carry the `gpu` marker; `cpu` cases
run the Triton kernels under its interpreter, when TRITON_INTERPRET=1 was set before triton was
imported (tests/conftest.py sets it where no CUDA device is present)."""
import pytest

from tests.kernels.tolerances import INTERPRET


@pytest.fixture(params=[
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(INTERPRET, reason="interpreter mode")]),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run on CPU")),
])
def device(request) -> str:
    return request.param
