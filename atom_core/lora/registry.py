"""The adapters an engine serves, by name. One registry lives where requests are made (the API
process, LLMEngine); a request carries its adapter's LoRARequest, which names the directory, so the
worker loads the weights itself (each tensor-parallel rank its own shard) when the adapter is first
scheduled. Ids are never reused: an adapter loaded again under an old name is a new adapter to the
prefix cache and to the worker's caches."""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import NamedTuple

from atom_core.lora.adapter import check_adapter_shapes, load_adapter


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's names: lora_name (what requests say as `model`), lora_int_id (>= 1, unique), lora_path;
    base_model_name, when given, is the parent /v1/models lists (else the served base model's name)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None


class LoRAModule(NamedTuple):
    """One --lora-modules entry."""

    name: str
    path: str
    base_model_name: str | None = None


_JSON_KEYS = ("name", "path", "base_model_name")


def _parse_json_module(entry: str) -> LoRAModule:
    """vLLM's JSON form: {"name": ..., "path": ..., "base_model_name": ...} (the last optional)."""
    try:
        data = json.loads(entry)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid --lora-modules entry {entry!r}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"invalid --lora-modules entry {entry!r}: expected a JSON object")
    unknown = sorted(set(data) - set(_JSON_KEYS))
    if unknown:
        raise ValueError(f"invalid --lora-modules entry {entry!r}: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"expected: {', '.join(_JSON_KEYS)}")
    for key in ("name", "path"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ValueError(f"invalid --lora-modules entry {entry!r}: {key!r} must be a non-empty string")
    base = data.get("base_model_name")
    if base is not None and (not isinstance(base, str) or not base.strip()):
        raise ValueError(f"invalid --lora-modules entry {entry!r}: 'base_model_name' must be a non-empty string")
    return LoRAModule(data["name"].strip(), data["path"].strip(), data.get("base_model_name"))


def parse_lora_module(entry: str) -> LoRAModule:
    """NAME=PATH, or vLLM's JSON object; ValueError naming the entry and the accepted forms."""
    entry = str(entry).strip()
    if entry.startswith("{"):
        return _parse_json_module(entry)
    name, sep, path = entry.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise ValueError(f"invalid --lora-modules entry {entry!r}; expected NAME=PATH or a JSON object "
                         '{"name": ..., "path": ..., "base_model_name": ...}')
    return LoRAModule(name, path)


def parse_lora_modules(entries) -> list[LoRAModule]:
    """--lora-modules entries (NAME=PATH or JSON); ValueError for a malformed or repeated entry."""
    modules, seen = [], set()
    for entry in entries:
        module = parse_lora_module(entry)
        if module.name in seen:
            raise ValueError(f"--lora-modules names {module.name!r} twice")
        seen.add(module.name)
        modules.append(module)
    return modules


class LoRARegistry:
    """name -> LoRARequest. Contract: `add` checks the adapter's files against max_rank and the base
    model's HF config (ValueError names the problem) before the name becomes usable; `remove` makes
    the name unknown to new requests (requests already running keep their adapter to the end);
    `reserved` names (the base model's) cannot be taken. Not thread-safe: one event loop or caller."""

    def __init__(self, max_rank: int, hf_config, reserved: tuple[str, ...] = ()):
        self.max_rank = max_rank
        self.hf_config = hf_config
        self.reserved = frozenset(reserved)
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def requests(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name in self.reserved:
            raise ValueError(f"LoRA adapter name {name!r} is the base model's name; choose another")
        if name in self._by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (from "
                             f"{self._by_name[name].lora_path!r}); unload it first")
        check_adapter_shapes(load_adapter(path, self.max_rank), self.hf_config)
        request = LoRARequest(name, next(self._ids), str(path), base_model_name)
        self._by_name[name] = request
        return request

    def remove(self, name: str) -> LoRARequest:
        request = self._by_name.pop(name, None)
        if request is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded; loaded: {', '.join(self._by_name) or 'none'}")
        return request


def as_lora_request(lora, registry: LoRARegistry | None) -> LoRARequest | None:
    """What LLMEngine.generate(lora=...) accepts: None, a registered adapter's name, or a LoRARequest-like
    object (lora_name, lora_path), registered here on first use (the same name with another path fails)."""
    if lora is None:
        return None
    if registry is None:
        raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True")
    if isinstance(lora, str):
        request = registry.get(lora)
        if request is None:
            raise ValueError(f"unknown LoRA adapter {lora!r}; loaded: {', '.join(r.lora_name for r in registry.requests) or 'none'}")
        return request
    name, path = getattr(lora, "lora_name", None), getattr(lora, "lora_path", None)
    if not isinstance(name, str) or not isinstance(path, str):
        raise ValueError(f"lora={lora!r}: expected an adapter name or an object with lora_name and lora_path")
    known = registry.get(name)
    if known is None:
        return registry.add(name, path)
    if known.lora_path != path:
        raise ValueError(f"LoRA adapter {name!r} is loaded from {known.lora_path!r}, not {path!r}")
    return known
