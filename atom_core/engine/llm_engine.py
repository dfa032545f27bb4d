"""LLMEngine: the synchronous, in-process Python API over the engine core."""
from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Callable, Sequence as Seq

from atom_core.config import EngineConfig
from atom_core.engine.core import EngineCore
from atom_core.engine.output_processor import OutputProcessor, RequestState
from atom_core.lora import LoRARegistry, LoRARequest, as_lora_request
from atom_core.multimodal.processors import build_image_processor
from atom_core.sampling_params import SamplingParams

Prompt = str | list[int]


class LLMEngine:
    """`LLMEngine(model=..., **config_fields)`; `generate(prompts, sampling_params)`.

    Prompts are strings (tokenized here) or token-id lists. `add_request` + `step` give
    streaming control; `stream_callback(output_dict_so_far, new_token_ids, new_text)` is called
    for every step that brings its request new tokens (one token per call with
    num_scheduler_steps=1, up to a window's worth otherwise).

    `model` is a local HF directory, `demo` (the built-in model) or preset:NAME, as `--model`.
    Lifecycle: `shutdown()` stops the tensor-parallel workers and leaves the process groups; it is
    idempotent and also runs on `with LLMEngine(...) as llm:` exit, when the engine is garbage
    collected, and at interpreter exit, so engines can be made one after another in one process.
    A shut-down engine refuses new requests.
    With enable_lora, `lora=` (an adapter's name, or a LoRARequest-like object with lora_name and
    lora_path) runs prompts with that adapter; `load_lora` / `unload_lora` change the set at run time.
    """

    def __init__(self, model: str, **config_fields):
        self._closed = False
        self.config = EngineConfig.from_kwargs(model, **config_fields)
        self.core = EngineCore(self.config)
        self.tokenizer = self.core.files.load_tokenizer() if self.core.files.tokenizer_path else None
        # vision-language models: images -> placeholders + MultimodalItems (atom_core/multimodal/)
        self.image_processor = (build_image_processor(self.core.files.path, self.tokenizer)
                                if self.core.takes_images else None)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._finished: dict[str, RequestState] = {}  # only for requests generate() waits on
        self._awaited: set[str] = set()
        self.loras: LoRARegistry | None = None
        if self.config.lora.enable_lora:
            self.loras = LoRARegistry(self.config.lora.max_lora_rank, self.core.model.hf_config)
            for module in self.config.lora.modules:
                self.loras.add(*module)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    # ---- requests -------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids or a tokenizer directory")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of token ids")
        return list(prompt)

    def add_request(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                    stream_callback: Callable | None = None, lora=None, images=None) -> list[str]:
        """Queue one or more prompts; returns their request ids. Validates all before queueing any.

        images (vision-language models): one list per prompt of PIL images, image bytes or file paths;
        the prompt holds the model's image placeholder once per image, where the chat template puts it
        for an image content part (`image_chat_prompt` writes such a prompt)."""
        if self._closed:
            raise RuntimeError("this LLMEngine was shut down; create a new one")
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        lora_request = as_lora_request(lora, self.loras)
        if lora_request is not None:
            params = [dataclasses.replace(p, lora_request=lora_request) for p in params]
        token_lists = [self.tokenize(p) for p in prompts]
        items = [()] * len(prompts)
        if images is not None:
            token_lists, items = self._with_images(token_lists, images)
        for ids, sp, mm in zip(token_lists, params, items):
            self.core.validate_request(ids, sp, mm)
        request_ids = []
        for prompt, ids, sp, mm in zip(prompts, token_lists, params, items):
            rid = str(next(self._ids))
            self.outputs.new_state(rid, prompt if isinstance(prompt, str) else None, ids, sp, stream_callback)
            self.core.add_request(rid, ids, sp, mm)
            request_ids.append(rid)
        return request_ids

    def _with_images(self, token_lists: list[list[int]], images) -> tuple[list[list[int]], list[tuple]]:
        if len(images) != len(token_lists) or any(isinstance(i, (str, bytes, Path)) for i in images):
            raise ValueError(f"images: expected one list of images per prompt ({len(token_lists)} prompts)")
        if any(images) and self.image_processor is None:
            raise ValueError(f"this model ({self.core.model.architecture}) takes no images")
        out_ids, out_items = [], []
        for ids, prompt_images in zip(token_lists, images):
            if not prompt_images:
                out_ids.append(ids)
                out_items.append(())
                continue
            loaded = [Path(i).read_bytes() if isinstance(i, (str, Path)) else i for i in prompt_images]
            expanded, items = self.image_processor.process(ids, loaded)
            out_ids.append(expanded)
            out_items.append(items)
        return out_ids, out_items

    def image_chat_prompt(self, text: str, num_images: int = 1) -> str:
        """A one-turn chat prompt of `num_images` image parts then `text`, through the chat template."""
        if self.image_processor is None:
            raise ValueError(f"this model ({self.core.model.architecture}) takes no images")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("images need a chat template to place them; this tokenizer has none")
        content = [dict(self.image_processor.template_part) for _ in range(num_images)] + [{"type": "text", "text": text}]
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                  tokenize=False)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests([request_id])
        self.outputs.abort(request_id)

    def step(self) -> list[RequestState]:
        """Run one engine step; returns the requests that got new tokens (finished ones included)."""
        updated, to_abort = self.outputs.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        for state in updated:
            if state.stream_callback is not None:
                text, ids = state.take_delta()
                state.stream_callback(state.as_dict(), ids, text)
            if state.finished and state.request_id in self._awaited:
                self._finished[state.request_id] = state
        return updated

    def is_finished(self) -> bool:
        return not self.core.has_unfinished()

    def spec_decode_stats(self) -> dict:
        """Speculative decoding counters so far: num_drafts, num_draft_tokens, num_accepted_tokens,
        accepted_per_position (all zero without --method)."""
        return self.core.scheduler.spec_stats.as_dict()

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's finished content (blocks of running requests stay shared);
        returns the number of blocks forgotten."""
        return self.core.kv.reset_prefix_cache()

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora=None, on_step: Callable[[list[RequestState]], None] | None = None, images=None) -> list[dict]:
        """Run prompts to completion; one output dict per prompt, in prompt order. `on_step` is
        called after every step with the requests that got new tokens (progress bars). images: as
        add_request's."""
        request_ids = self.add_request(prompts, sampling_params, lora=lora, images=images)
        self._awaited.update(request_ids)
        while not all(rid in self._finished for rid in request_ids):
            updated = self.step()
            if on_step is not None:
                on_step(updated)
        self._awaited.difference_update(request_ids)
        return [self._finished.pop(rid).as_dict() for rid in request_ids]

    # ---- LoRA adapters ----------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT adapter at `path` as `name` (ValueError for a bad adapter or a taken name)."""
        return self._lora_registry().add(name, str(path))

    def unload_lora(self, name: str) -> None:
        """Forget `name` for new requests; running ones finish with it. KeyError for an unknown name."""
        self._lora_registry().remove(name)

    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True")
        return self.loras

    def shutdown(self) -> None:
        """Stop the engine's worker processes and leave its process groups (tensor parallel).
        Idempotent; also on context exit, garbage collection and interpreter exit."""
        if self._closed:
            return
        self._closed = True
        core = getattr(self, "core", None)  # None: __init__ failed before the core existed
        if core is not None:
            core.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # At interpreter exit the executor's atexit hook has already done this, and the modules
        # shutdown needs may be gone.
        if not sys.is_finalizing() and not getattr(self, "_closed", True):
            self.shutdown()

    # ---- profiling ------------------------------------------------------------------
    def start_profile(self) -> None:
        self.core.start_profile()

    def stop_profile(self) -> list[str]:
        return self.core.stop_profile()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
