"""Llama 2/3/3.1 (llama3 rope scaling) and Mistral-style dense configs."""
from __future__ import annotations

from atom_core.models.common import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    qk_norm = False
