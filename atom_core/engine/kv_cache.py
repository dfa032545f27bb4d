"""Paged KV cache bookkeeping: a block pool, per-sequence block tables, prefix caching, and the
state slots of models with linear-attention layers.

Only host-side bookkeeping lives here; the KV and state tensors live in the model runner.
"""
from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import xxhash

from atom_core.engine.sequence import Sequence
from atom_core.multimodal.inputs import block_extra_keys

logger = logging.getLogger(__name__)


def hash_block(parent_hash: int | None, token_ids: list[int], extra_keys: tuple[tuple[int, int], ...] = ()) -> int:
    """xxhash64 of (parent hash, tokens, extra keys): a full block's hash covers every token before it.
    extra_keys: (content hash, offset) of each image with placeholders in the block
    (multimodal/inputs.py: block_extra_keys), whose tokens alone would not tell images apart."""
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(np.asarray(extra_keys, dtype=np.uint64).tobytes())
    return h.intdigest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class KVCacheManager:
    """Allocates fixed-size KV blocks to sequences; shares full blocks by content hash.

    Contract:
    - A block is free when ref_count == 0. Free blocks sit in an LRU queue (oldest first);
      a free block that still holds a cached hash can be revived by a prefix hit until the
      queue hands it out again, which evicts its hash.
    - `allocate` is called once per scheduling of a sequence that holds no blocks; it reuses
      cached prefix blocks and sets `seq.num_computed_tokens` past them.
    - `append_slots` grows a running sequence's table to hold `num_tokens` KV entries.
    - `trim_slots` gives back a running sequence's trailing blocks (KV rollback).
    - `free` releases all of a sequence's blocks (finish, abort, preemption).
    - `cache_full_blocks` registers the hashes of blocks whose tokens are all computed.
    - With num_state_slots > 0 (a model with linear-attention layers: a fixed-size state per
      sequence, kv_spec.StateSpec) `allocate` also gives the sequence a state slot
      (`seq.state_slot`), `can_allocate` needs a free one, and `free` returns it. Such a state
      covers every token before it and cannot be restored at a block boundary, so these models
      reuse no cached prefix: prefix caching is off for them (said once at start).
    Not thread-safe: the engine core's loop is its only caller.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0):
        self.block_size = block_size
        self.num_blocks = num_blocks
        if enable_prefix_caching and num_state_slots:
            logger.warning("prefix caching is off: this model has linear-attention layers, whose per-sequence "
                           "state cannot be restored at a cached block boundary (--enable-prefix-caching has "
                           "no effect for it)")
        self.enable_prefix_caching = enable_prefix_caching and not num_state_slots
        self.num_state_slots = num_state_slots
        self.free_state_slots: deque[int] = deque(range(num_state_slots))
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.block_hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---- queries ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_free_state_slots(self) -> int:
        return len(self.free_state_slots)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache ------------------------------------------------------------
    def _full_block_hashes(self, seq: Sequence, upto_tokens: int) -> list[int]:
        """Hashes of the full blocks within the first `upto_tokens` tokens (memoised per seq)."""
        hashes = self.block_hashes.setdefault(seq.request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= upto_tokens:
            i = len(hashes)
            extra = block_extra_keys(seq.mm_items, i * bs, (i + 1) * bs) if seq.mm_items else ()
            hashes.append(hash_block(hashes[-1] if hashes else seq.block_hash_seed, seq.token_ids[i * bs : (i + 1) * bs],
                                     extra))
        return hashes[: upto_tokens // bs]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix; at least one token is always left to compute."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []  # prompt logprobs need logits at every prompt position
        hit: list[int] = []
        for h in self._full_block_hashes(seq, seq.num_tokens - 1):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # ---- allocation --------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed (hits counted as free)."""
        if self.num_state_slots and not self.free_state_slots:
            return False
        hit = self._cached_prefix(seq)
        revivable = sum(1 for b in hit if self.blocks[b].ref_count == 0)
        total = self.blocks_needed(len(hit) * self.block_size + num_new_tokens)
        return total - len(hit) <= self.num_free_blocks - revivable

    def allocate(self, seq: Sequence, num_new_tokens: int) -> int:
        """Give `seq` its cached prefix plus room for `num_new_tokens`; returns cached tokens.

        num_new_tokens is capped by the caller to what the step computes after the hit, so
        the caller asks `get_prefix_hit_tokens` first to size the chunk.
        """
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hit = self._cached_prefix(seq)
        for block_id in hit:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        seq.block_table = list(hit)
        seq.num_hashed_blocks = len(hit)
        num_cached = len(hit) * self.block_size
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += num_cached
        seq.num_computed_tokens = num_cached
        self.append_slots(seq, num_cached + num_new_tokens)
        if self.num_state_slots:
            assert seq.state_slot < 0, f"{seq.request_id} already holds state slot {seq.state_slot}"
            seq.state_slot = self.free_state_slots.popleft()
        return num_cached

    def get_prefix_hit_tokens(self, seq: Sequence) -> int:
        return len(self._cached_prefix(seq)) * self.block_size

    def can_append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold KV for its first `num_tokens` tokens."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        assert need <= self.num_free_blocks, "append_slots without a successful can_append_slots"
        for _ in range(need):
            seq.block_table.append(self._pop_free_block())

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the least recently used cached block
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def trim_slots(self, seq: Sequence, num_tokens: int) -> int:
        """Give back `seq`'s trailing blocks beyond its first `num_tokens` KV entries (slots of
        rejected draft tokens); returns how many blocks went back. Blocks whose hash is
        published stay: their content is shared."""
        keep = max(self.blocks_needed(num_tokens), seq.num_hashed_blocks)
        tail = seq.block_table[keep:]
        del seq.block_table[keep:]
        self._release(tail)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        seq.num_sent_blocks = min(seq.num_sent_blocks, keep)
        return len(tail)

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks and state slot; its tail blocks become the first to be evicted."""
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):  # the tail is the least likely to be hit again
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def forget(self, seq: Sequence) -> None:
        """Drop per-request memo state once the request is gone for good."""
        self.block_hashes.pop(seq.request_id, None)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of `seq`'s blocks whose tokens are now all computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = self._full_block_hashes(seq, num_full * self.block_size)
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block.block_hash = hashes[i]
            self.cached.setdefault(hashes[i], block.block_id)
        seq.num_hashed_blocks = num_full

    def reset_prefix_cache(self) -> int:
        """Forget the content of every free block, so no later request hits what earlier ones
        computed (e.g. a benchmark repeating its workload); blocks in use keep their hashes.
        Returns how many cached blocks were dropped."""
        dropped = 0
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
                dropped += 1
        return dropped

    def reset_counters(self) -> None:
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
