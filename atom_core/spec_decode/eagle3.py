"""EAGLE-3: a one-layer draft head fed by the target's low, middle and high hidden states.

Checkpoint layout (the public one: SpecForge, the EAGLE repository, vLLM's llama_eagle3), a
directory with config.json (architectures LlamaForCausalLMEagle3, a Llama config of one layer
plus draft_vocab_size and, optionally, target_hidden_size, norm_before_residual and
eagle_aux_hidden_state_layer_ids) and safetensors holding

    fc.weight         [H, 3 Ht]   fuses the three target hidden states (Ht: the target's width)
    midlayer.*        one Llama decoder layer whose q/k/v read 2H: input_layernorm, hidden_norm,
                      self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj
    norm.weight       [H]         before the head
    lm_head.weight    [Vd, H]     over the draft vocabulary
    d2t               [Vd] int64  target id = draft id + d2t[draft id]
    t2d               [V] bool    which target ids the draft vocabulary holds
    embed_tokens.weight (optional; absent: the target's embedding)

At position t the head reads token t+1 and a hidden state g_t, and predicts token t+2:

    x_t = midlayer(cat(input_layernorm(embed(token_{t+1})), hidden_norm(g_t)))   (pre-norm x_t)
    draft = d2t-mapped argmax(lm_head(norm(x_t)))

For a position the target has verified g_t = fc(cat(a_t^1, a_t^2, a_t^3)), a^j the residual stream
entering the target layers eagle_aux_hidden_state_layer_ids (default 2, L/2, L-3: vLLM's, whose
layer ids count inputs of layers), kept by the target's DecoderModel (models/common.py,
keep_aux_hidden_states). A later draft feeds the head's own pre-norm x in place of g, as the
head was trained (SpecForge's test-time training loop). The residual of the layer is g itself, or
hidden_norm(g) with norm_before_residual.

Everything else is the MTP proposer's (spec_decode/mtp.py): every verified position gets its
head row, prefill chunks included, in the head's own KV cache on the target's block tables; a
step's draft loop runs on the device (spec_decode/draft_loop.py: fc, catch-up, K - 1 later drafts,
one host sync) and with --mtp-graphs replays as one CUDA graph. Drafts are greedy (a
point mass over the target vocabulary, which the rejection sampler verifies exactly at any
temperature).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from atom_core.model_ops.embed_head import LMHead, VocabEmbedding
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.linear import ReplicatedLinear
from atom_core.models.common import AttentionOptions, DecoderForCausalLM, GatedMLP, SelfAttention
from atom_core.spec_decode.mtp import MTPProposer
from atom_core.spec_decode.proposer import RequestView, TargetHidden

if TYPE_CHECKING:
    from atom_core.config import ResolvedModel, SpeculativeConfig

HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class HeadFiles:
    """What check_eagle3_head read of a head directory (no tensor values)."""

    path: Path
    hf_config: object
    layer_ids: tuple[int, ...]  # the target layers whose inputs feed fc
    draft_vocab_size: int
    has_embed: bool
    has_vocab_map: bool  # d2t in the checkpoint (else the draft vocabulary is the target's)


def aux_layer_ids(raw: dict, num_target_layers: int) -> tuple[int, ...]:
    """The head's eagle_aux_hidden_state_layer_ids (top level, or in eagle_config as SpecForge
    writes it), else EAGLE-3's default low / middle / high layers."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) for i in ids)
    return 2, num_target_layers // 2, num_target_layers - 3


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def check_eagle3_head(config: "SpeculativeConfig", target: "ResolvedModel") -> HeadFiles:
    """ValueError unless --draft-model is an EAGLE-3 head that fits the target: its aux layers
    exist, fc reads len(layers) x the target's hidden size, its vocabulary map covers the draft
    vocabulary and points into the target's. Cheap: reads config.json and tensor headers only."""
    from transformers import AutoConfig

    path = Path(config.draft_model)
    where = f"--draft-model {path}"
    if not (path / "config.json").is_file():
        raise ValueError(f"{where}: no config.json (an EAGLE-3 head directory: config.json + safetensors)")
    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or []
    if not set(archs) & set(HEAD_ARCHITECTURES):
        raise ValueError(f"{where}: architectures {archs} is not an EAGLE-3 head; expected one of: "
                         f"{', '.join(HEAD_ARCHITECTURES)}")
    hf = AutoConfig.from_pretrained(str(path))
    target_hf = target.hf_config
    num_layers, target_hidden = target_hf.num_hidden_layers, target_hf.hidden_size
    layer_ids = aux_layer_ids(raw, num_layers)
    if any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"{where}: aux hidden state layers {list(layer_ids)} do not exist in the target's "
                         f"{num_layers} layers (set eagle_aux_hidden_state_layer_ids in the head's config.json)")
    draft_vocab = int(raw.get("draft_vocab_size") or hf.vocab_size)
    hidden = hf.hidden_size
    fc_in = len(layer_ids) * int(raw.get("target_hidden_size") or target_hidden)
    shapes = {} if target.load_format == "dummy" else _tensor_shapes(path)
    if target.load_format != "dummy":
        wanted = {"fc.weight": (hidden, len(layer_ids) * target_hidden), "lm_head.weight": (draft_vocab, hidden)}
        for name, shape in wanted.items():
            if name not in shapes:
                raise ValueError(f"{where}: no {name} in its safetensors ({len(shapes)} tensors)")
        fc_in = shapes["fc.weight"][1]
    if fc_in != len(layer_ids) * target_hidden or shapes.get("fc.weight", (hidden,))[0] != hidden:
        raise ValueError(f"{where}: fc reads {fc_in} features, but {len(layer_ids)} aux layers of the target's "
                         f"hidden size {target_hidden} give {len(layer_ids) * target_hidden}: the head was made "
                         f"for another target")
    has_embed = "embed_tokens.weight" in shapes
    if not has_embed and hidden != target_hidden:
        raise ValueError(f"{where}: hidden size {hidden} differs from the target's {target_hidden} and the head "
                         f"has no embed_tokens of its own (it would read the target's embedding)")
    if shapes.get("lm_head.weight", (draft_vocab,))[0] != draft_vocab:
        raise ValueError(f"{where}: lm_head has {shapes['lm_head.weight'][0]} rows, config.json "
                         f"draft_vocab_size {draft_vocab}")
    has_map = "d2t" in shapes
    if has_map and shapes["d2t"] != (draft_vocab,):
        raise ValueError(f"{where}: d2t has shape {list(shapes['d2t'])}; expected [{draft_vocab}] (draft_vocab_size)")
    if "t2d" in shapes and shapes["t2d"] != (target.vocab_size,):
        raise ValueError(f"{where}: t2d has shape {list(shapes['t2d'])}; expected [{target.vocab_size}] "
                         f"(the target's vocab_size)")
    if target.load_format != "dummy" and not has_map and draft_vocab != target.vocab_size:
        raise ValueError(f"{where}: draft vocabulary of {draft_vocab} tokens without a d2t map into the target's "
                         f"{target.vocab_size}")
    return HeadFiles(path, hf, layer_ids, draft_vocab, has_embed, has_map)


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int, where: str) -> None:
    """Every draft id maps to a distinct target id below vocab_size, and t2d (when given) marks exactly those."""
    targets = torch.arange(d2t.shape[0]) + d2t
    bad = ((targets < 0) | (targets >= vocab_size)).nonzero().flatten()
    if bad.numel():
        d = int(bad[0])
        raise ValueError(f"{where}: d2t maps draft id {d} to target id {int(targets[d])}, outside the target's "
                         f"vocabulary of {vocab_size} ({bad.numel()} such ids)")
    if targets.unique().numel() != targets.numel():
        raise ValueError(f"{where}: d2t maps two draft ids to one target id")
    if t2d is not None:
        marked = torch.zeros(vocab_size, dtype=torch.bool)
        marked[targets] = True
        if not torch.equal(marked, t2d.bool()):
            raise ValueError(f"{where}: t2d marks {int(t2d.bool().sum())} target ids, d2t maps to {targets.numel()} "
                             f"others: the two maps disagree")


