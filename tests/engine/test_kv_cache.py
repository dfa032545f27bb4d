"""KVCacheManager: block accounting, prefix reuse, LRU eviction, ref counts, chained hashes.

Host-side bookkeeping only, so these run on the real class with plain Sequences (no model).
Every test ends by freeing its sequences and checking the pool is whole again.
"""
from __future__ import annotations

import pytest

from atom_core.engine.kv_cache import KVCacheManager, hash_block
from atom_core.engine.sequence import Sequence
from atom_core.sampling_params import SamplingParams

BS = 4  # tokens per block


def make_seq(rid: str, token_ids: list[int]) -> Sequence:
    return Sequence(rid, list(token_ids), SamplingParams(max_tokens=4))


def run_prefill(kv: KVCacheManager, seq: Sequence) -> int:
    """Allocate `seq` whole, mark every token computed, publish its full blocks; returns hits."""
    hit = kv.get_prefix_hit_tokens(seq)
    assert kv.can_allocate(seq, seq.num_tokens - hit)
    num_cached = kv.allocate(seq, seq.num_tokens - hit)
    assert num_cached == hit
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return num_cached


def release(kv: KVCacheManager, *seqs: Sequence) -> None:
    for seq in seqs:
        kv.free(seq)
        kv.forget(seq)
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    assert all(b.ref_count == 0 for b in kv.blocks)


@pytest.fixture
def kv():
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    yield manager
    assert manager.num_free_blocks == manager.num_blocks, "a test left blocks allocated"


