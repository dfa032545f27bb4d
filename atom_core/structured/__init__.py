"""Structured outputs: constrained decoding through xgrammar grammars.

`StructuredOutputsParams` (params.py) says what a request's output must match and is checked
on construction; `GrammarManager` (manager.py) lives in the engine core, next to the scheduler,
where a request's sampled tokens become known: it compiles grammars, advances one matcher per
request, and fills each step's token bitmask, which the sampler applies on the device.
"""
from atom_core.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
