"""recipes/deepseek/nano_floor.py: the counted lower bound quoted for DeepSeek-V2-Lite's nano row."""
import importlib.util
import re
from pathlib import Path

RECIPE = Path(__file__).parents[2] / "recipes/deepseek/nano_floor.py"


def test_nano_floor_counts_the_workload(capsys):
    spec = importlib.util.spec_from_file_location("nano_floor", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    assert "256 requests, 142,827 prompt tokens, 133,966 output tokens" in out  # ANCHORS' workload
    bound = {m[0]: int(m[1].replace(",", "")) for m in re.findall(r"(uniform|concentrated)\s*:.*<= ([\d,]+) output", out)}
    # Reading every expert a step costs more than reading six: the uniform bound is the lower one.
    assert set(bound) == {"uniform", "concentrated"} and bound["uniform"] < bound["concentrated"]
