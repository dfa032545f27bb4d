"""Names shared by the trace writer (engine + profiler) and the trace parser.

One place, so that what the engine emits and what `parse-trace` looks for cannot drift.

Step ranges. The engine wraps each model step (build batch, forward, sample) in a
`torch.profiler.record_function` range named by `step_range_name`:

    atom_step[prefill] bs=4 tokens=512
    atom_step[decode] bs=4 tokens=4
    atom_step[decode] bs=5 tokens=5 graph_bs=8      (decode replayed from the bs=8 CUDA graph)

A step that schedules any prefill token is a prefill step; a step of decode tokens only is a
decode step. `bs` is the number of sequences, `tokens` the number of scheduled tokens and
`graph_bs` (decode only, when a CUDA graph is replayed) the padded batch size of that graph.
torch's record_function carries no args, hence the `key=value` pairs in the name.

Graph capture ranges. `TorchProfiler.record_graph_capture` wraps the capture of the CUDA graph
for batch size N in a range named `atom_graph_capture bs=N` and, with mark_trace on, writes it
to `capture_bs{N}_{model}_{timestamp}.pt.trace.json.gz` in the rank directory.

Module ranges. Every other `user_annotation` range is a module range (see
`profiler.mark_modules`); the parser attributes a kernel to the innermost one.
"""
from __future__ import annotations

import re
from typing import Literal

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")

STEP_PREFIX = "atom_step"
GRAPH_CAPTURE_PREFIX = "atom_graph_capture"
CAPTURE_FILE_PREFIX = "capture_bs"
TRACE_SUFFIX = ".pt.trace.json.gz"

STEP_RE = re.compile(r"^atom_step\[(?P<phase>prefill|decode)\](?P<fields>(?:\s+\w+=\d+)*)\s*$")
GRAPH_CAPTURE_RE = re.compile(r"^atom_graph_capture\s+bs=(?P<bs>\d+)\s*$")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)(?=\.|$)")


def step_range_name(phase: Phase, num_seqs: int, num_tokens: int, graph_bs: int | None = None) -> str:
    """The record_function name of one engine step, e.g. `atom_step[decode] bs=4 tokens=4`."""
    if phase not in PHASES:
        raise ValueError(f"unknown step phase {phase!r}; expected one of: {', '.join(PHASES)}")
    name = f"{STEP_PREFIX}[{phase}] bs={num_seqs} tokens={num_tokens}"
    if graph_bs is not None:
        name += f" graph_bs={graph_bs}"
    return name


def parse_step_name(name: str) -> tuple[Phase, dict[str, int]] | None:
    """(phase, {bs, tokens, graph_bs...}) for a step range name, None for any other name."""
    match = STEP_RE.match(name)
    if match is None:
        return None
    fields = dict(pair.split("=") for pair in match["fields"].split())
    return match["phase"], {key: int(value) for key, value in fields.items()}  # type: ignore[return-value]


def graph_capture_range_name(batch_size: int) -> str:
    return f"{GRAPH_CAPTURE_PREFIX} bs={batch_size}"


def parse_graph_capture_name(name: str) -> int | None:
    """The batch size of an `atom_graph_capture bs=N` range, None for any other name."""
    match = GRAPH_CAPTURE_RE.match(name)
    return int(match["bs"]) if match else None


def is_reserved_range(name: str) -> bool:
    """Ranges that are not module ranges: atom_* markers and the profiler's own step markers."""
    return name.startswith(("atom_", "ProfilerStep#", "PyTorch Profiler"))


def layer_index(module: str) -> int | None:
    """3 for `layers.3.self_attn.qkv_proj` (or `model.layers.3...`), None outside the layers."""
    match = LAYER_RE.search(module)
    return int(match["layer"]) if match else None


def normalize_layer(module: str) -> str:
    """`layers.3.mlp.down_proj` -> `layers.*.mlp.down_proj`: the name shared by all layers."""
    return LAYER_RE.sub(lambda m: m[0].replace(m["layer"], "*"), module, count=1)
