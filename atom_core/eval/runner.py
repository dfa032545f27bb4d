"""Run lm-eval tasks against an atom_core server, or with lm-eval's hf backend, and collect scores.

Backends:
  server  lm-eval's `local-completions` model (or `local-chat-completions` with
          apply_chat_template) against `base_url`; with no base_url, `atomctl serve` is started
          for `model` and stopped afterwards. Prompts are tokenized client-side with the model
          directory's HF tokenizer and sent as token ids (loglikelihood uses echo + logprobs).
  hf      lm-eval's `hf` model: transformers on the same weights, no server. The reference the
          server's scores are compared with.

lm-eval is an optional dependency (`pip install 'atomctl[eval]'`); without it run_eval raises
LmEvalNotInstalledError.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from atom_core.eval.server_process import ServerProcess
from atom_core.eval.tasks import TASKS_DIR

logger = logging.getLogger(__name__)

Backend = Literal["server", "hf"]
BACKENDS = ("server", "hf")
SERVED_MODEL_NAME = "atom-eval"
INSTALL_HINT = "lm-eval is not installed; pip install 'atomctl[eval]'"


class LmEvalNotInstalledError(ImportError):
    def __init__(self) -> None:
        super().__init__(INSTALL_HINT)


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation. Validated on construction; every field is final.

    model: a local HF model directory. For the server backend with no base_url it is served;
      with base_url it only names the tokenizer (default: the server's /v1/models `root`).
    limit: documents per task (an int), or a fraction of each task when below 1.
    """

    tasks: tuple[str, ...]
    model: str | None = None
    base_url: str | None = None
    tokenizer: str | None = None
    backend: Backend = "server"
    num_fewshot: int | None = None
    limit: int | float | None = None
    num_concurrent: int = 8
    output_path: Path | None = None
    apply_chat_template: bool = False
    serve_args: tuple[str, ...] = ()
    server_ready_timeout_s: float = 600.0
    hf_device: str = "cpu"
    hf_dtype: str = "auto"
    hf_batch_size: int = 32
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.tasks or any(not t.strip() for t in self.tasks):
            raise ValueError(f"invalid --tasks {','.join(self.tasks)!r}; expected comma-separated task names, "
                             "e.g. atom_arith_gen,atom_arith_mc")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected one of: {', '.join(BACKENDS)}")
        if self.backend == "hf" and (self.model is None or self.base_url is not None):
            raise ValueError("the hf backend runs transformers on --model itself; pass --model DIR and no --base-url")
        if self.backend == "server" and self.model is None and self.base_url is None:
            raise ValueError("pass --model (a server is started for it) or --base-url (a running server)")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"invalid --base-url {self.base_url!r}; expected e.g. http://127.0.0.1:8000/v1")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"invalid --num-fewshot {self.num_fewshot}; expected 0 or more")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"invalid --limit {self.limit}; expected a count >= 1 or a fraction in (0, 1)")
        if self.num_concurrent < 1:
            raise ValueError(f"invalid --num-concurrent {self.num_concurrent}; expected 1 or more")


@dataclass(frozen=True)
class ScoreRow:
    task: str
    metric: str
    filter: str
    value: float
    stderr: float | None
    num_fewshot: int
    num_samples: int


@dataclass
class EvalResult:
    rows: list[ScoreRow]
    raw: dict[str, Any] = field(repr=False)   # lm-eval's results dict, without per-sample logs
    written: list[Path] = field(default_factory=list)

    def score(self, task: str, metric: str) -> float:
        for row in self.rows:
            if row.task == task and row.metric == metric:
                return row.value
        raise KeyError(f"no {metric!r} score for task {task!r}")


def import_lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager  # noqa: F401 - part of what "installed" means here
    except ImportError as e:
        raise LmEvalNotInstalledError() from e
    return lm_eval


def run_eval(config: EvalConfig) -> EvalResult:
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager

    _quiet_lm_eval_warnings()
    task_manager = TaskManager(include_path=str(TASKS_DIR))
    unknown = [t for t in config.tasks if t not in task_manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {', '.join(unknown)}; built in: atom_arith_gen, atom_arith_mc "
                         "(tag atom_arith), or any task `lm-eval ls tasks` lists")
    if config.backend == "hf":
        return _evaluate(lm_eval, task_manager, config, "hf", _hf_model_args(config))
    if config.base_url is not None:
        return _evaluate(lm_eval, task_manager, config, *_server_model(config, config.base_url, None))
    with ServerProcess(config.model, SERVED_MODEL_NAME, config.serve_args,
                       ready_timeout_s=config.server_ready_timeout_s) as server:
        logger.info("started %s", " ".join(server.command))
        return _evaluate(lm_eval, task_manager, config, *_server_model(config, server.root_url, SERVED_MODEL_NAME))


