"""lm-eval integration: run lm-eval tasks against an atom_core server (or lm-eval's hf backend).

`run_eval(EvalConfig(...))` is the API; `atomctl eval` is its command. The built-in offline
tasks (`atom_arith_gen`, `atom_arith_mc`, tag `atom_arith`) live in `tasks/`.
"""

from atom_core.eval.runner import EvalConfig, EvalResult, LmEvalNotInstalledError, ScoreRow, run_eval

__all__ = ["EvalConfig", "EvalResult", "LmEvalNotInstalledError", "ScoreRow", "run_eval"]
