"""Images in the engine core, host side only: EncoderCacheManager's accounting, the scheduler's encoder
budget (a chunk stops before an image the step cannot encode; each image is encoded once, in the step its
first placeholder runs), and image hashes in the prefix-cache block hashes."""
from __future__ import annotations

import numpy as np
import pytest

from atom_core.config import SchedulerConfig
from atom_core.engine.encoder_cache import EncoderCacheManager
from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.sequence import Sequence
from atom_core.multimodal.inputs import MultimodalItem, block_extra_keys, check_items, content_hash
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import ModelRunnerOutput

IMAGE_ID = 7


def item(offset: int, length: int, seed: int) -> MultimodalItem:
    data = {"pixels": np.full((2, 2, 3), seed, dtype=np.uint8)}
    return MultimodalItem(offset, length, content_hash("test", data), data)


def seq_with(rid: str, layout: list, max_tokens: int = 2) -> Sequence:
    """layout: ints are text tokens, (length, seed) an image's placeholder run."""
    tokens, items = [], []
    for part in layout:
        if isinstance(part, tuple):
            items.append(item(len(tokens), part[0], part[1]))
            tokens += [IMAGE_ID] * part[0]
        else:
            tokens.append(part)
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens), mm_items=tuple(items))


def make_sched(budget: int, max_image_tokens: int = 0, num_blocks: int = 64, prefix_caching: bool = False):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, num_scheduler_steps=1)
    return Scheduler(config, kv, 512, {0}, max_image_tokens=max_image_tokens)


def run_step(sched: Scheduler):
    out = sched.schedule()
    sched.advance(out)
    sampled = [[5] if sched.requests[r].num_placeholders else [] for r in out.req_ids]
    sched.resolve(out, ModelRunnerOutput(out.req_ids, sampled))
    return out


class TestEncoderCacheManager:
    def test_evicts_only_entries_without_users_least_recent_first(self):
        cache = EncoderCacheManager(10)
        cache.allocate(1, 4, "a")
        cache.allocate(2, 4, "b")
        assert not cache.can_allocate(4)  # both in use
        cache.release(1, "a")
        cache.release(2, "b")
        cache.add_user(1, "c")  # 1 is used again (and most recent)
        cache.release(1, "c")
        assert cache.can_allocate(6)
        cache.allocate(3, 6, "d")
        assert cache.take_freed() == [2] and cache.is_cached(1) and cache.num_used == 10
        assert cache.take_freed() == []

    def test_reset_drops_unused_entries(self):
        cache = EncoderCacheManager(10)
        cache.allocate(1, 4, "a")
        cache.allocate(2, 4, "b")
        cache.release(2, "b")
        assert cache.reset() == [2] and cache.is_cached(1) and not cache.is_cached(2)


class TestSchedulerEncoderBudget:
    def test_image_is_encoded_once_across_chunks_and_released_after_its_last_placeholder(self):
        sched = make_sched(budget=8, max_image_tokens=12)
        seq = seq_with("r0", [1, 2, (12, 1), 3, 4])
        sched.add(seq)
        outs = [run_step(sched) for _ in range(2)]  # 16 prompt tokens in chunks of 8
        assert [o.num_scheduled_tokens for o in outs] == [[8], [8]]
        assert [o.encoder_items for o in outs] == [[("r0", 0)], []]
        entry = sched.encoder.entries[seq.mm_items[0].content_hash]
        assert entry.users == set() and seq.num_encoder_done == 1  # passed: kept, evictable

    def test_chunk_stops_before_an_image_the_step_cannot_encode(self):
        """Two requests each with a 10-token image; a step encodes 16 rows (max_num_batched_tokens), so r1's
        chunk of the 4 tokens left stops before its image."""
        sched = make_sched(budget=16)
        sched.add(seq_with("r0", [1, (10, 1), 2]))
        sched.add(seq_with("r1", [3, (10, 2), 5]))
        out = run_step(sched)
        assert out.encoder_items == [("r0", 0)]
        assert out.num_scheduled_tokens == [12, 1]
        out = run_step(sched)
        assert ("r1", 0) in out.encoder_items

    def test_same_image_in_two_requests_is_encoded_once(self):
        sched = make_sched(budget=64)
        a, b = seq_with("r0", [1, (10, 1), 2]), seq_with("r1", [3, (10, 1), 4, 5])
        sched.add(a)
        sched.add(b)
        out = run_step(sched)
        assert out.encoder_items == [("r0", 0)] and out.num_scheduled_tokens == [12, 13]
        assert sched.encoder.entries[a.mm_items[0].content_hash].users == set()

    def test_preempted_request_gives_up_its_outputs(self):
        sched = make_sched(budget=8, max_image_tokens=12)
        seq = seq_with("r0", [1, (12, 1), 2, 3])
        sched.add(seq)
        run_step(sched)
        h = seq.mm_items[0].content_hash
        assert sched.encoder.entries[h].users == {"r0"}
        sched.running.remove(seq)
        sched._preempt(seq)
        assert sched.encoder.entries[h].users == set() and seq.num_encoder_done == 0

    def test_finished_requests_free_their_hold_and_freed_hashes_reach_the_worker(self):
        sched = make_sched(budget=16)
        sched.add(seq_with("r0", [1, (12, 1), 2]))
        while sched.has_unfinished():
            run_step(sched)
        sched.add(seq_with("r1", [1, (16, 2)]))  # needs all 16 rows: evicts r0's image
        out = run_step(sched)
        assert out.encoder_items == [("r1", 0)] and len(out.freed_encoder_hashes) == 1


class TestPrefixCacheKeys:
    def test_same_image_reuses_blocks_and_a_different_image_never_does(self):
        kv = KVCacheManager(32, 4, enable_prefix_caching=True)
        first = seq_with("a", [1, 2, (8, 1), 3, 4, 5, 6, 7])
        kv.allocate(first, first.num_tokens)
        first.num_computed_tokens = first.num_tokens
        kv.cache_full_blocks(first)
        same, other = seq_with("b", [1, 2, (8, 1), 3, 4, 5, 6, 7]), seq_with("c", [1, 2, (8, 2), 3, 4, 5, 6, 7])
        assert same.token_ids == other.token_ids
        assert kv.get_prefix_hit_tokens(same) == 12
        assert kv.get_prefix_hit_tokens(other) == 0  # the image's first block already differs
        text = Sequence("d", [1, 2, 3, 4, 5], SamplingParams())
        assert block_extra_keys(first.mm_items, 0, 4) == ((first.mm_items[0].content_hash, 2),)
        assert block_extra_keys(first.mm_items, 12, 16) == () and not text.mm_items


class TestItems:
    def test_content_hash_covers_every_array_and_its_layout(self):
        a = {"pixels": np.zeros((2, 3), np.uint8)}
        assert content_hash("f", a) == content_hash("f", {"pixels": np.zeros((2, 3), np.uint8)})
        assert content_hash("f", a) != content_hash("g", a)
        assert content_hash("f", a) != content_hash("f", {"pixels": np.zeros((3, 2), np.uint8)})
        assert content_hash("f", a) != content_hash("f", {"pixels": np.zeros((2, 3), np.int8)})

    @pytest.mark.parametrize("items", [[(0, 0)], [(4, 4)], [(2, 2), (3, 1)]], ids=["empty", "past_end", "overlap"])
    def test_bad_placeholder_runs_are_refused(self, items):
        with pytest.raises(ValueError, match="placeholder tokens"):
            check_items([item(o, n, 0) for o, n in items], 6)
