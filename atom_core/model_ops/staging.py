"""Host arrays to the device in one transfer: what the batch builder (worker/) and the drafters
(spec_decode/) send before a forward."""
from __future__ import annotations

import numpy as np
import torch

STAGING_ALIGN = 16  # bytes: the pointer alignment Triton specialises on, as a fresh allocation has


def aligned_offsets(nbytes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Each name's byte offset in one buffer (16-byte aligned, in the dict's order) and the total."""
    offsets, total = {}, 0
    for name, n in nbytes.items():
        offsets[name] = total
        total += -(-n // STAGING_ALIGN) * STAGING_ALIGN
    return offsets, total


def typed_view(buf: torch.Tensor, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of uint8 `buf` from `offset` as a tensor of numpy `dtype` and `shape`."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return buf[offset:offset + n].view(torch.from_numpy(np.zeros(0, dtype)).dtype).view(shape)


def to_device_packed(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Several host arrays to the device in ONE copy: packed into one pinned buffer, each at a
    16-byte-aligned offset, and handed out as views of the device copy. Separate small copies
    (~10 a step) each leave the GPU idle for a copy's launch and host round trip.
    The CPU packs alike (its views are of the host buffer), so the CPU tests run the packing."""
    pinned = device.type == "cuda"
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    offsets, total = aligned_offsets({name: a.nbytes for name, a in arrays.items()})
    host = torch.empty(max(total, STAGING_ALIGN), dtype=torch.uint8, pin_memory=pinned)
    staging = host.numpy()
    for name, a in arrays.items():
        staging[offsets[name]:offsets[name] + a.nbytes] = a.reshape(-1).view(np.uint8)
    packed = host.to(device, non_blocking=True) if pinned else host
    return {name: typed_view(packed, offsets[name], a.dtype, a.shape) for name, a in arrays.items()}
