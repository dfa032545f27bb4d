"""Multi-token prediction (MTP): the checkpoint's own "nextn" layer drafts the next tokens.

Layout (DeepSeek-V3's, also GLM-4.5's): layer index N = num_hidden_layers holds `enorm`,
`hnorm`, `eh_proj` [H, 2H], `shared_head.norm`, `shared_head.head`, its own `embed_tokens`, and
a full decoder block of the family (for DeepSeek-V3 the MLA + MoE block). At position t it reads
the target's final hidden state h_t and the token t+1, and predicts token t+2:

    y_t = shared_head.norm(block(eh_proj(cat(enorm(embed(token_{t+1})), hnorm(h_t)))))

h_t is what the target model returns: after its final norm. That is what the checkpoints were
trained on (DeepSeek's own modeling code hands the normed hidden states to the MTP module, whose
`hnorm` was fit on them), and what ATOM feeds. k > 1 drafts run the same layer again, one
position further, feeding its own normed output y in place of h (ATOM and vLLM also run one layer
k times; the checkpoints train one step only, so later drafts are weaker). When the checkpoint
lacks the layer's `embed_tokens` or `shared_head.head` (the demo model ships neither), the
target's embedding and LM head serve (they are copies of them in DeepSeek-V3).

Every verified position of the target gets its MTP row, prefill chunks included, so the layer's
attention sees the whole context: its KV lives in its own cache on the target's block tables
(spec_decode/draft_kv.py), written when the step that computed the position resolves.
Positions a prefix-cache hit skipped keep the MTP KV that the request which computed those
blocks wrote (the last row of such a block paired that request's next token: drafts may be a
little worse there, never the output). Drafts are greedy (a point mass, which the rejection
sampler verifies exactly at any temperature). A step's catch-up and later drafts run on the device
from one host-to-device copy, with one host sync for the drafts (spec_decode/draft_loop.py), and
with --mtp-graphs as one CUDA graph replay (spec_decode/mtp_graphs.py).
"""
from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from atom_core.model_ops.embed_head import LMHead, VocabEmbedding
from atom_core.model_ops.forward_context import set_attention_metadata
from atom_core.model_ops.kv_spec import attention_layers
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.linear import ReplicatedLinear
from atom_core.model_ops.staging import to_device_packed
from atom_core.spec_decode.draft_kv import NUM_SCRATCH_BLOCKS, DraftKV, device_metadata
from atom_core.spec_decode.draft_loop import LATER_KEYS, CatchUp, later_layout, run_drafts
from atom_core.spec_decode.mtp_graphs import MTPGraphs, PaddedStep, padded_catch_up
from atom_core.spec_decode.proposer import CaptureGraphs, Proposer, RequestView, TargetHidden, can_speculate

if TYPE_CHECKING:
    from atom_core.config import ResolvedModel, SpeculativeConfig


