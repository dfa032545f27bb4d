"""--method eagle3: an EAGLE-3 head in the public checkpoint layout drafts from the target's hidden states.

Tiny random Llama and Qwen3 targets with tiny random heads (fc, midlayer, norm, lm_head over a
smaller draft vocabulary, d2t / t2d): greedy output equals plain decoding through chunked
prefill, preemption and prefix caching; the drafts equal a dense recomputation of the head with
HF modules from HF's hidden states; sampling keeps the target's distribution (chi-square). Heads
that do not fit fail at start. The demo model ships a trained head: real acceptance, same output."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.config import EngineConfig
from atom_core.loader.model_dir import DEMO_MODEL_DIR
from tests.spec_decode.test_mtp import _demo_prompts
from tests.tiny_models import build_tiny_model

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
DEMO_HEAD = DEMO_MODEL_DIR / "eagle3"


def build_tiny_eagle3_head(path: Path, target: Path, draft_vocab: int, seed: int = 0, layer_ids=None,
                           own_embed: bool = False, norm_before_residual: bool = False, hidden: int | None = None,
                           vocab_map: bool = True) -> Path:
    """A random head for `target` in the public layout: draft ids map to a random sorted subset
    of draft_vocab target ids (d2t offsets, t2d mask)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    raw = json.loads((target / "config.json").read_text())
    vocab, target_hidden = raw["vocab_size"], raw["hidden_size"]
    hidden = hidden or target_hidden
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return 0.15 * torch.randn(*shape, generator=g)

    def norm():
        return 1 + 0.2 * torch.randn(hidden, generator=g)

    num_aux = len(layer_ids) if layer_ids else 3
    heads, kv, hd = 4, 2, hidden // 4
    w = {"fc.weight": rand(hidden, num_aux * target_hidden), "norm.weight": norm(),
         "lm_head.weight": rand(draft_vocab, hidden),
         "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
         "midlayer.post_attention_layernorm.weight": norm(),
         "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * hidden),
         "midlayer.self_attn.k_proj.weight": rand(kv * hd, 2 * hidden),
         "midlayer.self_attn.v_proj.weight": rand(kv * hd, 2 * hidden),
         "midlayer.self_attn.o_proj.weight": rand(hidden, heads * hd),
         "midlayer.mlp.gate_proj.weight": rand(96, hidden), "midlayer.mlp.up_proj.weight": rand(96, hidden),
         "midlayer.mlp.down_proj.weight": rand(hidden, 96)}
    if own_embed:
        w["embed_tokens.weight"] = rand(vocab, hidden)
    if vocab_map:
        used = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        w["d2t"] = used - torch.arange(draft_vocab)
        w["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        w["t2d"][used] = True
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(path))
    data = json.loads((path / "config.json").read_text())
    data.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                norm_before_residual=norm_before_residual)
    if layer_ids is not None:
        data["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    (path / "config.json").write_text(json.dumps(data, indent=2))
    return path


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    motif = torch.randint(3, vocab, (6,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 9, 40, 70)] + [motif * 5]


def _tokens(engine, prompts, params=GREEDY):
    return [o["token_ids"] for o in engine.generate(prompts, params)]


# Llama: 8 layers, EAGLE-3's default aux layers (2, 4, 5), the target's embedding.
# Qwen3: 4 layers, layers named in the head's config, its own embedding, norm before the residual.
TARGETS = {"llama": dict(num_layers=8, head=dict(draft_vocab=150)),
           "qwen3": dict(num_layers=4, head=dict(draft_vocab=200, layer_ids=(0, 1, 3), own_embed=True,
                                                 norm_before_residual=True))}


@pytest.fixture(scope="module", params=list(TARGETS))
def family(request, tmp_path_factory):
    """(target dir, head dir, prompts, plain greedy tokens) per target family."""
    spec = TARGETS[request.param]
    target = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, num_layers=spec["num_layers"])
    head = build_tiny_eagle3_head(tmp_path_factory.mktemp(f"{request.param}_eagle3"), target, **spec["head"])
    prompts = _prompts(json.loads((target / "config.json").read_text())["vocab_size"])
    return target, head, prompts, _tokens(LLMEngine(str(target)), prompts)


