"""Runs inside the vLLM venv (not the test environment): each run of the JSON spec in argv[1] through
vllm.LLM, greedy, one after another in this process (vLLM imports once). Prints one line per run:
RESULT {"model", "class" (module:qualname of the model vLLM built), "atom_class" (the atom_core
class under our adapter, or null), "token_ids" (per prompt)}; a run marked "expect_error" (last in a
spec: a failed start may leave vLLM's process state behind) prints {"model", "error"} instead."""
from __future__ import annotations

import gc
import json
import sys


def run(spec: dict, llm_cls, sampling_params_cls) -> dict:
    if spec.get("expect_error"):  # a start that must fail: report its message
        try:
            llm_cls(model=spec["model"], **spec["llm_kwargs"])
        except Exception as exc:  # noqa: BLE001 - any start failure is the result here
            return {"model": spec["model"], "error": f"{type(exc).__name__}: {exc}"}
        return {"model": spec["model"], "error": None}
    llm = llm_cls(model=spec["model"], **spec["llm_kwargs"])

    def describe(model) -> tuple[str, str | None]:
        atom = getattr(type(model), "atom_model_class", None)
        return (f"{type(model).__module__}:{type(model).__qualname__}",
                f"{atom.__module__}:{atom.__qualname__}" if atom is not None else None)

    (cls, atom_cls), = llm.apply_model(describe)
    params = sampling_params_cls(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    result = {"model": spec["model"], "class": cls, "atom_class": atom_cls,
              "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}
    del llm
    gc.collect()
    import torch

    if torch.cuda.is_available():  # the next run's memory check and profiling see this one's memory released
        torch.cuda.empty_cache()
    return result


def main() -> None:
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        runs = json.load(f)
    for spec in runs:
        print("RESULT " + json.dumps(run(spec, LLM, SamplingParams)), flush=True)


if __name__ == "__main__":
    main()