def endpoint_url(base_url: str, chat: bool) -> str:
    """http://h:p, http://h:p/v1 or a full endpoint URL -> the completions (or chat) endpoint."""
    url = base_url.rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
            break
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return f"{url}/v1/chat/completions" if chat else f"{url}/v1/completions"


def _server_model(config: EvalConfig, base_url: str, served_name: str | None) -> tuple[str, dict]:
    """lm-eval model type and model_args for a server; asks its /v1/models what it serves."""
    card = _model_card(endpoint_url(base_url, chat=False).removesuffix("/completions") + "/models")
    name = served_name or card["id"]
    tokenizer = config.tokenizer or config.model or card.get("root")
    args: dict[str, Any] = {"model": name, "num_concurrent": config.num_concurrent, "max_retries": 3,
                            "seed": config.seed}
    if card.get("max_model_len"):
        args["max_length"] = int(card["max_model_len"])
    if config.apply_chat_template:
        args.update(base_url=endpoint_url(base_url, chat=True), tokenizer_backend=None, tokenized_requests=False)
        return "local-chat-completions", args
    if tokenizer is None or not Path(tokenizer).is_dir():
        raise ValueError(f"lm-eval needs the model's tokenizer and {tokenizer!r} is no local directory; "
                         "pass --tokenizer DIR (or --model DIR)")
    args.update(base_url=endpoint_url(base_url, chat=False), tokenizer_backend="huggingface", tokenizer=tokenizer,
                tokenized_requests=True)
    return "local-completions", args


def _model_card(models_url: str) -> dict:
    try:
        response = httpx.get(models_url, timeout=10.0)
        response.raise_for_status()
        return response.json()["data"][0]
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server's model list at {models_url}: {e}") from e
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"unexpected answer from {models_url}: {e}") from e


def _hf_model_args(config: EvalConfig) -> dict:
    return {"pretrained": config.model, "tokenizer": config.tokenizer or config.model,
            "device": config.hf_device, "dtype": config.hf_dtype, "batch_size": config.hf_batch_size}


def _evaluate(lm_eval, task_manager, config: EvalConfig, model_type: str, model_args: dict) -> EvalResult:
    logger.info("lm-eval model %s %s", model_type, model_args)
    results = lm_eval.simple_evaluate(
        model=model_type,
        model_args=model_args,
        tasks=list(config.tasks),
        num_fewshot=config.num_fewshot,
        limit=config.limit,
        task_manager=task_manager,
        apply_chat_template=config.apply_chat_template,
        log_samples=config.output_path is not None,
        batch_size=model_args.pop("batch_size", 1),
        random_seed=config.seed,
        numpy_random_seed=config.seed,
        torch_random_seed=config.seed,
        fewshot_random_seed=config.seed,
    )
    if results is None:  # lm-eval returns None on ranks other than 0; there is one rank here
        raise RuntimeError("lm-eval returned no results")
    samples = results.pop("samples", None)
    written = _write_outputs(config.output_path, results, samples) if config.output_path else []
    return EvalResult(rows=score_rows(results), raw=results, written=written)


def score_rows(results: dict) -> list[ScoreRow]:
    """lm-eval's results dict -> one row per (task, metric, filter), stderr beside its metric."""
    rows = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            rows.append(ScoreRow(
                task=task, metric=metric, filter=filter_name, value=float(value),
                stderr=float(stderr) if isinstance(stderr, (int, float)) else None,
                num_fewshot=int(results.get("n-shot", {}).get(task, 0) or 0),
                num_samples=int(results.get("n-samples", {}).get(task, {}).get("effective", 0)),
            ))
    return rows


def _write_outputs(output_path: Path, results: dict, samples: dict | None) -> list[Path]:
    """results.json (lm-eval's dict) and samples_<task>.jsonl (one line per document) in output_path."""
    output_path.mkdir(parents=True, exist_ok=True)
    written = [output_path / "results.json"]
    written[0].write_text(json.dumps(results, indent=2, default=str) + "\n")
    for task, task_samples in (samples or {}).items():
        path = output_path / f"samples_{task}.jsonl"
        with path.open("w") as f:
            for sample in task_samples:
                f.write(json.dumps(sample, default=str) + "\n")
        written.append(path)
    return written


class _DropCustomDatasetNotice(logging.Filter):
    """lm-eval warns on every task that loads data through a function, as atom_arith does."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def _quiet_lm_eval_warnings() -> None:
    task_logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _DropCustomDatasetNotice) for f in task_logger.filters):
        task_logger.addFilter(_DropCustomDatasetNotice())