class TestTinyTargets:
    @pytest.mark.parametrize("options", [
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": 3},
        {"num_speculative_tokens": 3, "max_num_batched_tokens": 16},  # chunked prefill beside verify steps
        {"num_speculative_tokens": 2, "block_size": 4, "num_kv_blocks": 40, "max_model_len": 128},  # preemption
    ], ids=["k1", "k3", "k3-chunked", "k2-preempt"])
    def test_greedy_equals_plain(self, family, options):
        target, head, prompts, plain = family
        engine = LLMEngine(str(target), method="eagle3", draft_model=str(head), **options)
        assert _tokens(engine, prompts) == plain
        stats = engine.spec_decode_stats()
        assert stats["num_drafts"] > 0 and len(stats["accepted_per_position"]) == options["num_speculative_tokens"]
        assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
        if "num_kv_blocks" in options:
            assert engine.core.scheduler.num_preemptions > 0

    def test_prefix_cache_hits_keep_greedy_output(self, family):
        target, head, prompts, _ = family
        engine = LLMEngine(str(target), method="eagle3", draft_model=str(head), num_speculative_tokens=3,
                           block_size=4)
        outputs = _tokens(engine, prompts)
        followups = [p + o for p, o in zip(prompts, outputs)]
        expected = _tokens(LLMEngine(str(target), enable_prefix_caching=False), followups)
        before = engine.core.kv.num_hit_tokens
        assert _tokens(engine, followups) == expected
        assert engine.core.kv.num_hit_tokens - before > sum(len(p) for p in prompts) // 2

    def test_drafts_equal_the_head_recomputed_with_hf_modules(self, family):
        target, head, prompts, _ = family
        engine = LLMEngine(str(target), method="eagle3", draft_model=str(head), num_speculative_tokens=3,
                           dtype="float32", async_scheduling=False)
        prompt = prompts[2]
        [rid] = engine.add_request([prompt], GREEDY)
        engine.step()  # the prefill: one sampled token, then drafts for the next step
        seq = engine.core.scheduler.requests[rid]
        assert seq.draft_token_ids == _reference_drafts(target, head, prompt + seq.output_token_ids, 3)


