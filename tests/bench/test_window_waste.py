"""The window-waste diagnostic: batch-1 answers that stop at a stop token, per window length."""
import pytest

from benchmarks.engine.window_waste import main


def test_a_row_per_window_length_and_answer(tiny_llama, capsys):
    main([str(tiny_llama), "--answers", "3,6", "--steps", "1,4", "--requests", "2", "--input-len", "8",
          "device=cpu", "dtype=float32", "num_kv_blocks=64"])
    header, *rows = capsys.readouterr().out.strip().splitlines()
    assert header.startswith("num_scheduler_steps | answer_len")
    cells = [row.split(" | ") for row in rows]
    assert [(c[0], c[1]) for c in cells] == [("1", "3"), ("1", "6"), ("4", "3"), ("4", "6")]
    for steps, answer, mean_tokens, tok_s, ms in cells:
        assert 0 < float(mean_tokens) <= int(answer) and float(tok_s) > 0 and float(ms) > 0
    # windows give the single steps' tokens, so each answer stops where it did at one step a time
    assert [c[2] for c in cells[:2]] == [c[2] for c in cells[2:]]


@pytest.mark.parametrize("args", [["--answers", "a"], ["--steps", "1,x"], ["--answers", "0"], ["--requests", "0"]])
def test_bad_lists_are_usage_errors(tiny_llama, capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tiny_llama), *args])
    assert exit_info.value.code == 2
    assert "--answers" in capsys.readouterr().err