class TestBlockAccounting:
    def test_free_blocks_return_to_total_after_alloc_append_free(self, kv):
        seq = make_seq("a", range(10))
        run_prefill(kv, seq)
        assert seq.block_table and len(seq.block_table) == 3
        assert kv.num_free_blocks == kv.num_blocks - 3
        for t in range(3):  # decode: grow to 13 tokens -> a fourth block
            seq.token_ids.append(100 + t)
            assert kv.can_append_slots(seq, seq.num_tokens)
            kv.append_slots(seq, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens
            kv.cache_full_blocks(seq)
        assert len(seq.block_table) == 4
        assert kv.num_used_blocks == 4
        release(kv, seq)

    def test_cannot_allocate_past_the_pool(self):
        kv = KVCacheManager(num_blocks=2, block_size=BS)
        seq = make_seq("a", range(9))  # needs 3 blocks
        assert not kv.can_allocate(seq, 9)
        assert kv.can_allocate(seq, 8)
        assert not kv.can_append_slots(seq, 9)
        assert kv.num_free_blocks == 2

    def test_block_ids_are_unique_across_sequences(self, kv):
        seqs = [make_seq(str(i), [i * 100 + t for t in range(7)]) for i in range(4)]
        for s in seqs:
            run_prefill(kv, s)
        ids = [b for s in seqs for b in s.block_table]
        assert len(ids) == len(set(ids)) == 8
        release(kv, *seqs)


class TestPrefixReuse:
    def test_second_request_reuses_the_three_shared_prefix_blocks(self, kv):
        prefix = list(range(1, 13))  # exactly 3 full blocks
        a = make_seq("a", prefix + [50, 51])
        b = make_seq("b", prefix + [60, 61, 62])
        assert run_prefill(kv, a) == 0
        assert kv.num_hit_tokens == 0
        assert kv.get_prefix_hit_tokens(b) == 12
        assert run_prefill(kv, b) == 12
        assert b.block_table[:3] == a.block_table[:3]
        assert b.block_table[3] != a.block_table[3]  # the diverging block is private
        assert kv.num_hit_tokens == 12
        assert kv.num_queried_tokens == a.num_tokens + b.num_tokens
        assert kv.prefix_hit_rate == pytest.approx(12 / (14 + 15))
        # shared blocks cost nothing: 4 blocks for a, 1 new one for b
        assert kv.num_used_blocks == 5
        release(kv, a, b)

    def test_cache_salts_keep_their_blocks_apart(self, kv):
        """Only a request with the same salt (or none with none) reuses a prefix; a salt also parts
        requests of one adapter (the salt and the adapter both seed the hash chain)."""
        prefix = list(range(1, 13))

        def salted(rid, salt):
            return Sequence(rid, prefix + [50], SamplingParams(max_tokens=4, cache_salt=salt))

        seqs = [salted("a", "tenant-a"), salted("b", "tenant-b"), salted("n", None), salted("a2", "tenant-a"),
                salted("n2", None)]
        assert [run_prefill(kv, seq) for seq in seqs] == [0, 0, 0, 12, 12]
        assert len({seq.block_hash_seed for seq in seqs[:3]}) == 3 and seqs[2].block_hash_seed is None
        release(kv, *seqs)

    def test_reset_forgets_free_blocks_but_keeps_running_ones(self, kv):
        prefix = list(range(1, 13))
        a, b = make_seq("a", prefix + [50]), make_seq("b", [7] * 8 + [1])
        run_prefill(kv, a)
        run_prefill(kv, b)
        kv.free(a)  # a finishes; b keeps running
        kv.forget(a)
        assert kv.reset_prefix_cache() == 3  # a's three full blocks
        assert kv.get_prefix_hit_tokens(make_seq("a2", prefix + [50])) == 0
        assert kv.get_prefix_hit_tokens(make_seq("b2", [7] * 8 + [2])) == 8  # b's blocks are in use
        release(kv, b)

    def test_prefix_blocks_are_revived_after_the_first_request_ends(self, kv):
        prefix = list(range(1, 13))
        a = make_seq("a", prefix + [50])
        run_prefill(kv, a)
        a_blocks = list(a.block_table)
        release(kv, a)
        b = make_seq("b", prefix + [70, 71])
        assert run_prefill(kv, b) == 12
        assert b.block_table[:3] == a_blocks[:3]
        assert kv.num_free_blocks == kv.num_blocks - 4
        release(kv, b)

    def test_allocate_sets_computed_tokens_past_the_hit(self, kv):
        prefix = list(range(1, 9))
        a = make_seq("a", prefix + [9])
        run_prefill(kv, a)
        b = make_seq("b", prefix + [30, 31, 32])
        kv.allocate(b, 3)
        assert b.num_computed_tokens == 8
        assert len(b.block_table) == 3  # two shared + one for the 3 new tokens
        release(kv, a, b)

    def test_no_reuse_when_prefix_caching_is_off(self):
        kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
        prefix = list(range(1, 13))
        a, b = make_seq("a", prefix + [1]), make_seq("b", prefix + [2])
        run_prefill(kv, a)
        assert run_prefill(kv, b) == 0
        assert not set(a.block_table) & set(b.block_table)
        release(kv, a, b)

    def test_prompt_logprobs_requests_skip_the_cache(self, kv):
        prefix = list(range(1, 13))
        a = make_seq("a", prefix + [1])
        run_prefill(kv, a)
        b = Sequence("b", prefix + [2], SamplingParams(prompt_logprobs=1))
        assert kv.get_prefix_hit_tokens(b) == 0
        release(kv, a)

    def test_can_allocate_counts_free_cached_hit_blocks_once(self):
        kv = KVCacheManager(num_blocks=4, block_size=BS)
        a = make_seq("a", range(1, 9))  # blocks 0, 1 hashed
        run_prefill(kv, a)
        release(kv, a)
        fits = make_seq("b", list(range(1, 9)) + list(range(20, 28)))  # 2 hit + 2 new = 4 blocks
        assert kv.can_allocate(fits, 8)
        too_big = make_seq("c", list(range(1, 9)) + list(range(20, 29)))  # 2 hit + 3 new = 5 blocks
        assert not kv.can_allocate(too_big, 9)
        run_prefill(kv, fits)
        assert kv.num_free_blocks == 0
        release(kv, fits)


class TestFullHit:
    @pytest.mark.parametrize("extra", [0, 1, 3])
    def test_identical_prompt_still_computes_at_least_one_token(self, kv, extra):
        tokens = list(range(1, 13 + extra))
        a = make_seq("a", tokens)
        run_prefill(kv, a)
        b = make_seq("b", tokens)
        hit = kv.get_prefix_hit_tokens(b)
        assert 0 < hit < b.num_tokens
        # the hit covers every full block that ends before the last token
        assert hit == ((b.num_tokens - 1) // BS) * BS
        kv.allocate(b, b.num_tokens - hit)
        assert b.num_computed_tokens == hit
        assert b.num_tokens - b.num_computed_tokens >= 1
        release(kv, a, b)


class TestRefCounts:
    def test_two_sharers_hold_the_shared_blocks_until_both_free(self, kv):
        prefix = list(range(1, 13))
        a, b = make_seq("a", prefix + [1]), make_seq("b", prefix + [2])
        run_prefill(kv, a)
        run_prefill(kv, b)
        shared = a.block_table[:3]
        assert [kv.blocks[i].ref_count for i in shared] == [2, 2, 2]
        assert kv.blocks[a.block_table[3]].ref_count == 1
        assert kv.blocks[b.block_table[3]].ref_count == 1
        used = kv.num_used_blocks
        kv.free(a)
        assert [kv.blocks[i].ref_count for i in shared] == [1, 1, 1]
        assert all(i not in kv.free_queue for i in shared)
        assert kv.num_used_blocks == used - 1  # only a's private tail block came back
        kv.free(b)
        assert [kv.blocks[i].ref_count for i in shared] == [0, 0, 0]
        assert all(i in kv.free_queue for i in shared)
        release(kv, a, b)

    def test_double_free_is_caught(self, kv):
        a = make_seq("a", range(1, 6))
        run_prefill(kv, a)
        table = list(a.block_table)
        kv.free(a)
        a.block_table = table
        with pytest.raises(AssertionError, match="freed twice"):
            kv.free(a)
        a.block_table = []


class TestLruEviction:
    def _hit_blocks(self, kv: KVCacheManager, tokens: list[int]) -> int:
        probe = make_seq(f"probe-{tokens[0]}-{len(kv.block_hashes)}", tokens + [999])
        hit = kv.get_prefix_hit_tokens(probe) // BS
        kv.forget(probe)  # hashes are memoised per request id
        return hit

    def test_oldest_freed_is_evicted_first_and_tail_before_head(self):
        kv = KVCacheManager(num_blocks=4, block_size=BS)
        a_tokens, b_tokens = list(range(1, 9)), list(range(101, 109))
        a, b = make_seq("a", a_tokens), make_seq("b", b_tokens)
        run_prefill(kv, a)
        run_prefill(kv, b)
        a_head, a_tail = a.block_table
        b_head, b_tail = b.block_table
        kv.free(a)  # a freed first: its blocks are the oldest
        kv.free(b)
        release_order = list(kv.free_queue)
        assert release_order == [a_tail, a_head, b_tail, b_head]
        assert self._hit_blocks(kv, a_tokens) == 2 and self._hit_blocks(kv, b_tokens) == 2

        others = []
        expected_after = [(1, 2), (0, 2), (0, 1), (0, 0)]  # cached blocks left of (a, b)
        for k, (want_a, want_b) in enumerate(expected_after):
            seq = make_seq(f"x{k}", [500 + 10 * k + t for t in range(3)])  # one fresh block each
            run_prefill(kv, seq)
            assert seq.block_table == [release_order[k]]
            others.append(seq)
            assert self._hit_blocks(kv, a_tokens) == want_a, f"after {k + 1} evictions"
            assert self._hit_blocks(kv, b_tokens) == want_b, f"after {k + 1} evictions"
        for s in others:
            kv.free(s)
            kv.forget(s)
        kv.forget(a)
        kv.forget(b)
        assert kv.num_free_blocks == kv.num_blocks

    def test_never_used_blocks_go_before_cached_ones(self, kv):
        a = make_seq("a", range(1, 9))
        run_prefill(kv, a)
        release(kv, a)
        b = make_seq("b", range(200, 240))  # 10 blocks: fits in the 14 never-used ones
        run_prefill(kv, b)
        assert self._hit_blocks(kv, list(range(1, 9))) == 2
        release(kv, b)

    def test_revived_block_leaves_the_free_queue(self):
        kv = KVCacheManager(num_blocks=4, block_size=BS)
        a = make_seq("a", range(1, 9))
        run_prefill(kv, a)
        a_blocks = list(a.block_table)
        kv.free(a)
        b = make_seq("b", list(range(1, 9)) + [77])
        assert run_prefill(kv, b) == 8  # revives a's two blocks, takes one fresh
        assert b.block_table[:2] == a_blocks
        c = make_seq("c", [300, 301, 302])
        run_prefill(kv, c)  # must not steal a revived block
        assert not set(c.block_table) & set(b.block_table)
        assert kv.num_free_blocks == 0
        kv.forget(a)
        release(kv, b, c)


class TestChainedHashes:
    def test_same_block_after_different_prefixes_hashes_differently(self):
        block = [7, 8, 9, 10]
        h1 = hash_block(hash_block(None, [1, 2, 3, 4]), block)
        h2 = hash_block(hash_block(None, [5, 6, 7, 8]), block)
        assert h1 != h2
        assert h1 != hash_block(None, block)
        assert h1 == hash_block(hash_block(None, [1, 2, 3, 4]), list(block))  # deterministic

    def test_hash_covers_token_order_and_values(self):
        assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [2, 1, 3, 4])
        assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])

    def test_identical_second_block_after_a_different_first_block_is_not_a_hit(self, kv):
        shared_second = [40, 41, 42, 43]
        a = make_seq("a", [1, 2, 3, 4] + shared_second + [0])
        b = make_seq("b", [9, 9, 9, 9] + shared_second + [0])
        run_prefill(kv, a)
        assert kv.get_prefix_hit_tokens(b) == 0
        assert run_prefill(kv, b) == 0
        assert kv.block_hashes["a"][1] != kv.block_hashes["b"][1]
        assert not set(a.block_table) & set(b.block_table)
        release(kv, a, b)