def _reference_drafts(target: Path, head: Path, tokens: list[int], k: int) -> list[int]:
    """The head over the whole sequence, densely, with HF's Llama attention and MLP: row t reads
    fc(HF's hidden states entering the aux layers at t) and token t+1; later drafts append a row
    that reads the previous row's pre-norm output and the last draft."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRotaryEmbedding

    from atom_core.spec_decode.eagle3 import aux_layer_ids

    w = {n: t.float() for n, t in load_file(str(head / "model.safetensors")).items()}
    raw = json.loads((head / "config.json").read_text())
    config = AutoConfig.from_pretrained(str(head))
    main = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = aux_layer_ids(raw, main.config.num_hidden_layers)
    attn, mlp, rotary = LlamaAttention(config, 0), LlamaMLP(config), LlamaRotaryEmbedding(config)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, torch.nn.Linear(2 * config.hidden_size, w[f"midlayer.self_attn.{name}.weight"].shape[0],
                                            bias=False))
    attn.load_state_dict({n.removeprefix("midlayer.self_attn."): t for n, t in w.items()
                          if n.startswith("midlayer.self_attn.")})
    mlp.load_state_dict({n.removeprefix("midlayer.mlp."): t for n, t in w.items() if n.startswith("midlayer.mlp.")})
    embed = w.get("embed_tokens.weight", main.model.embed_tokens.weight)
    d2t = w["d2t"].long() if "d2t" in w else torch.zeros(w["lm_head.weight"].shape[0], dtype=torch.long)

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w[name]

    config._attn_implementation = "eager"
    with torch.no_grad():
        states = main(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # [i]: input of layer i
        fused = torch.cat([states[i][0] for i in ids], dim=-1) @ w["fc.weight"].T
        inputs = list(zip(fused[:-1], tokens[1:]))  # (g_t, token t+1) for t < n - 1
        drafts = []
        for _ in range(k):
            g = torch.stack([p for p, _ in inputs])
            e = rms(embed[torch.tensor([t for _, t in inputs])], "midlayer.input_layernorm.weight")
            normed = rms(g, "midlayer.hidden_norm.weight")
            residual = normed if raw.get("norm_before_residual") else g
            n = g.shape[0]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            x = torch.cat([e, normed], dim=-1)[None]
            a = attn(x, position_embeddings=rotary(x, positions), attention_mask=mask)[0][0]
            h = a + residual
            y = mlp(rms(h, "midlayer.post_attention_layernorm.weight")) + h
            d = int((rms(y[-1], "norm.weight") @ w["lm_head.weight"].T).argmax())
            drafts.append(d + int(d2t[d]))
            inputs.append((y[-1], drafts[-1]))
    return drafts


class TestDraftLoop:
    """The draft loop runs on the device (spec_decode/draft_loop.py): the catch-up and every later
    draft from one host-to-device copy, and in graphs as one replay a step."""

    def test_graph_replays_draft_the_same(self, family, monkeypatch):
        """The whole loop through MTPGraphs' CUDAGraphRunner replaying eagerly (the CPU stand-in of
        test_mtp_graphs): fc gathers the aux buffer in place, later drafts are masked for padding
        requests; outputs and acceptance counts equal the eager loop's."""
        from atom_core.worker.cuda_graph import CUDAGraphRunner
        from tests.spec_decode.test_mtp_graphs import _capture_eagerly

        target, head, prompts, plain = family
        options = dict(method="eagle3", draft_model=str(head), num_speculative_tokens=3)
        eager = LLMEngine(str(target), **options)
        expected = (_tokens(eager, prompts), eager.spec_decode_stats())
        monkeypatch.setattr(CUDAGraphRunner, "capture_all", _capture_eagerly)
        replays = []
        real_replay = CUDAGraphRunner.replay_staged
        monkeypatch.setattr(CUDAGraphRunner, "replay_staged", lambda self, size: replays.append(size * self.query_len)
                            or real_replay(self, size))
        engine = LLMEngine(str(target), **options)
        runner = engine.core.executor.runner
        runner.proposer.capture_graphs((1, 2, 4, 8, 16, 32), runner.dispatcher.capture_forward)
        assert (_tokens(engine, prompts), engine.spec_decode_stats()) == expected
        assert expected[0] == plain and replays and all(n % 4 == 0 for n in replays)

    def test_one_host_to_device_copy_a_step(self, family, monkeypatch):
        """No host metadata between the drafts: each proposing step lays out its catch-up once and
        stages everything in one packed copy, whatever K."""
        from atom_core.spec_decode import draft_kv, mtp

        target, head, prompts, _ = family
        engine = LLMEngine(str(target), method="eagle3", draft_model=str(head), num_speculative_tokens=4)
        calls = {"layout": 0, "copy": 0, "propose": 0}

        def counting(name, fn):
            def wrapped(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return wrapped

        monkeypatch.setattr(draft_kv.DraftKV, "layout", counting("layout", draft_kv.DraftKV.layout))
        monkeypatch.setattr(mtp, "to_device_packed", counting("copy", mtp.to_device_packed))
        monkeypatch.setattr(mtp.MTPProposer, "propose", counting("propose", mtp.MTPProposer.propose))
        _tokens(engine, prompts[:2])
        assert calls["propose"] > 2 and calls["layout"] == calls["copy"] == calls["propose"], calls

    def test_drafts_end_at_a_token_that_ends_the_request(self, monkeypatch):
        """The demo head drafts <|im_end|> after a short answer: no draft follows it (verifying one
        would be wasted), and on the CPU the loop stops there instead of running all K forwards."""
        from atom_core.spec_decode import eagle3

        engine = LLMEngine(str(DEMO_MODEL_DIR), method="eagle3", draft_model=str(DEMO_HEAD), num_speculative_tokens=4)
        proposer = engine.core.executor.runner.proposer
        eos = set(proposer.eos_token_ids)
        drafted, forwards = [], []
        real_propose, real_forward = eagle3.Eagle3Proposer.propose, eagle3.Eagle3Layer.forward_nextn

        def propose(self, states, target=None):
            before = len(forwards)
            out = real_propose(self, states, target)
            drafted.extend((d, len(forwards) - before) for d in out if d)
            return out

        monkeypatch.setattr(eagle3.Eagle3Proposer, "propose", propose)
        monkeypatch.setattr(eagle3.Eagle3Layer, "forward_nextn", lambda self, *a, **kw: forwards.append(1)
                            or real_forward(self, *a, **kw))
        prompts = _demo_prompts(6)
        plain = _tokens(LLMEngine(str(DEMO_MODEL_DIR)), prompts, DEMO_GREEDY)
        assert [_tokens(engine, [p], DEMO_GREEDY)[0] for p in prompts] == plain  # one request a step
        assert all(t not in eos for d, _ in drafted for t in d[:-1])
        cut = [(d, n) for d, n in drafted if d[-1] in eos and len(d) < 4]
        assert cut and all(n == len(d) for d, n in cut)  # the catch-up, then one forward a later draft

    def test_the_stop_rule_follows_the_scheduler(self, family):
        from atom_core.spec_decode.mtp import cut_at_stop
        from atom_core.worker.input_batch import RequestState

        target, head, _, _ = family
        proposer = LLMEngine(str(target), method="eagle3", draft_model=str(head),
                             num_speculative_tokens=3).core.executor.runner.proposer
        [eos] = list(proposer.eos_token_ids)[:1]

        def rule(**params):
            return proposer._stop_rule(RequestState("r", [5, 6], [7, 8], SamplingParams(**params)))

        assert cut_at_stop([9, eos, 9], rule()) == [9, eos]
        assert cut_at_stop([9, eos, 9], rule(ignore_eos=True)) == [9, eos, 9]
        assert cut_at_stop([9, 4, eos], rule(ignore_eos=True, stop_token_ids=[4])) == [9, 4]
        assert cut_at_stop([eos, 9, eos], rule(min_tokens=4)) == [eos, 9, eos]  # the 1st draft is output 3 of 4
        assert cut_at_stop([eos, eos, 9], rule(min_tokens=4)) == [eos, eos]

    def test_later_draft_rows_store_in_their_tables_or_nowhere(self):
        import numpy as np

        from atom_core.spec_decode.draft_loop import later_layout

        tables = np.array([[7, 8, 0], [9, 3, 5]], dtype=np.int32)
        later = later_layout(np.array([4, 8]), tables, np.array([True, False]), 2, block_size=4)
        assert later["later_positions"].tolist() == [[5, 0], [6, 1]]  # the masked row runs at positions j
        assert later["later_slots"].tolist() == [[8 * 4 + 1, -1], [8 * 4 + 2, -1]]  # and stores nothing
        assert later["later_seq_lens"].tolist() == [[6, 1], [7, 2]] and later["later_qsl"].tolist() == [0, 1, 2]
        assert later["later_slots"].dtype == np.int64 and later["later_seq_lens"].dtype == np.int32
        unmasked = later_layout(np.array([4, 8]), tables, None, 2, block_size=4)
        assert unmasked["later_slots"].tolist() == [[33, 5 * 4 + 1], [34, 5 * 4 + 2]]
        with pytest.raises(IndexError):  # a draft past the table (its scratch blocks) is a bug, not a wrap
            later_layout(np.array([11]), tables[:1], None, 2, block_size=4)


@pytest.fixture(scope="module")
def tiny_vocab_target(tmp_path_factory):
    """(target, head): a 4-layer Llama over 12 tokens, no tokenizer, and a head over 8 of them."""
    from tests.tiny_models import save_tiny_vocab_llama

    path = save_tiny_vocab_llama(tmp_path_factory.mktemp("tiny_vocab"), num_layers=4)
    head = build_tiny_eagle3_head(tmp_path_factory.mktemp("tiny_vocab_head"), path, draft_vocab=8, seed=2,
                                  layer_ids=(0, 2, 3))
    return path, head


def test_sampling_distribution_matches_plain_sampling(tiny_vocab_target):
    """Chi-square (contingency) on each of four tokens of 300 draws with and without EAGLE-3."""
    from scipy.stats import chi2_contingency

    target, head = tiny_vocab_target
    prompt = list(range(12)) * 2
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=4, ignore_eos=True)
    n = 300

    def draws(**options):
        engine = LLMEngine(str(target), max_num_seqs=n, max_num_batched_tokens=n * 30, **options)
        return [o["token_ids"] for o in engine.generate([prompt] * n, params)], engine.spec_decode_stats()

    plain, _ = draws()
    spec, stats = draws(method="eagle3", draft_model=str(head), num_speculative_tokens=2)
    assert stats["num_accepted_tokens"] > 40  # accepted drafts are exercised, not only rejections
    for position in range(4):
        table = np.zeros((2, 12))
        for row, outs in enumerate((plain, spec)):
            np.add.at(table[row], [o[position] for o in outs], 1)
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table).pvalue > 1e-3, (position, table)


