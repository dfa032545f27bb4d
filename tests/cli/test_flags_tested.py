"""Every flag of every atomctl command is named in some test (as `--flag` or its keyword `flag_name`):
a flag added without a test fails here with the list. Naming is the floor, not the test itself:
each flag's test is beside its command's."""
from __future__ import annotations

from pathlib import Path

from tests.cli.test_help import CLICK_APP, PATHS

TESTS = Path(__file__).resolve().parent.parent


def _command(path: tuple[str, ...]):
    cmd = CLICK_APP
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def test_every_flag_is_named_in_a_test():
    text = "\n".join(p.read_text(errors="ignore") for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)
    flags = {(" ".join(path), opt) for path in PATHS if not hasattr(_command(path), "commands")
             for param in _command(path).params for opt in param.opts
             if opt.startswith("--") and opt not in ("--help", "--install-completion", "--show-completion")}
    assert len(flags) > 300  # the walk reached the commands
    untested = sorted(f"atomctl {cmd} {opt}" for cmd, opt in flags
                      if opt not in text and opt[2:].replace("-", "_") not in text)
    assert not untested, "flags no test names:\n" + "\n".join(untested)