class Eagle3Layer(nn.Module):
    """The head's decoder layer (`midlayer`); `forward_nextn` has the MTP layer's signature."""

    def __init__(self, config, prefix: str):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        bias = getattr(config, "attention_bias", False)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.self_attn = SelfAttention(config, f"{prefix}.self_attn", None, AttentionOptions(qkv_bias=bias, o_bias=bias),
                                       input_size=2 * hidden)
        self.mlp = GatedMLP(hidden, config.intermediate_size, f"{prefix}.mlp", None,
                            bias=getattr(config, "mlp_bias", False), hidden_act=getattr(config, "hidden_act", "silu"))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward_nextn(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                      embed: nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T] next tokens, [T] positions, [T, H] g (fused target states or the previous pre-norm
        output) -> [T, H] pre-norm output, or only `rows` of it ([R]: indices into T). Every row's
        K and V are stored either way; o_proj and the MLP run on the wanted rows only (a catch-up
        needs the outputs of each request's last row, the other rows only fill the KV)."""
        normed = self.hidden_norm(previous_hidden)
        residual = normed if self.norm_before_residual else previous_hidden
        x = torch.cat([self.input_layernorm(embed(input_ids)), normed], dim=-1)
        attended = self.self_attn.attn(self.self_attn.qkv_proj(x), positions)
        if rows is not None:
            attended, residual = attended.index_select(0, rows), residual.index_select(0, rows)
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attended), residual)
        return self.mlp(hidden) + residual


