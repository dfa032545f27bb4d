"""The engine core's bookkeeping of the worker's encoder-output cache (the outputs themselves live in
the worker, worker/encoder_runner.py): which images are encoded, who still needs them, what to drop.

Sized in encoder-output rows (an image's placeholder count). The scheduler asks, per prompt chunk,
which of the chunk's images need encoding this step and whether the step's encoder budget and the
cache can take them; a chunk that cannot stops before such an image.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from atom_core.multimodal.inputs import MultimodalItem


@dataclass
class _Entry:
    num_rows: int
    users: set[str] = field(default_factory=set)  # request ids whose prompt chunks still read it


class EncoderCacheManager:
    """Contract:
    - An entry exists from the step that encodes it until it is evicted; `users` are the requests
      that touched it and have not yet computed past its last placeholder (or ended).
    - `allocate` may evict entries without users (least recently used first); their hashes are
      reported once by `take_freed`, and the worker drops them before the step runs.
    - The sum of the entries' rows never exceeds `capacity`; an item longer than it is refused at
      admission (`check_fits`), so a chunk never waits on space that cannot come.
    Not thread-safe: the engine core's loop is its only caller.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.num_used = 0
        self._freed: list[int] = []

    def check_fits(self, items: tuple[MultimodalItem, ...]) -> None:
        for i, item in enumerate(items):
            if item.length > self.capacity:
                raise ValueError(f"image {i} takes {item.length} tokens but the encoder cache and a step's encoder "
                                 f"budget hold {self.capacity} (max_num_batched_tokens); send a smaller image or "
                                 "raise --max-num-batched-tokens")

    def is_cached(self, content_hash: int) -> bool:
        return content_hash in self.entries

    def _evictable(self) -> int:
        return sum(e.num_rows for e in self.entries.values() if not e.users)

    def can_allocate(self, num_rows: int) -> bool:
        return self.capacity - self.num_used + self._evictable() >= num_rows

    def allocate(self, content_hash: int, num_rows: int, req_id: str) -> None:
        """Reserve room for an output the worker computes this step (after a True `can_allocate`)."""
        assert content_hash not in self.entries, "allocate of an encoder output already cached"
        while self.capacity - self.num_used < num_rows:
            victim = next((h for h, e in self.entries.items() if not e.users), None)
            assert victim is not None, "encoder cache allocate without a successful can_allocate"
            self.num_used -= self.entries.pop(victim).num_rows
            self._freed.append(victim)
        self.entries[content_hash] = _Entry(num_rows, {req_id})
        self.num_used += num_rows

    def add_user(self, content_hash: int, req_id: str) -> None:
        """A request reads a cached output: it stays until the request is done with it (and is now
        the most recently used)."""
        self.entries[content_hash].users.add(req_id)
        self.entries.move_to_end(content_hash)

    def release(self, content_hash: int, req_id: str) -> None:
        entry = self.entries.get(content_hash)
        if entry is not None:
            entry.users.discard(req_id)

    def release_request(self, req_id: str, items: tuple[MultimodalItem, ...]) -> None:
        """A request ended or was preempted: it needs none of its outputs any more."""
        for item in items:
            self.release(item.content_hash, req_id)

    def take_freed(self) -> list[int]:
        freed, self._freed = self._freed, []
        return freed

    def reset(self) -> list[int]:
        """Evict every entry without users (e.g. with the prefix cache); returns their hashes."""
        for h in [h for h, e in self.entries.items() if not e.users]:
            self.num_used -= self.entries.pop(h).num_rows
            self._freed.append(h)
        return list(self._freed)
