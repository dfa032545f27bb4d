"""Scheduler and KV manager with drafts: 1 + k tokens budgeted and allocated, rejected slots
rolled back, block hashes only over verified tokens, acceptance counters. Fake tokens, real classes."""
from __future__ import annotations

from atom_core.config import SchedulerConfig
from atom_core.engine.kv_cache import KVCacheManager, hash_block
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.sequence import Sequence
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import ModelRunnerOutput

BS = 4


def make(num_blocks=32, budget=64, k=3):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, num_scheduler_steps=8)
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    return Scheduler(config, kv, 256, {0}, num_speculative_tokens=k), kv


def step(sched, tokens, drafts=None):
    out = sched.schedule()
    result = ModelRunnerOutput(out.req_ids, [list(t) for t in tokens], draft_token_ids=drafts or {})
    sched.update_from_output(out, result)
    return out


def test_verify_step_budgets_allocates_and_rolls_back():
    sched, kv = make()
    seq = Sequence("a", [10, 11, 12, 13, 14], SamplingParams(ignore_eos=True, max_tokens=50))
    sched.add(seq)
    step(sched, [[20]], drafts={0: [21, 22, 23]})  # prefill samples 20, proposes 3 drafts
    assert seq.num_computed_tokens == 5 and seq.draft_token_ids == [21, 22, 23]
    out = sched.schedule()
    assert out.num_scheduled_tokens == [1] and out.extra_tokens == [[21, 22, 23]] and out.has_drafts
    assert not out.is_decode_only and not out.is_window  # no window is planned under speculation
    assert len(seq.block_table) * BS >= 5 + 4  # pending token at 5, drafts at 6..8
    assert len(seq.block_table) == 3
    # one draft accepted (21), then 30 replaces 22
    sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[21, 30]]))
    assert seq.token_ids[5:] == [20, 21, 30] and seq.num_placeholders == 0
    assert seq.num_computed_tokens == 7  # 20 and 21 are in the cache; 30 is pending
    assert len(seq.block_table) == 2  # position 8's block went back
    assert kv.num_free_blocks == kv.num_blocks - 2
    assert sched.spec_stats.as_dict() == {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 1,
                                         "accepted_per_position": [1, 0, 0]}
    # hashed blocks cover verified tokens only: block 1 holds positions 4..7 = 14, 20, 21, 30 (30 not computed)
    assert seq.num_hashed_blocks == 1
    out = sched.schedule()  # no drafts came back: a plain decode of 30
    assert out.extra_tokens == [[]] and out.is_decode_only
    sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[31]]))
    assert seq.num_hashed_blocks == 2
    assert kv.blocks[seq.block_table[1]].block_hash == hash_block(hash_block(None, [10, 11, 12, 13]), [14, 20, 21, 30])


def test_drafts_are_cut_to_the_token_limit_and_budget():
    sched, _ = make(budget=3)
    seq = Sequence("a", [1, 2, 3], SamplingParams(ignore_eos=True, max_tokens=3))
    sched.add(seq)
    step(sched, [[5]], drafts={0: [6, 7, 8]})
    out = sched.schedule()
    assert out.extra_tokens == [[6]]  # 1 of 3 outputs so far: the step may add 2 tokens at most
    sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[6, 9]]))
    assert seq.is_finished and seq.output_token_ids == [5, 6, 9]


def test_all_accepted_and_stop_inside_the_run():
    sched, kv = make()
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=20))
    sched.add(seq)
    step(sched, [[5]], drafts={0: [6, 0, 8]})  # 0 is EOS
    out = sched.schedule()
    result = ModelRunnerOutput(out.req_ids, [[6, 0, 8, 9]])  # everything accepted, bonus 9
    sched.update_from_output(out, result)
    assert result.sampled == [[6, 0]] and seq.is_finished and seq.output_token_ids == [5, 6, 0]
    assert sched.spec_stats.num_accepted_tokens == 3
    assert kv.num_free_blocks == kv.num_blocks


def test_drafts_never_preempt_and_are_dropped_without_room():
    sched, kv = make(num_blocks=2)
    seq = Sequence("a", [1, 2, 3, 4, 5, 6], SamplingParams(ignore_eos=True, max_tokens=5))
    sched.add(seq)
    step(sched, [[7]], drafts={0: [8, 9, 10]})
    out = sched.schedule()  # positions 6..9 need a third block: none is free
    assert out.extra_tokens == [[]] and sched.num_preemptions == 0
