"""lm-eval task definitions shipped with atom_core; pass TASKS_DIR as lm-eval's include path.

atom_arith/: the demo model's held-out arithmetic split, as a generation task (exact match)
and a multiple-choice task (loglikelihood accuracy); atom_arith_gen_chat is the generation task
for --apply-chat-template (the bare question; the template adds the chat format). Any other lm-eval task name also works
wherever its dataset is reachable.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
BUILTIN_TASKS = ("atom_arith_gen", "atom_arith_mc")
BUILTIN_TAGS = ("atom_arith",)
