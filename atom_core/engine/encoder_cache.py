"""The engine core's bookkeeping of the worker's encoder-output cache (the outputs themselves live in
the worker, worker/encoder_runner.py): which images are encoded, who still needs them, what to drop.

Sized in encoder-output rows (an image's placeholder count). The scheduler asks, per prompt chunk,
which of the chunk's images need encoding this step and whether the step's encoder budget and the
cache can take them; a chunk that cannot stops before such an image.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from atom_core.engine.sequence import Sequence
from atom_core.multimodal.inputs import MultimodalItem
from atom_core.scheduler_output import SchedulerOutput


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
    - The sum of the entries' rows never exceeds `capacity`; an item longer than it is refused when
      the request is added (engine/core.py: validate_images), so a chunk never waits on space that
      cannot come.
    Not thread-safe: the engine core's loop is its only caller.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.num_used = 0
        self._freed: list[int] = []
        self.step_budget = capacity  # encoder-output rows the step being scheduled may still compute

    # ---- the scheduler's verbs, per step ---------------------------------------------------
    def begin_step(self) -> None:
        self.step_budget = self.capacity

    def _chunk_items(self, seq: Sequence, start: int, n: int) -> list[int]:
        """Indices of seq's images with placeholders among the chunk's tokens [start, start + n)."""
        found = []
        for k in range(seq.num_encoder_done, len(seq.mm_items)):
            item = seq.mm_items[k]
            if item.offset >= start + n:
                break
            if item.end > start:
                found.append(k)
        return found

    def fit_chunk(self, seq: Sequence, start: int, n: int) -> int:
        """How many of the chunk's n tokens from position `start` can run this step: all of them
        unless an image in them still needs encoding and the step's budget or the cache cannot take it;
        then the chunk stops before that image (possibly at 0 tokens). Changes nothing."""
        found = self._chunk_items(seq, start, n)
        # cached outputs the chunk reads are not room for the ones it encodes
        hashes = {seq.mm_items[k].content_hash for k in found}
        protected = sum(e.num_rows for h, e in self.entries.items() if h in hashes and not e.users)
        room = self.capacity - self.num_used + self._evictable() - protected
        need, seen = 0, set()
        for k in found:
            item = seq.mm_items[k]
            if item.content_hash in self.entries or item.content_hash in seen:
                continue
            if need + item.length > min(self.step_budget, room):
                return max(0, item.offset - start)
            need += item.length
            seen.add(item.content_hash)
        return n

    def commit_chunk(self, seq: Sequence, start: int, n: int, out: SchedulerOutput) -> None:
        """The chunk is scheduled (after fit_chunk said it fits): cached outputs it reads gain seq as a
        user first (so no allocation evicts them), then the others are allocated and listed for the
        worker to encode this step."""
        found, rid = self._chunk_items(seq, start, n), seq.request_id
        for k in found:
            if seq.mm_items[k].content_hash in self.entries:
                self.add_user(seq.mm_items[k].content_hash, rid)
        for k in found:
            item = seq.mm_items[k]
            if item.content_hash not in self.entries:
                self.allocate(item.content_hash, item.length, rid)
                self.step_budget -= item.length
                out.encoder_items.append((rid, k))

    def advance(self, seq: Sequence) -> None:
        """After a step: the images whose placeholders are all computed need their outputs no more."""
        items = seq.mm_items
        while seq.num_encoder_done < len(items) and items[seq.num_encoder_done].end <= seq.num_computed_tokens:
            self.release(items[seq.num_encoder_done].content_hash, seq.request_id)
            seq.num_encoder_done += 1

    def drop(self, seq: Sequence) -> None:
        """seq was preempted or ended: it needs none of its outputs (a resumed one starts over)."""
        self.release_request(seq.request_id, seq.mm_items)
        seq.num_encoder_done = 0

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