class Eagle3Head(nn.Module):
    """The head with the checkpoint's parameter names; `greedy(x)` drafts target ids."""

    stacked_params_mapping = DecoderForCausalLM.stacked_params_mapping

    def __init__(self, files: HeadFiles, target_hidden: int):
        super().__init__()
        config = self.config = files.hf_config
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(len(files.layer_ids) * target_hidden, hidden, bias=False, prefix="fc")
        self.midlayer = Eagle3Layer(config, "midlayer")
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = LMHead(files.draft_vocab_size, hidden)
        if files.has_embed:
            self.embed_tokens = VocabEmbedding(config.vocab_size, hidden)
        # target id of each draft id (arange + the checkpoint's d2t offsets): the greedy head's one lookup
        self.register_buffer("draft_to_target", torch.arange(files.draft_vocab_size, dtype=torch.int64),
                             persistent=False)

    def skip_checkpoint_weight(self, name: str) -> bool:
        return name in ("d2t", "t2d") or "rotary_emb.inv_freq" in name

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, H] pre-norm outputs -> [R] target token ids."""
        return self.draft_to_target[self.lm_head(self.norm(hidden)).argmax(dim=-1)]


def build_eagle3_head(files: HeadFiles, target: "ResolvedModel") -> Eagle3Head:
    """The head, loaded (dummy-filled, identity vocabulary map, when the target is), its map checked."""
    from safetensors import safe_open

    from atom_core.loader import init_dummy_weights, load_weights, process_weights_after_loading

    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(target.dtype)
    try:
        with torch.device(target.device):
            head = Eagle3Head(files, target.hf_config.hidden_size)
    finally:
        torch.set_default_dtype(old_dtype)
    if target.load_format == "dummy":
        init_dummy_weights(head, target.seed + 1)
    else:
        load_weights(head, files.path)
        maps = {}
        for file in sorted(files.path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                maps.update({name: f.get_tensor(name) for name in ("d2t", "t2d") if name in f.keys()})
        if files.has_vocab_map:
            d2t = maps["d2t"].to(torch.int64)
            check_vocab_map(d2t, maps.get("t2d"), target.vocab_size, f"--draft-model {files.path}")
            head.draft_to_target.add_(d2t.to(head.draft_to_target.device))
    process_weights_after_loading(head)
    return head.eval()


class Eagle3Proposer(MTPProposer):
    """Contract: as MTPProposer (the target's hidden rows of every step, prefill chunks included);
    it reads the target's aux hidden states of that step from the buffer the target model writes."""

    def __init__(self, config: "SpeculativeConfig", target: "ResolvedModel", target_model: nn.Module,
                 block_size: int, max_num_seqs: int, max_num_tokens: int):
        # Rows the aux buffer keeps: a step's real rows (its tokens plus drafts, within the token budget).
        self.aux_rows = max(max_num_tokens, max_num_seqs * (1 + config.num_draft_tokens))
        super().__init__(config, target, target_model, block_size, max_num_seqs)

    def _build_drafter(self, config: "SpeculativeConfig", target: "ResolvedModel", target_model: nn.Module):
        stack = getattr(target_model, "model", None)
        if not hasattr(stack, "keep_aux_hidden_states"):
            raise ValueError(f"--method eagle3 is not supported for {target.architecture}: its model does not "
                             f"expose intermediate hidden states (models/common.py DecoderModel)")
        files = check_eagle3_head(config, target)
        head = build_eagle3_head(files, target)
        self.aux = stack.keep_aux_hidden_states(files.layer_ids, self.aux_rows)
        embed = head.embed_tokens if files.has_embed else stack.embed_tokens
        return head, head.midlayer, embed, head

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.greedy(hidden)

    def _previous(self, source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """g of the catch-up rows: fc over the aux hidden states of their step rows (fc is per row,
        so only the rows that are read)."""
        return self.model.fc(source.index_select(0, rows))

    def _source(self, target: TargetHidden) -> torch.Tensor:
        return self.aux

    def _graph_source(self) -> torch.Tensor:
        return self.aux  # one buffer, written by every forward of the target (graph replays too)

    @torch.inference_mode()
    def propose(self, states: list[RequestView], target: TargetHidden | None = None) -> list[list[int]]:
        assert target is not None, "the EAGLE-3 proposer drafts from the target's hidden states"
        rows = target.hidden.shape[0]
        assert rows <= self.aux.shape[0], f"a step of {rows} rows exceeds the aux buffer's {self.aux.shape[0]}"
        going_on = [i for i, state in enumerate(target.states) if not self._finished(state)]
        if not going_on:
            return [[] for _ in states]
        target = TargetHidden(target.hidden, *([getattr(target, f)[i] for i in going_on]
                                               for f in ("states", "row_starts", "first_positions", "num_rows")))
        return super().propose(states, target)

    def _finished(self, state: RequestView) -> bool:
        """Whether the scheduler will finish the request on the tokens it just emitted (the
        scheduler's stop rule on the newest 1 + K outputs): then its head rows and drafts would be
        wasted work. A wrong guess costs drafts only: the target verifies every token."""
        params, outputs = state.sampling_params, state.output_token_ids
        if params.max_tokens is not None and len(outputs) >= params.max_tokens:
            return True
        stops, _ = self._stop_rule(state)
        first = max(len(outputs) - 1 - self.num_draft_tokens, params.min_tokens - 1, 0)
        return any(t in stops for t in outputs[first:])
