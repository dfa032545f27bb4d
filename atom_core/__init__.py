"""atom_core: a small, fast LLM inference engine."""
from atom_core.sampling_params import SamplingParams

__all__ = ["LLMEngine", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name):  # keep `import atom_core` light: torch-heavy parts load on first use
    if name == "LLMEngine":
        from atom_core.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from atom_core.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
