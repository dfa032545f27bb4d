"""Qwen3 dense: Llama layout plus per-head RMSNorm on q and k before RoPE."""
from __future__ import annotations

from atom_core.models.common import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
