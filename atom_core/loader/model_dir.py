"""Resolve `--model` (a local HF directory, preset:NAME or `demo`) into config, tokenizer and EOS ids."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from atom_core.config import ModelConfig, ResolvedModel, config_dtype

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
DEMO_MODEL = "demo"  # the name of the built-in model, in the CLI and in Python alike


def list_presets() -> list[str]:
    return sorted(p.name for p in PRESET_DIR.iterdir() if (p / "config.json").exists())


def model_dir_name(model: str) -> str:
    """`demo` -> the built-in model's directory; any other name unchanged. `demo` wins over a
    directory of that name in the working directory, as it does on the command line."""
    return str(DEMO_MODEL_DIR) if model == DEMO_MODEL else model


def resolve_model_path(model: str) -> Path:
    """The checkpoint directory of a local path, `demo` or preset:NAME; model hubs are never asked."""
    model = model_dir_name(model)
    if model.startswith("preset:"):
        name = model.split(":", 1)[1]
        path = PRESET_DIR / name
        if not (path / "config.json").exists():
            raise ValueError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
        return path
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model directory not found: {model} (model hubs are not used; pass a local directory, "
                         f"'demo' for the built-in model, or preset:NAME for a real architecture with dummy weights: "
                         f"{', '.join(list_presets())})")
    if not (path / "config.json").exists():
        raise ValueError(f"no config.json in model directory {model}")
    return path


@dataclass
class ModelFiles:
    path: Path
    hf_config: object
    tokenizer_path: Path | None
    eos_token_ids: set[int]
    has_weights: bool

    @property
    def is_preset(self) -> bool:
        return self.path.parent == PRESET_DIR

    def load_tokenizer(self):
        if self.tokenizer_path is None:
            raise ValueError(f"model {self.path} has no tokenizer files; pass --tokenizer DIR")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.tokenizer_path))

    def serving_tokenizer(self):
        """The model's tokenizer; for a preset without one, the synthetic word-per-id tokenizer."""
        if self.tokenizer_path is None and self.is_preset:
            from transformers import AutoTokenizer

            from atom_core.loader.synthetic_tokenizer import synthetic_tokenizer_dir

            eos = min(self.eos_token_ids) if self.eos_token_ids else None
            return AutoTokenizer.from_pretrained(str(synthetic_tokenizer_dir(self.hf_config.vocab_size, eos)))
        return self.load_tokenizer() if self.tokenizer_path is not None else None


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def _eos_ids(path: Path, hf_config) -> set[int]:
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    gen = path / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    if not ids:
        add(getattr(hf_config, "eos_token_id", None))
    return ids


def _remote_code_config(raw: dict, arch: str):
    """A trust_remote_code config (model_type unknown to transformers, e.g. Kimi-K2's "kimi_k2")
    of an architecture whose HF config class transformers has: read with that class, so no
    remote code runs (and AutoConfig does not prompt for it). None for every other config."""
    from transformers import CONFIG_MAPPING

    from atom_core.models.registry import native_model_type

    native = native_model_type(arch)
    if native is None or raw.get("model_type") in CONFIG_MAPPING:
        return None
    return CONFIG_MAPPING[native].from_dict({k: v for k, v in raw.items() if k != "auto_map"})


_QUANT_MODULE_LISTS = ("modules_to_not_convert", "ignored_layers", "ignore")


def _text_model_config(hf_config, arch: str):
    """The `text_config` of a vision-language config (registry.serves_text_config), made the config of
    the whole model: it takes the outer architecture, the vision tower's config and image token ids,
    and the outer fields HF reads there
    (tie_word_embeddings: HF ties by the outer config; quantization_config, its module names moved from
    the checkpoint's model.language_model.* to the text model's model.*; dtype where the text part has none)."""
    text = copy.deepcopy(hf_config.text_config)
    text.architectures = [arch]
    # what the vision tower and the image placeholders need (models/qwen3_5.py; models/kimi_k25.py: the
    # projector's fields, and the published config's name for the image token)
    for key in ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                "projection_hidden_size", "projection_layer_norm_eps", "media_placeholder_token_id"):
        if getattr(hf_config, key, None) is not None:
            setattr(text, key, copy.deepcopy(getattr(hf_config, key)))
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(hf_config, "dtype", None)
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None:
        qc = dict(qc if isinstance(qc, dict) else qc.to_dict())
        for key in _QUANT_MODULE_LISTS:
            if qc.get(key):
                qc[key] = [e.replace("model.language_model.", "model.").replace(r"model\.language_model\.",
                                                                                 r"model\.") for e in qc[key]]
        text.quantization_config = qc
    return text


def resolve_model_files(model: str, tokenizer: str | None = None) -> ModelFiles:
    from transformers import AutoConfig

    from atom_core.models.registry import check_architectures, serves_text_config

    path = resolve_model_path(model)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read config.json of {path}: {e}") from e
    arch = check_architectures(raw.get("architectures"))
    try:
        hf_config = _remote_code_config(raw, arch) or AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as e:
        message = " ".join(str(e).split())  # one line for the CLI
        raise ValueError(f"cannot read config.json of {path}: {message}") from e
    if serves_text_config(arch):
        hf_config = _text_model_config(hf_config, arch)
    tok_path = Path(tokenizer) if tokenizer else (path if _has_tokenizer(path) else None)
    if tok_path is not None and not tok_path.is_dir():
        raise ValueError(f"tokenizer directory not found: {tok_path}")
    has_weights = any(path.glob("*.safetensors"))
    return ModelFiles(path, hf_config, tok_path, _eos_ids(path, hf_config), has_weights)


def resolve_model(config: ModelConfig, files: ModelFiles) -> ResolvedModel:
    """Everything the checkpoint decides, once, at engine start: architecture (checked against the
    model registry), dtype, max_model_len, EOS ids and the quantization format."""
    from atom_core.models.registry import check_architectures
    from atom_core.quant import get_quant_config

    hf = files.hf_config
    return ResolvedModel(
        hf_config=hf,
        path=files.path,
        architecture=check_architectures(getattr(hf, "architectures", None)),
        dtype=config.resolve_dtype(config_dtype(hf)),
        device=config.torch_device,
        max_model_len=config.resolve_max_model_len(hf),
        eos_token_ids=frozenset(files.eos_token_ids),
        vocab_size=hf.vocab_size,
        quant_config=get_quant_config(hf, config.quantization),
        seed=config.seed,
        load_format=config.load_format,
    )
