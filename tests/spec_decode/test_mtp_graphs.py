"""The MTP layer's padded catch-up (what its CUDA graphs replay: spec_decode/mtp_graphs.py), run
eagerly on the CPU: every request's verified rows padded to 1 + K with rows that store no KV and
whose outputs are never read. It must draft exactly what the unpadded forward drafts, so the
engine's acceptance counts and output are the same; the graphs themselves run only on CUDA."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.loader.model_dir import DEMO_MODEL_DIR
from atom_core.spec_decode import mtp
from atom_core.spec_decode.draft_kv import DraftKV
from atom_core.spec_decode.mtp_graphs import padded_catch_up
from tests.spec_decode.mtp_models import build_tiny_deepseek_v3_mtp

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _padded_engine(path, monkeypatch, calls: list, **options) -> LLMEngine:
    engine = LLMEngine(str(path), method="mtp", **options)
    proposer = engine.core.executor.runner.proposer
    proposer.pad_catch_up = True
    original = mtp.padded_catch_up

    def counted(tokens_of, *args, **kwargs):
        calls.append(len(tokens_of))  # requests in the padded forward
        return original(tokens_of, *args, **kwargs)

    monkeypatch.setattr(mtp, "padded_catch_up", counted)
    return engine


def _run(engine, prompts, params=GREEDY):
    return [o["token_ids"] for o in engine.generate(prompts, params)], engine.spec_decode_stats()


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory):
    path = build_tiny_deepseek_v3_mtp(tmp_path_factory.mktemp("v3_mtp_graphs"))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(3, vocab, (5,), generator=g).tolist()
    return path, [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 9, 33)] + [motif * 6]


@pytest.mark.parametrize("k", [1, 3])
def test_tiny_v3_padded_catch_up_drafts_the_same(v3_mtp, monkeypatch, k):
    """MLA + MoE nextn layer (random: its drafts are rarely accepted, so most requests carry one real
    row and K padding rows; the demo model's test below mixes rows of 1 and 2)."""
    path, prompts = v3_mtp
    expected = _run(LLMEngine(str(path), method="mtp", num_speculative_tokens=k), prompts)
    calls = []
    assert _run(_padded_engine(path, monkeypatch, calls, num_speculative_tokens=k), prompts) == expected
    assert calls and max(calls) == len(prompts)  # decode steps of every request took the padded path
    assert expected[1]["num_drafts"] > 0


def test_demo_model_padded_catch_up_drafts_the_same(monkeypatch):
    """The trained layer (real acceptance: rows of 1 and 2 per request mix in one forward)."""
    from tests.spec_decode.test_mtp import DEMO_GREEDY, _demo_prompts

    prompts = _demo_prompts(8)
    expected = _run(LLMEngine(str(DEMO_MODEL_DIR), method="mtp", num_speculative_tokens=1), prompts, DEMO_GREEDY)
    calls = []
    engine = _padded_engine(DEMO_MODEL_DIR, monkeypatch, calls, num_speculative_tokens=1)
    assert _run(engine, prompts, DEMO_GREEDY) == expected
    assert calls and expected[1]["num_accepted_tokens"] > 0


def test_prefill_chunks_and_long_positions_stay_unpadded(v3_mtp, monkeypatch):
    """A step whose rows exceed 1 + K for some request (a prompt chunk), or whose padding would pass
    max_model_len, runs the unpadded forward."""
    path, prompts = v3_mtp
    calls = []
    engine = _padded_engine(path, monkeypatch, calls, num_speculative_tokens=2, max_model_len=40)
    proposer = engine.core.executor.runner.proposer
    assert not proposer._pads_catch_up([1, 3, 4], [5, 6, 7], 3)  # a request with 4 rows > q
    assert not proposer._pads_catch_up([1, 2], [10, 38], 3)  # 38 + 3 > max_model_len 40
    assert proposer._pads_catch_up([1, 3], [10, 37], 3)
    engine.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert calls  # its decode steps still padded


def test_padded_rows_layout():
    ids, rows, last = padded_catch_up([[7], [8, 9, 10], [11, 12]], [1, 3, 2], [0, 4, 20], q=3)
    assert ids == [7, 0, 0, 8, 9, 10, 11, 12, 0]
    assert rows == [0, 0, 0, 4, 5, 6, 20, 21, 21]  # padding repeats the request's last real row
    assert last == [0, 5, 7]
    with pytest.raises(AssertionError, match="1..q rows"):
        padded_catch_up([[1, 2, 3, 4]], [4], [0], q=3)


def test_padding_rows_store_no_kv_and_tables_cover_their_positions():
    kv = DraftKV([], block_size=4, max_num_seqs=1, device=torch.device("cpu"))
    positions, meta = kv.metadata([3, 3], [5, 2], [[7, 8], [9]], num_real=[2, 1])
    assert positions.tolist() == [5, 6, 7, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [8 * 4 + 1, 8 * 4 + 2, -1, 9 * 4 + 2, -1, -1]
    assert meta.seq_lens.tolist() == [8, 5] and meta.max_query_len == 3
    assert meta.block_tables.tolist() == [[7, 8], [9, 0]]  # seq_len 5 needs 2 blocks: padded with block 0


def test_the_option_parses_and_bad_values_fail_clearly(monkeypatch):
    from atom_core.config import EngineConfig
    from atom_core.envs import read_envs

    assert read_envs({}).mtp_graphs is None and EngineConfig.from_kwargs("m").kernel.mtp_graphs is False
    assert read_envs({"ATOM_MTP_GRAPHS": "1"}).mtp_graphs is True
    with pytest.raises(ValueError, match="ATOM_MTP_GRAPHS"):
        read_envs({"ATOM_MTP_GRAPHS": "maybe"})
    monkeypatch.setenv("ATOM_MTP_GRAPHS", "1")
    assert EngineConfig.from_kwargs("m").kernel.mtp_graphs is True
    assert EngineConfig.from_kwargs("m", mtp_graphs=False).kernel.mtp_graphs is False  # the keyword wins


def test_the_cpu_engine_captures_no_graphs(v3_mtp):
    """The option asks for graphs only where the engine captures them (CUDA): on the CPU it is inert."""
    engine = LLMEngine(str(v3_mtp[0]), method="mtp", num_speculative_tokens=2, mtp_graphs=True)
    assert engine.config.kernel.mtp_graphs
    proposer = engine.core.executor.runner.proposer
    assert proposer.graphs is None and not proposer.pad_catch_up


class _EagerGraph:
    """Stands in for one captured CUDA graph on the CPU: replay() reruns the runner's forward on
    its persistent input buffers with the metadata the capture saw, into the output slot a replay
    returns. So everything CUDAGraphRunner.replay does around the graph (copying the step into the
    buffers, padding rows and requests) runs for real; only the capture itself is not exercised."""

    def __init__(self, runner, bs: int):
        self.runner, self.bs = runner, bs

    def replay(self) -> None:
        from atom_core.model_ops.forward_context import set_attention_metadata

        r, tokens = self.runner, self.bs * self.runner.query_len
        with set_attention_metadata(r._metadata(self.bs)):
            r.outputs[self.bs] = r.forward(r.input_ids[:tokens], r.positions[:tokens])


def _capture_eagerly(runner) -> None:
    runner.graphs = {bs: _EagerGraph(runner, bs) for bs in runner.sizes}
    runner.capture_seconds = 0.0


@pytest.mark.parametrize("k", [1, 3])
def test_graph_replays_from_their_staging_draft_the_same(v3_mtp, monkeypatch, k):
    """MTPGraphs with its CUDAGraphRunner replaying eagerly (decode sizes to 16; graphs of up to
    16 / (1 + K) requests, as the verify graphs: 4 prompts fit at K = 3): same outputs and
    acceptance counts as the eager layer; one replay a step runs the catch-up and every later draft."""
    from atom_core.worker.cuda_graph import CUDAGraphRunner

    path, prompts = v3_mtp
    expected = _run(LLMEngine(str(path), method="mtp", num_speculative_tokens=k), prompts)
    monkeypatch.setattr(CUDAGraphRunner, "capture_all", _capture_eagerly)
    replays = []
    real_replay = CUDAGraphRunner.replay_staged
    monkeypatch.setattr(CUDAGraphRunner, "replay_staged", lambda self, size: replays.append(self.query_len)
                        or real_replay(self, size))
    engine = LLMEngine(str(path), method="mtp", num_speculative_tokens=k)
    runner = engine.core.executor.runner
    runner.proposer.capture_graphs((1, 2, 4, 8, 16), runner.dispatcher.capture_forward)
    assert _run(engine, prompts) == expected
    assert replays and set(replays) == {1 + k}
    runner.release_graphs()  # the runner's release reaches the proposer's graphs too
    assert runner.proposer.graphs is None and runner.proposer.graph_capture_seconds == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_graph_staging_equals_the_host_layout(seed):
    """_Staging.stage lays out a padded step with array operations: every field the graphs read
    equals what padded_catch_up, DraftKV.layout and later_layout give for the same requests
    (random counts, positions, tables and drafting masks), padding requests included."""
    from atom_core.spec_decode.draft_loop import later_layout
    from atom_core.spec_decode.mtp_graphs import PaddedStep, _Staging

    rng = np.random.default_rng(seed)
    k, block_size, max_bs, max_blocks = 3, 4, 8, 12
    q, num, padded = 1 + k, int(rng.integers(1, 6)), 6
    counts = rng.integers(1, q + 1, num).tolist()
    starts = rng.integers(0, 20, num).tolist()
    tables = [rng.choice(100, -(-(s + n) // block_size) + 2, replace=False).tolist() for s, n in zip(starts, counts)]
    tokens_of = [rng.integers(1, 50, n).tolist() for n in counts]
    first_rows = np.cumsum([0, *counts])[:-1].tolist()
    entries = sorted(rng.choice(num, int(rng.integers(1, num + 1)), replace=False).tolist())
    staging = _Staging(max_bs, q, k - 1, max_blocks, block_size, torch.device("cpu"))
    staging.stage(PaddedStep(counts, starts, first_rows, tables, [t for ts in tokens_of for t in ts], entries),
                  padded)
    ids, rows, last = padded_catch_up(tokens_of, counts, first_rows, q)
    kv = DraftKV([], block_size=block_size, max_num_seqs=1, device=torch.device("cpu"))
    host = kv.layout([q] * num, starts, tables, num_real=counts)
    mask = np.isin(np.arange(num), entries)
    later = later_layout(host["positions"][last], host["block_tables"], mask, k - 1, block_size)
    dev, n = staging.dev, num * q
    assert dev["ids"][:n].tolist() == ids and dev["rows"][:n].tolist() == rows and dev["last"][:num].tolist() == last
    for name in ("positions", "slot_mapping"):
        assert dev[name][:n].tolist() == host[name].tolist(), name
    assert dev["seq_lens"][:num].tolist() == host["seq_lens"].tolist()
    width = host["block_tables"].shape[1]
    assert dev["block_tables"][:num, :width].tolist() == host["block_tables"].tolist()
    assert not dev["block_tables"][:num, width:].any()
    assert dev["mask"][:num].tolist() == mask.tolist() and not dev["mask"][num:padded].any()
    for name in ("later_positions", "later_slots", "later_seq_lens"):
        assert dev[name][:, :num].tolist() == later[name].tolist(), name
    assert (dev["slot_mapping"][n:padded * q] == -1).all() and (dev["later_slots"][:, num:padded] == -1).all()