def num_nextn_layers(hf_config) -> int:
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def checkpoint_names(path: Path, prefix: str) -> set[str]:
    """Names of the tensors under `prefix` in a model directory's safetensors (the index's
    weight map when there is one, else every file's header)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text())["weight_map"]
    else:
        names = []
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                names.extend(f.keys())
    return {n for n in names if n.startswith(prefix)}


class SharedHead(nn.Module):
    def __init__(self, config, has_head: bool):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if has_head:
            self.head = LMHead(config.vocab_size, config.hidden_size)


@functools.cache
def nextn_layer_class(layer_cls: type[nn.Module]) -> type[nn.Module]:
    """The family's decoder layer plus the nextn parts, so parameter names are the checkpoint's
    (`model.layers.N.self_attn...` beside `model.layers.N.eh_proj...`)."""

    class NextNLayer(layer_cls):
        def __init__(self, config, prefix: str, quant_config, has_embed: bool, has_head: bool):
            super().__init__(config, prefix, quant_config)
            hidden = config.hidden_size
            self.enorm = RMSNorm(hidden, config.rms_norm_eps)
            self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
            # Unquantized in FP8 checkpoints too (DeepSeek-V3 keeps eh_proj in bf16).
            self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False, prefix=f"{prefix}.eh_proj")
            self.shared_head = SharedHead(config, has_head)
            if has_embed:
                self.embed_tokens = VocabEmbedding(config.vocab_size, hidden)

        def forward_nextn(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                          embed: nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
            """[T] next tokens, [T] positions, [T, H] previous hidden -> [T, H] normed output (or
            only `rows` of it: indices into T)."""
            x = torch.cat([self.enorm(embed(input_ids)), self.hnorm(previous_hidden)], dim=-1)
            hidden, residual = self(positions, self.eh_proj(x), None)
            out = self.shared_head.norm(hidden, residual)[0]
            return out if rows is None else out.index_select(0, rows)

    NextNLayer.__name__ = NextNLayer.__qualname__ = f"{layer_cls.__name__}NextN"
    return NextNLayer


class MTPModel(nn.Module):
    """The nextn layer at `model.layers.{index}`, with the target's loading rules: a module the
    loader fills from the target's checkpoint, skipping every tensor outside that layer."""

    def __init__(self, config, index: int, layer: nn.Module, target_model: nn.Module):
        super().__init__()
        self.config = config
        self.prefix = f"model.layers.{index}."
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(index): layer})
        self.stacked_params_mapping = target_model.stacked_params_mapping
        self.expert_params_mapping = target_model.expert_params_mapping

    def skip_checkpoint_weight(self, name: str) -> bool:
        return not name.startswith(self.prefix) or "rotary_emb.inv_freq" in name


def family_mtp_class(target: "ResolvedModel") -> type[nn.Module] | None:
    """A family whose MTP layer is not DeepSeek's nextn layout names its own module (`mtp_class`:
    Qwen3-Next's `mtp.*`): built from (config, quant_config, target model), with `checkpoint_prefix`,
    `required_tensor`, a `layer` that has forward_nextn, and the loader's rules."""
    from atom_core.models.registry import resolve_model_class

    return getattr(resolve_model_class(target.hf_config), "mtp_class", None)


def check_family_mtp(target: "ResolvedModel", mtp_class: type[nn.Module]) -> None:
    """ValueError unless the checkpoint holds the family's MTP layer (dummy weights: it is built)."""
    if target.load_format == "dummy":
        return
    prefix = mtp_class.checkpoint_prefix
    names = checkpoint_names(Path(target.path), prefix)
    if mtp_class.required_tensor not in names:
        raise ValueError(f"--method mtp needs the checkpoint's multi-token-prediction layer, and {target.path} "
                         f"holds no {mtp_class.required_tensor} ({len(names)} tensors under {prefix}); "
                         "use a checkpoint that ships it")


def stop_index(drafts: list[int], rule: tuple[set[int], int]) -> int | None:
    """The index of the first draft that would end the request (MTPProposer._stop_rule), if any."""
    stops, first = rule
    return next((j for j, token in enumerate(drafts) if j >= first and token in stops), None)


def cut_at_stop(drafts: list[int], rule: tuple[set[int], int]) -> list[int]:
    """The drafts up to the first that would end the request: verifying tokens after it is wasted
    work (the request ends there once it is accepted)."""
    j = stop_index(drafts, rule)
    return drafts if j is None else drafts[: j + 1]


def all_stopped(tokens: list[torch.Tensor], rules: list[tuple[set[int], int]]) -> bool:
    """Whether every row of the drafts so far (a list of [E] tensors) holds a token that ends its request."""
    rows = torch.stack(tokens, dim=1).tolist()
    return all(stop_index(row, rule) is not None for row, rule in zip(rows, rules))


