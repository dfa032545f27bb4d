"""vLLM pads a step's token rows up to a CUDA-graph size (the model's inputs, so its attention layers'
too) while the metadata it builds covers only the step's real tokens (`slot_mapping` and
`query_start_loc` end at them). Our kernels take rows and metadata of one length, as our engine gives
them: so a padded step's attention runs on its real rows and the padding rows get zeros (vLLM's own
attention leaves them unwritten; nothing reads them). A full-graph decode step brings metadata padded
to the graph's size itself, and needs nothing here.
"""
from __future__ import annotations

import torch


def real_rows(metadata, rows: int) -> int:
    """How many of a step's `rows` its metadata covers (ValueError when it covers more)."""
    real = metadata.slot_mapping.shape[0]
    if real > rows:
        raise ValueError(f"attention metadata for {real} tokens but {rows} token rows in the step")
    return real


def pad_rows(out: torch.Tensor, rows: int) -> torch.Tensor:
    """`out` with zero rows appended up to `rows` (vLLM's padding rows)."""
    return out if out.shape[0] == rows else torch.cat([out, out.new_zeros(rows - out.shape[0], *out.shape[1:])])


def attend_real_rows(backend, layer, metadata, first: torch.Tensor, *args) -> torch.Tensor:
    """`backend.forward(layer, first, *args)` over the rows `metadata` covers; the row inputs (those
    as long as `first`) trimmed to them and the output padded back with zero rows."""
    rows = first.shape[0]
    real = real_rows(metadata, rows)
    if real == rows:
        return backend.forward(layer, first, *args)
    trimmed = [a[:real] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == rows else a for a in args]
    return pad_rows(backend.forward(layer, first[:real], *trimmed), rows)
