"""Which graphs run a step's forward: GraphDispatcher holds the CUDA graph sets, captures them and
picks one for every step.

A step's forward takes the first of these paths that applies (`GraphPath`):
  VERIFY     a speculative step laid out 1 + k rows per request (worker/verify_batch.py's
             build_padded_verify_batch, chosen before the batch is built: `uses_verify_layout`)
             replays the verify graphs;
  FULL       a decode-only batch of at most the largest capture size replays the full decode graph
             of the smallest captured size that holds it (worker/cuda_graph.py);
  AGREED     the same for data-parallel replicas that share experts (engine/lockstep.py): the graph
             of the size every replica agreed on this step, so the MoE all-gathers captured inside
             it meet; with no agreement (some replica's step cannot replay) the step goes on down;
  PIECEWISE  a step of at most the largest bucket's tokens replays the piecewise graphs
             (worker/piecewise.py): graphs between the attention calls, attention eager between;
  EAGER      the model's forward as it is: everything else, every step with image rows (they come
             first: the graphs take token ids and [T] positions only), and every step on the CPU.
`choose_path` is that order as a pure function of the step's shape and the graph sets there are;
`graph_sets` says which sets a configuration captures.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from atom_core.distributed.communication import agreed_graph_size, agreed_token_counts
from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata

if TYPE_CHECKING:
    from atom_core.scheduler_output import SchedulerOutput
    from atom_core.worker.batch_builder import FlatBatch
    from atom_core.worker.input_batch import RequestState


class GraphPath(enum.Enum):
    VERIFY = "verify"
    FULL = "full"
    AGREED = "agreed"
    PIECEWISE = "piecewise"
    EAGER = "eager"


class Choice(NamedTuple):
    path: GraphPath
    size: int | None = None  # AGREED: the captured size every replica replays


class GraphSet(Protocol):
    """What the choice reads of a graph set (CUDAGraphRunner: requests; PiecewiseGraphRunner: tokens)."""

    def can_run(self, n: int) -> bool: ...


class GraphSets(NamedTuple):
    """Which graph sets a configuration captures."""

    full: bool  # full decode graphs, and verify graphs beside them when speculating (capture_decode)
    piecewise: bool  # piecewise graphs (capture_piecewise)


def graph_sets(use_cuda_graphs: bool, mode: str, spans_replicas: bool) -> GraphSets:
    """mode: CompileConfig.cudagraph_mode. Replicas sharing experts replay only graphs of a size
    they agree on: the full decode graphs."""
    return GraphSets(full=use_cuda_graphs and mode != "piecewise",
                     piecewise=use_cuda_graphs and mode != "full_decode_only" and not spans_replicas)


def choose_path(*, verify_layout: bool, decode_only: bool, num_requests: int, num_tokens: int,
                full: GraphSet | None, piecewise: GraphSet | None, spans_replicas: bool,
                agreed_size: int | None, multimodal: bool = False) -> Choice:
    """The path of one step (the module docstring's order). verify_layout: the batch was built
    padded for the verify graphs; agreed_size: the decode graph size the replicas agreed on (read
    only when spans_replicas); multimodal: the step has image rows (encoder outputs for its embeddings,
    [3, T] rotary positions), which only the eager forward takes."""
    if multimodal:
        return Choice(GraphPath.EAGER)
    if verify_layout:
        return Choice(GraphPath.VERIFY)
    if full is not None and decode_only and full.can_run(num_requests):
        if not spans_replicas:
            return Choice(GraphPath.FULL)
        if agreed_size is not None:
            return Choice(GraphPath.AGREED, agreed_size)
    if piecewise is not None and piecewise.can_run(num_tokens):
        return Choice(GraphPath.PIECEWISE)
    return Choice(GraphPath.EAGER)


def verify_graph_sizes(decode_sizes: tuple[int, ...], query_len: int) -> tuple[int, ...]:
    """Verify graphs' sizes count requests of query_len tokens each, up to the largest decode
    capture size in tokens."""
    largest = max(decode_sizes)
    return tuple(s for s in decode_sizes if s * query_len <= largest) or (1,)


class GraphDispatcher:
    """Contract: built with no graphs, so every step runs eagerly (the KV sizing step does);
    `capture_decode` and `capture_piecewise` at most once each, after the KV cache exists;
    `forward(flat, out)` runs a step's forward on the path `choose` names and returns its hidden
    states [tokens, hidden] (from a graph: a view of graph memory, valid until the next forward);
    `forward_padding()` is an idle replica's forward; `release()` drops every graph (steps run
    eagerly after). Single-threaded, as the runner. The graph sets are public attributes (None:
    not captured): `full`, `verify` (CUDAGraphRunner) and `piecewise` (PiecewiseGraphRunner)."""

    def __init__(self, model, max_model_len: int, block_size: int, device: torch.device,
                 spans_replicas: bool = False, profiler=None):
        """spans_replicas: data-parallel replicas share this model's experts (engine/lockstep.py)."""
        self.model = model
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.spans_replicas = spans_replicas
        self.profiler = profiler
        self.full = None
        self.verify = None
        self.piecewise = None

    @property
    def pool(self):
        """The full decode graphs' memory pool, which every later capture shares (None before them)."""
        return self.full.pool if self.full is not None else None

    @property
    def capture_seconds(self) -> float:
        return sum(g.capture_seconds for g in (self.full, self.verify, self.piecewise) if g is not None)

    # ---- capture ----------------------------------------------------------------------
    def capture_decode(self, sizes: tuple[int, ...], num_draft_tokens: int = 0, num_replicas: int = 1) -> None:
        """Full decode graphs of `sizes` requests, then (num_draft_tokens > 0) verify graphs of
        1 + num_draft_tokens tokens per request in their pool. Replicas sharing experts capture
        each size together, their MoE all-gathers sized for it."""
        from atom_core.worker.cuda_graph import CUDAGraphRunner

        context = (lambda tokens: agreed_token_counts([tokens] * num_replicas)) if self.spans_replicas else None
        self.full = CUDAGraphRunner(self.model, sizes, self.max_model_len, self.block_size, self.device,
                                    self.profiler, capture_context=context)
        self.full.capture_all()
        if num_draft_tokens:
            q = 1 + num_draft_tokens
            self.verify = CUDAGraphRunner(self.model, verify_graph_sizes(sizes, q), self.max_model_len,
                                          self.block_size, self.device, self.profiler, query_len=q)
            self.verify.pool = self.full.pool
            self.verify.capture_all()

    def capture_forward(self, forward, sizes: tuple[int, ...], max_model_len: int, query_len: int = 1):
        """Graphs of another decode-shaped forward (a proposer's: spec_decode/proposer.py's
        CaptureGraphs) in the decode graphs' pool; returns the captured CUDAGraphRunner."""
        from atom_core.worker.cuda_graph import CUDAGraphRunner

        graphs = CUDAGraphRunner(forward, sizes, max_model_len, self.block_size, self.device, query_len=query_len)
        graphs.pool = self.pool
        graphs.capture_all()
        return graphs

    def capture_piecewise(self, sizes: tuple[int, ...], attention_layers: list, kit=None) -> None:
        """Piecewise graphs for every step of up to max(sizes) tokens (mixed batches; decode-only
        ones too when no full decode graphs exist), in the decode graphs' pool. kit: makes the
        graphs (default CUDA graphs; the CPU tests pass a recording stand-in)."""
        from atom_core.worker.piecewise import CudaGraphKit, PiecewiseGraphRunner

        kit = kit if kit is not None else CudaGraphKit(self.device, self.pool)
        self.piecewise = PiecewiseGraphRunner(self.model, attention_layers, sizes, self.device, kit)
        self.piecewise.capture_all()

    def release(self) -> None:
        self.full = self.verify = self.piecewise = None

    # ---- choice -----------------------------------------------------------------------
    def uses_verify_layout(self, out: SchedulerOutput, states: list[RequestState]) -> bool:
        """Whether a speculative step is built padded for the verify graphs: every request decodes
        its one known pending token (plus drafts), its padded rows stay inside max_model_len and
        it wants no prompt logprobs."""
        graphs = self.verify
        if graphs is None or not out.has_drafts or not graphs.can_run(len(out)):
            return False
        q = graphs.query_len
        return all(n == 1 and s.num_computed_tokens + 1 == s.num_known_tokens
                   and s.num_computed_tokens + q <= self.max_model_len and s.sampling_params.prompt_logprobs is None
                   for n, s in zip(out.num_scheduled_tokens, states))

    def choose(self, flat: FlatBatch, out: SchedulerOutput) -> Choice:
        return choose_path(verify_layout=flat.verify_query_len > 0, decode_only=out.is_decode_only,
                           num_requests=len(out), num_tokens=flat.num_tokens, full=self.full,
                           piecewise=self.piecewise, spans_replicas=self.spans_replicas,
                           agreed_size=agreed_graph_size() if self.spans_replicas else None,
                           multimodal=flat.mm_embeds is not None or flat.positions.dim() == 2)

    def graph_batch_size(self, out: SchedulerOutput) -> int | None:
        """The captured size a decode batch would replay with, or None when it runs eagerly."""
        if self.full is None or not out.is_decode_only or not self.full.can_run(len(out)):
            return None
        return agreed_graph_size() if self.spans_replicas else self.full.padded_size(len(out))

    # ---- forward ----------------------------------------------------------------------
    def forward(self, flat: FlatBatch, out: SchedulerOutput, inputs_only: bool = False) -> torch.Tensor:
        """inputs_only: the block tables are those of the last replay (later steps of a window)."""
        path, size = self.choose(flat, out)
        if path is GraphPath.VERIFY:
            return self.verify.replay(flat)
        if path is GraphPath.FULL:
            return self.full.replay(flat, inputs_only)
        if path is GraphPath.AGREED:
            return self.full.replay(flat, inputs_only, size=size)
        if path is GraphPath.PIECEWISE:
            return self.piecewise.replay(flat)
        with set_attention_metadata(flat.attn):
            if flat.mm_embeds is not None:
                return self.model(flat.input_ids, flat.positions, flat.mm_embeds)
            return self.model(flat.input_ids, flat.positions)

    def forward_padding(self) -> None:
        """One padding token through the model, its KV written nowhere (slot -1) and its output
        dropped; when the replicas agreed to replay a decode graph, that graph with padding rows only."""
        size = agreed_graph_size()
        if size is not None and self.full is not None:
            self.full.replay_padding(size)
            return
        dev = self.device
        one = torch.ones(1, dtype=torch.int32, device=dev)
        attn = AttentionMetadata(query_start_loc=torch.arange(2, dtype=torch.int32, device=dev),
                                 seq_lens=one, block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev),
                                 slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=dev),
                                 max_query_len=1, max_seq_len=1, seq_order=torch.zeros_like(one))
        token = torch.zeros(1, dtype=torch.int64, device=dev)
        with set_attention_metadata(attn):
            self.model(token, token)  # token 0 at position 0