def check_nextn_layer(target: "ResolvedModel") -> set[str]:
    """ValueError unless the checkpoint has a nextn layer (declared and with weights); returns
    the names of its tensors (none with dummy weights). Cheap: reads no tensor."""
    hf = target.hf_config
    mtp_class = family_mtp_class(target)
    if mtp_class is not None:
        check_family_mtp(target, mtp_class)
        return set()
    if num_nextn_layers(hf) < 1:
        hint = (" (dummy-weight cost runs: preset:DeepSeek-V2-Lite-MTP declares one)"
                if target.load_format == "dummy" else "")
        raise ValueError(f"--method mtp needs a checkpoint with a multi-token-prediction (nextn) layer, and "
                         f"{target.path} has none (config.json num_nextn_predict_layers is "
                         f"{getattr(hf, 'num_nextn_predict_layers', 'absent')}); use --method ngram or draft{hint}")
    if target.load_format == "dummy":
        return set()
    prefix = f"model.layers.{hf.num_hidden_layers}"
    names = checkpoint_names(Path(target.path), prefix + ".")
    if f"{prefix}.eh_proj.weight" not in names:
        raise ValueError(f"--method mtp: config.json of {target.path} declares num_nextn_predict_layers "
                         f"{num_nextn_layers(hf)}, but its safetensors hold no {prefix}.eh_proj.weight "
                         f"({len(names)} tensors under {prefix}): the nextn layer's weights are missing")
    return names


def build_mtp_model(target: "ResolvedModel", target_model: nn.Module) -> nn.Module:
    """The checkpoint's first nextn layer (or the family's MTP module), loaded (or dummy-filled like
    the target); ValueError when the checkpoint has none."""
    names = check_nextn_layer(target)
    hf = target.hf_config
    mtp_class = getattr(target_model, "mtp_class", None)
    if mtp_class is not None:
        return _load(target, lambda: mtp_class(hf, target.quant_config, target_model))
    index = hf.num_hidden_layers
    layer_cls = getattr(target_model, "layer_cls", None)
    if layer_cls is None:
        raise ValueError(f"--method mtp is not supported for {target.architecture}")
    prefix = f"model.layers.{index}"
    # Dummy weights reuse the target's embedding and head (real checkpoints' copies equal them).
    has_embed, has_head = f"{prefix}.embed_tokens.weight" in names, f"{prefix}.shared_head.head.weight" in names

    def make():
        layer = nextn_layer_class(layer_cls)(hf, prefix, target.quant_config, has_embed, has_head)
        return MTPModel(hf, index, layer, target_model)

    return _load(target, make)


def _load(target: "ResolvedModel", make) -> nn.Module:
    """make() built in the target's dtype on its device, then loaded from the target's checkpoint
    (or dummy-filled like the target)."""
    from atom_core.loader import init_dummy_weights, load_weights, process_weights_after_loading

    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(target.dtype)
    try:
        with torch.device(target.device):
            model = make()
    finally:
        torch.set_default_dtype(old_dtype)
    if target.load_format == "dummy":
        init_dummy_weights(model, target.seed + 1)
    else:
        load_weights(model, Path(target.path))
    process_weights_after_loading(model)
    return model.eval()


