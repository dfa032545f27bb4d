import os

# One intra-op thread a test process (an explicit OMP_NUM_THREADS is kept): the models here are tiny, so
# a second thread buys nothing, and `pytest -n auto` already runs a worker per core; two OpenMP threads
# a worker oversubscribe the cores, and OpenMP's spin-waiting then makes a small matmul many times slower.
# Set before torch is imported, so server and rank subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a CUDA device the Triton kernel tests run on the CPU under Triton's interpreter. Triton reads
# TRITON_INTERPRET when a kernel is decorated, so this runs before any test module imports atom_core's
# kernels. The engine never launches Triton on a CPU device (kernel_ops and the attention backends choose by
# device), so other tests run the same code as without it. An explicit TRITON_INTERPRET=0 is kept.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import speed_up  # noqa: E402

    speed_up()  # the interpreter without its repeated patching of triton.language (same results)


# Files that cost far more than their number of tests says (engine builds against HF references, server
# and rank subprocesses, offline compiles), heaviest first as a CPU run measured them (pytest --durations,
# summed per file; the plugin file builds its vLLM venv on a fresh machine): started first, so no long
# file is left running alone at the end of a 2-worker run.
SLOW_FILES = ("tests/plugin/test_vllm_plugin.py", "tests/kernels/test_rocm_compile.py",
              "tests/distributed/test_dp_expert_parallel.py", "tests/eval/test_eval_cmd.py",
              "tests/server/test_tools.py", "tests/quant/test_compressed_tensors.py", "tests/engine/test_lifecycle.py",
              "tests/cli/test_generate.py", "tests/distributed/test_tp_serve.py", "tests/server/test_schema_fuzz.py",
              "tests/spec_decode/test_eagle3.py", "tests/quant/test_mxfp4.py", "tests/bench/test_offline.py",
              "tests/spec_decode/test_mtp.py", "tests/kernels/test_mixed_attention.py",
              "tests/distributed/test_options.py", "tests/models/test_hf_parity.py",
              "tests/distributed/test_data_parallel.py", "tests/kernels/test_moe_decode.py",
              "tests/benchmarks/test_lora_bench.py", "tests/server/test_hardening.py",
              "tests/bench/test_api_overhead.py", "tests/distributed/test_collectives.py",
              "tests/kernels/test_prefill_attention.py", "tests/models/test_gpt_oss.py")


def _longest_files_first(items) -> None:
    """Whole files in the order pytest-xdist should start them (pyproject: --dist loadfile, which runs a
    file on one worker so its module fixtures are built once): SLOW_FILES, then by number of tests. A
    file's own order is kept; the order is the same on every worker, as xdist requires."""
    def path(item) -> str:
        return item.nodeid.split("::")[0]

    counts: dict[str, int] = {}
    for item in items:
        counts[path(item)] = counts.get(path(item), 0) + 1

    def rank(item):
        file = path(item)
        return (SLOW_FILES.index(file), 0) if file in SLOW_FILES else (len(SLOW_FILES), -counts[file])

    items.sort(key=rank)  # stable: tests of one file keep their relative order


def pytest_collection_modifyitems(config, items):
    _longest_files_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(autouse=True)
def _reset_cli_debug_flag():
    """`atomctl --debug` sets a process-wide flag; in-process CLI tests must not inherit it."""
    from atomctl.errors import DEBUG

    DEBUG["enabled"] = False
    yield
    DEBUG["enabled"] = False