class TestErrors:
    @pytest.fixture(scope="class")
    def target(self, tmp_path_factory):
        return build_tiny_model(tmp_path_factory.mktemp("err_target"), "llama", num_layers=8)

    def _start(self, target, head):
        return LLMEngine(str(target), method="eagle3", draft_model=str(head), num_speculative_tokens=2)

    def test_a_head_made_for_another_hidden_size_fails_at_start(self, target, tmp_path):
        other = build_tiny_model(tmp_path / "wide", "llama", num_layers=8)
        data = json.loads((other / "config.json").read_text())
        data["hidden_size"] = 96
        (other / "config.json").write_text(json.dumps(data))
        head = build_tiny_eagle3_head(tmp_path / "head", other, draft_vocab=50)
        with pytest.raises(ValueError, match="fc reads 288 features, but 3 aux layers of the target's hidden size 64"):
            self._start(target, head)

    def test_a_head_of_another_width_without_its_embedding_fails(self, target, tmp_path):
        head = build_tiny_eagle3_head(tmp_path / "head", target, draft_vocab=50, hidden=32)
        with pytest.raises(ValueError, match="hidden size 32 differs from the target's 64 and the head has no "
                                             "embed_tokens"):
            self._start(target, head)

    def test_a_vocabulary_map_outside_the_target_fails(self, target, tmp_path):
        from safetensors.torch import load_file, save_file

        head = build_tiny_eagle3_head(tmp_path / "head", target, draft_vocab=50)
        w = load_file(str(head / "model.safetensors"))
        w["d2t"][7] = 10_000
        save_file(w, str(head / "model.safetensors"))
        with pytest.raises(ValueError, match="d2t maps draft id 7 to target id 10007, outside the target's vocabulary"):
            self._start(target, head)

    def test_maps_that_disagree_fail(self, target, tmp_path):
        from safetensors.torch import load_file, save_file

        head = build_tiny_eagle3_head(tmp_path / "head", target, draft_vocab=50)
        w = load_file(str(head / "model.safetensors"))
        w["t2d"] = ~w["t2d"]
        save_file(w, str(head / "model.safetensors"))
        with pytest.raises(ValueError, match="the two maps disagree"):
            self._start(target, head)

    @pytest.mark.parametrize("change,match", [
        ({"architectures": ["LlamaForCausalLM"]}, r"is not an EAGLE-3 head; expected one of: LlamaForCausalLMEagle3"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 4, 8]}, r"aux hidden state layers \[1, 4, 8\] do not exist"),
        ({"draft_vocab_size": 60}, "lm_head has 50 rows, config.json draft_vocab_size 60"),
    ], ids=["architecture", "layers", "draft-vocab"])
    def test_bad_head_configs_fail_at_start(self, target, tmp_path, change, match):
        head = build_tiny_eagle3_head(tmp_path / "head", target, draft_vocab=50)
        data = json.loads((head / "config.json").read_text())
        data.update(change)
        (head / "config.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match):
            self._start(target, head)

    def test_the_default_layers_of_a_shallow_target_ask_for_explicit_ones(self, tmp_path):
        shallow = build_tiny_model(tmp_path / "shallow", "llama", num_layers=2)
        head = build_tiny_eagle3_head(tmp_path / "head", shallow, draft_vocab=50)
        with pytest.raises(ValueError, match="set eagle_aux_hidden_state_layer_ids"):
            self._start(shallow, head)

    def test_a_missing_vocabulary_map_for_a_smaller_draft_vocabulary_fails(self, target, tmp_path):
        head = build_tiny_eagle3_head(tmp_path / "head", target, draft_vocab=50, vocab_map=False)
        with pytest.raises(ValueError, match="draft vocabulary of 50 tokens without a d2t map"):
            self._start(target, head)

    @pytest.mark.parametrize("options,match", [
        ({"method": "eagle3", "num_speculative_tokens": 2}, "a draft model directory is required"),
        ({"method": "eagle3", "draft_model": "/d"},
         r"num_speculative_tokens=None \(--num-speculative-tokens\): required with method eagle3"),
        ({"method": "eagle3", "draft_model": "/d", "num_speculative_tokens": 9}, "between 1 and 8 for eagle3"),
    ])
    def test_bad_options(self, options, match):
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_kwargs("/m", **options)

    def test_a_directory_without_config_fails(self, target, tmp_path):
        with pytest.raises(ValueError, match="no config.json"):
            self._start(target, tmp_path)


# ---- the demo model's trained head ---------------------------------------------------------

DEMO_GREEDY = SamplingParams(temperature=0, max_tokens=16)
MIN_ACCEPTANCE = 0.85  # first-draft acceptance on the first 20 eval questions (95.5% measured; recipes/demo-model/eagle3.md)




class TestDemoModel:
    @pytest.fixture(scope="class")
    def plain(self):
        return _tokens(LLMEngine(str(DEMO_MODEL_DIR)), _demo_prompts(), DEMO_GREEDY)

    def test_greedy_equals_plain_with_real_acceptance(self, plain):
        engine = LLMEngine(str(DEMO_MODEL_DIR), method="eagle3", draft_model=str(DEMO_HEAD), num_speculative_tokens=3)
        assert _tokens(engine, _demo_prompts(), DEMO_GREEDY) == plain
        stats = engine.spec_decode_stats()
        rate = stats["accepted_per_position"][0] / stats["num_drafts"]
        assert rate >= MIN_ACCEPTANCE, stats

    def test_generate_command_reports_acceptance(self):
        from typer.testing import CliRunner

        from atomctl.main import app

        result = CliRunner().invoke(app, ["generate", "--method", "eagle3", "--draft-model", str(DEMO_HEAD),
                                          "--num-speculative-tokens", "3", "What is 12 + 30?"])
        assert result.exit_code == 0, result.output
        assert "42" in result.output and "[speculative: acceptance rate" in result.output

    def test_bench_latency_and_core_stats_report_acceptance(self, tmp_path):
        """The counters behind /metrics (CoreStats) and the bench report are the MTP path's own."""
        from typer.testing import CliRunner

        from atomctl.main import app

        out = tmp_path / "lat.json"
        result = CliRunner().invoke(app, ["bench", "latency", "--model", str(DEMO_MODEL_DIR), "--input-len", "24",
                                          "--output-len", "24", "--num-iters", "1", "--num-iters-warmup", "0",
                                          "--method", "eagle3", "--draft-model", str(DEMO_HEAD),
                                          "--num-speculative-tokens", "3", "--output-json", str(out)])
        assert result.exit_code == 0, result.output
        assert "spec decode acceptance rate" in result.output
        assert json.loads(out.read_text())["spec_decode"]["num_drafts"] > 0
        engine = LLMEngine(str(DEMO_MODEL_DIR), method="eagle3", draft_model=str(DEMO_HEAD), num_speculative_tokens=2)
        engine.generate(_demo_prompts(4), DEMO_GREEDY)
        stats, counters = engine.core.stats(), engine.spec_decode_stats()
        assert stats.spec_decode_num_drafts == counters["num_drafts"] > 0
        assert stats.spec_decode_num_accepted_tokens == counters["num_accepted_tokens"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCuda:
    @pytest.mark.parametrize("mtp_graphs", [False, True], ids=["head-eager", "head-graphs"])
    def test_tiny_targets_in_graphs_equal_plain(self, family, mtp_graphs):
        target, head, prompts, _ = family
        plain = _tokens(LLMEngine(str(target), dtype="float32", device="cuda"), prompts)
        engine = LLMEngine(str(target), dtype="float32", device="cuda", method="eagle3", draft_model=str(head),
                           num_speculative_tokens=3, mtp_graphs=mtp_graphs)
        assert _tokens(engine, prompts) == plain
        assert engine.spec_decode_stats()["num_drafts"] > 0