class MTPProposer(Proposer):
    """Contract: as Proposer, with `uses_target_hidden`: `propose(states, target)` after every
    step (first feeding the step's verified rows to the layer, then drafting for `states`);
    `allocate_kv(num_blocks)` once the target's block count is known; `forget(req_ids)`."""

    uses_target_hidden = True

    def __init__(self, config: "SpeculativeConfig", target: "ResolvedModel", target_model: nn.Module,
                 block_size: int, max_num_seqs: int):
        super().__init__(config.num_draft_tokens)
        if block_size < self.num_draft_tokens:
            raise ValueError(f"block_size {block_size} must be >= num_speculative_tokens {self.num_draft_tokens}")
        self.model, self.layer, self.embed, self.head = self._build_drafter(config, target, target_model)
        self.device = target.device
        self.max_model_len = target.max_model_len
        self.eos_token_ids = target.eos_token_ids
        self.layers = attention_layers(self.model)
        self.kv = DraftKV(self.layers, block_size, max_num_seqs, target.device)
        self.graphs: MTPGraphs | None = None
        self.pad_catch_up = False  # True with graphs (capture_graphs); tests set it to check the padded rows eagerly

    def _build_drafter(self, config: "SpeculativeConfig", target: "ResolvedModel", target_model: nn.Module):
        """(model, layer, embed, head): the loaded module, its layer with `forward_nextn(ids,
        positions, previous hidden, embed)`, and the embedding and head `_greedy` drafts with."""
        model = build_mtp_model(target, target_model)
        if getattr(target_model, "mtp_class", None) is not None:  # the family's layout: the target's embed and head
            return model, model.layer, target_model.model.embed_tokens, target_model.lm_head
        layer = next(iter(model.model.layers.values()))
        own_embed, own_head = getattr(layer, "embed_tokens", None), getattr(layer.shared_head, "head", None)
        embed = own_embed if own_embed is not None else target_model.model.embed_tokens
        return model, layer, embed, own_head if own_head is not None else target_model.lm_head

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, H] layer outputs -> [R] draft token ids."""
        return self.head(hidden).argmax(dim=-1)

    def kv_layers(self) -> list:
        return self.layers

    def allocate_kv(self, num_blocks: int) -> None:
        self.kv.allocate(num_blocks)

    def forget(self, req_ids) -> None:
        self.kv.release(req_ids)

    def _previous(self, source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[N, H] the hidden state each catch-up row reads: rows `rows` of `source` (_source's)."""
        return source.index_select(0, rows)

    def _source(self, target: TargetHidden) -> torch.Tensor:
        """What _previous reads rows of: the step's final hidden states."""
        return target.hidden

    @torch.inference_mode()
    def propose(self, states: list[RequestView], target: TargetHidden | None = None) -> list[list[int]]:
        assert target is not None, "the MTP proposer drafts from the target's hidden states"
        wanted = {s.req_id for s in states}
        tokens_of, counts, starts, tables, first_rows = [], [], [], [], []
        drafting: dict[str, int] = {}  # request id -> its entry in this forward
        rules: dict[str, tuple[set[int], int]] = {}  # request id -> its _stop_rule
        for i, state in enumerate(target.states):
            n, first = target.num_rows[i], target.first_positions[i]
            if n == 0 or not can_speculate(state.sampling_params):
                continue
            assert first + n < state.num_known_tokens, "an MTP row pairs a position with the known token after it"
            rid = state.req_id
            if (rid in wanted and state.num_known_tokens + self.num_draft_tokens <= self.max_model_len
                    and self.kv.claim(rid)):
                assert first + n + 1 == state.num_known_tokens, "a drafting request's rows end at its newest token"
                drafting[rid] = len(counts)
                rules[rid] = self._stop_rule(state)
            tokens_of.append(state.tokens(first + 1, first + n + 1))
            counts.append(n)
            starts.append(first)
            tables.append(self.kv.table(state, first + n))
            first_rows.append(target.row_starts[i])
        drafts: list[list[int]] = [[] for _ in states]
        if not counts:
            return drafts
        entries = list(drafting.values())
        q = 1 + self.num_draft_tokens
        padded = self._pads_catch_up(counts, starts, q)
        if padded and entries and self.graphs is not None:  # every request of the graph drafts, masked where it may not
            step = PaddedStep(counts, starts, first_rows, tables, [t for toks in tokens_of for t in toks], entries)
            by_entry = self.graphs.replay(step, target.hidden).tolist()  # one copy in, one sync out
            by_request = {rid: cut_at_stop(by_entry[e], rules[rid]) for rid, e in drafting.items()}
            return [by_request.get(s.req_id, []) for s in states]
        if padded:
            ids, rows, last_rows = padded_catch_up(tokens_of, counts, first_rows, q)
            host = self.kv.layout([q] * len(counts), starts, tables, num_real=counts)
        else:
            ids = [t for toks in tokens_of for t in toks]
            rows = [r for first, n in zip(first_rows, counts) for r in range(first, first + n)]
            last_rows = [end - 1 for end in itertools.accumulate(counts)]
            host = self.kv.layout(counts, starts, tables)
        host.update(ids=np.array(ids, dtype=np.int64), rows=np.array(rows, dtype=np.int64))
        later = self.num_draft_tokens - 1
        host["last"] = np.array([last_rows[e] for e in entries], dtype=np.int64)
        host["entries"] = np.array(entries, dtype=np.int64)
        if entries and later:
            host.update(later_layout(host["positions"][host["last"]], host["block_tables"][host["entries"]], None,
                                     later, self.kv.block_size))
        dev = to_device_packed(host, self.device)  # the step's one host-to-device copy
        positions, meta = device_metadata(host, dev)
        previous = self._previous(self._source(target), dev["rows"])
        if not entries:  # the layer's KV of these positions only: no output row is wanted
            with set_attention_metadata(meta):
                self.layer.forward_nextn(dev["ids"], positions, previous, self.embed, dev["last"])
            return drafts
        bound = max(starts[e] + counts[e] for e in entries) + self.num_draft_tokens - 1
        c = CatchUp(dev["ids"], positions, previous, meta, dev["last"],
                    meta.block_tables.index_select(0, dev["entries"]), bound,
                    {name: dev[name] for name in LATER_KEYS} if later else None)
        # On the CPU reading drafts costs nothing: the loop ends once every request drafted a token
        # that would end it. On a GPU that would be a sync a draft, so its loop runs to K.
        row_rules = [rules[rid] for rid in drafting]
        done = (lambda tokens: all_stopped(tokens, row_rules)) if self.device.type == "cpu" else None
        out = run_drafts(self.layer, self.embed, self._greedy, c, self.num_draft_tokens, done)
        by_request = {rid: cut_at_stop(row, rules[rid]) for rid, row in zip(drafting, out.tolist())}  # one sync
        return [by_request.get(s.req_id, []) for s in states]

    def _stop_rule(self, state: RequestView) -> tuple[set[int], int]:
        """(the tokens that would end the request, the first draft index where one does): the
        scheduler's stop rule (EOS unless ignore_eos, stop_token_ids, none before min_tokens)."""
        params = state.sampling_params
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return stops, params.min_tokens - 1 - len(state.output_token_ids)

    # ---- CUDA graphs (spec_decode/mtp_graphs.py explains the padded catch-up) ---------------
    def capture_graphs(self, decode_sizes: tuple[int, ...], capture: CaptureGraphs) -> None:
        """Graphs of the whole draft loop (spec_decode/mtp_graphs.py: the padded catch-up of
        q = 1 + K rows per request and the K - 1 later drafts), made by `capture`
        (proposer.CaptureGraphs) in the target's pool."""
        span = self.max_model_len + NUM_SCRATCH_BLOCKS * self.kv.block_size
        self.graphs = MTPGraphs(self.layer, self.embed, self._greedy, self._previous, self._graph_source(),
                                decode_sizes, self.num_draft_tokens, self.kv.block_size, span, self.device, capture)
        self.pad_catch_up = True

    def _graph_source(self) -> torch.Tensor | None:
        """_source's tensor when it is one buffer for the engine's life (graphs read it in place), else None."""
        return None

    def release_graphs(self) -> None:
        self.graphs = None

    @property
    def graph_capture_seconds(self) -> float:
        return 0.0 if self.graphs is None else self.graphs.capture_seconds

    def _pads_catch_up(self, counts: list[int], starts: list[int], q: int) -> bool:
        """Whether the catch-up runs padded to q rows a request: asked for (graphs), every request
        has at most q rows (decode and verify steps; a prefill chunk has more), padding positions
        stay inside max_model_len, and a graph of that many requests exists when graphs are on."""
        if not self.pad_catch_up or max(counts) > q or max(starts) + q > self.max_model_len:
            return False
        return self.graphs is None or self.graphs.can_run(len(counts))
