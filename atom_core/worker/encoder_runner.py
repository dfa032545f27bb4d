"""The worker's encoder outputs: runs the model's vision encoder on the images a step lists, once
each, keeps the outputs by content hash until the scheduler frees them (engine/encoder_cache.py),
and gives each step the rows of the images its prompt chunks cover (a chunk that starts inside an
image reads the rows an earlier step encoded)."""
from __future__ import annotations

import numpy as np
import torch

from atom_core.models.common import MultimodalEmbeds
from atom_core.scheduler_output import PLACEHOLDER, SchedulerOutput
from atom_core.worker.input_batch import RequestState


class EncoderRunner:
    """Contract: `step_embeds(out, states)` once per step, before its forward, with the states in
    batch order; it drops `out.freed_encoder_hashes`, encodes `out.encoder_items`, and returns the
    step's MultimodalEmbeds (None when no scheduled chunk holds an image placeholder)."""

    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = device
        self.outputs: dict[int, torch.Tensor] = {}  # content hash -> [item.length, hidden]

    def step_embeds(self, out: SchedulerOutput, states: list[RequestState]) -> MultimodalEmbeds | None:
        for h in out.freed_encoder_hashes:
            self.outputs.pop(h, None)
        if out.encoder_items:
            self._encode(out, states)
        rows: list[np.ndarray] = []
        pieces: list[torch.Tensor] = []
        offset = 0
        for state, n, extra in zip(states, out.num_scheduled_tokens, out.extra_tokens):
            start = state.num_computed_tokens
            for item in state.mm_items:
                if not item.overlaps(start, start + n):
                    continue
                first, last = max(start, item.offset), min(start + n, item.end)
                embeds = self.outputs.get(item.content_hash)
                assert embeds is not None, f"{state.req_id}: image at {item.offset} scheduled but never encoded"
                rows.append(np.arange(offset + first - start, offset + last - start, dtype=np.int64))
                pieces.append(embeds[first - item.offset : last - item.offset])
            offset += n + (len(extra) if extra and extra[0] != PLACEHOLDER else 0)
        if not pieces:
            return None
        index = torch.from_numpy(np.concatenate(rows)).to(self.device, non_blocking=True)
        return MultimodalEmbeds(index, torch.cat(pieces) if len(pieces) > 1 else pieces[0])

    def _encode(self, out: SchedulerOutput, states: list[RequestState]) -> None:
        by_id = {s.req_id: s for s in states}
        items = [by_id[rid].mm_items[k] for rid, k in out.encoder_items]
        encoded = self.model.encode_images(items)
        assert len(encoded) == len(items), "encode_images must return one tensor per item"
        for item, embeds in zip(items, encoded):
            assert embeds.shape[0] == item.length, (f"the encoder gave {embeds.shape[0]} rows for an image of "
                                                    f"{item.length} placeholder tokens")
            self.outputs[item.content_hash] = embeds
