"""Run one named benchmark set (benchmarks/sets.py) on a GPU machine.

    python -m benchmarks.run_set NAME [NAME ...] [--out-dir DIR] [--deadline-s S]
    python -m benchmarks.run_set --list
    python -m benchmarks.run_set NAME --dry-run     # check every command without running it

Each step's output goes to DIR/STEP.log and to the terminal; a table of exit codes and seconds
comes last. A step whose time limit would pass --deadline-s is skipped, so several sets can share
one device call without outrunning it. Exit status: 0 when every step ran and exited 0.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sets import SETS, BenchSet, Step

REPO = Path(__file__).resolve().parent.parent
_NEWEST = re.compile(r"\{newest:([^}]+)\}")


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # an exit code, "timeout" or "skipped"
    seconds: float


def expand(command: str, out_dir: Path, resolve_newest: bool = True) -> list[str]:
    """The argv of a step: `{out}` filled in, `atomctl` and `python` run by this interpreter."""
    text = command.replace("{out}", str(out_dir))
    if resolve_newest:
        text = _NEWEST.sub(lambda m: _newest(m.group(1)), text)
    argv = shlex.split(text)
    if argv[0] == "atomctl":
        return [sys.executable, "-m", "atomctl.main", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    raise ValueError(f"unknown executable {argv[0]!r} in {command!r}; expected one of: atomctl, python")


def _newest(pattern: str) -> str:
    found = sorted(glob.glob(pattern), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no file matches {pattern}")
    return found[-1]


def check(step: Step) -> None:
    """Raise ValueError unless the step's command would start: its module exists and, for atomctl,
    the subcommand exists and accepts the options as written."""
    argv = expand(step.command, Path("/tmp/out"), resolve_newest=False)
    argv = [_NEWEST.sub("TRACE", a) for a in argv]
    if argv[1:3] == ["-m", "atomctl.main"]:
        _check_atomctl(step, argv[3:])
    elif argv[1] == "-m":
        if importlib.util.find_spec(argv[2]) is None:
            raise ValueError(f"step {step.name}: no module {argv[2]}")
    else:
        raise ValueError(f"step {step.name}: expected `python -m MODULE ...`, got {step.command!r}")
    if step.timeout_s <= 0:
        raise ValueError(f"step {step.name}: timeout_s must be positive, got {step.timeout_s}")


def _check_atomctl(step: Step, args: list[str]) -> None:
    import typer

    from atomctl.main import app

    # Typer may bring its own copy of click, so the walk goes by the commands' own methods and classes.
    command = typer.main.get_command(app)
    path = []
    while hasattr(command, "get_command") and args and not args[0].startswith("-"):
        sub = command.get_command(command.context_class(command), args[0])
        if sub is None:
            raise ValueError(f"step {step.name}: atomctl has no command {' '.join([*path, args[0]])!r}")
        path.append(args.pop(0))
        command = sub
    try:
        command.make_context(" ".join(["atomctl", *path]), list(args), resilient_parsing=False)
    except Exception as e:
        if not hasattr(e, "format_message"):  # a click usage error carries one; anything else is a bug
            raise
        raise ValueError(f"step {step.name}: atomctl {' '.join(path)}: {e.format_message()}") from e


def _wait_healthy(server: subprocess.Popen, url: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def _port(server: str) -> int:
    argv = shlex.split(server)
    if "--port" not in argv:
        raise ValueError(f"the server command needs --port: {server!r}")
    return int(argv[argv.index("--port") + 1])


def _copy_lines(source, log) -> None:
    for line in source:
        sys.stdout.write(line)
        log.write(line)


def run_step(step: Step, out_dir: Path, deadline: float) -> Outcome:
    start = time.monotonic()
    if start + step.timeout_s > deadline:
        print(f"=== {step.name} skipped (deadline)", flush=True)
        return Outcome(step.name, "skipped", 0.0)
    print(f"=== {step.name}", flush=True)
    with open(out_dir / f"{step.name}.log", "w") as log:
        try:
            argv = expand(step.command, out_dir)
        except FileNotFoundError as e:
            print(e, file=log)
            print(e, flush=True)
            return Outcome(step.name, "missing input", 0.0)
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        pump = threading.Thread(target=_copy_lines, args=(proc.stdout, log), daemon=True)
        pump.start()
        try:
            status = str(proc.wait(timeout=step.timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            status = "timeout"
        pump.join()
    return Outcome(step.name, status, time.monotonic() - start)


def run_set(name: str, bench_set: BenchSet, out_dir: Path, deadline: float) -> list[Outcome]:
    server = None
    if bench_set.server is not None:
        port = _port(bench_set.server)
        log = open(out_dir / f"{name}-server.log", "w")
        server = subprocess.Popen(expand(bench_set.server, out_dir), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        if server is not None:
            _wait_healthy(server, f"http://127.0.0.1:{port}/health", timeout_s=600)
        return [run_step(step, out_dir, deadline) for step in bench_set.steps]
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait()
            log.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_set", description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME", help=f"sets to run, in order: {', '.join(SETS)}")
    p.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")),
                   help="logs and results ($OUT, else /tmp/out)")
    p.add_argument("--deadline-s", type=float, default=None, help="skip steps that would end after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="check the commands, run nothing")
    p.add_argument("--list", action="store_true", help="print the sets and their steps")
    a = p.parse_args(argv)
    unknown = [n for n in a.names if n not in SETS]
    if unknown:
        p.error(f"unknown set {', '.join(unknown)}; expected one of: {', '.join(SETS)}")
    if not a.names and not a.list:
        p.error(f"name a set: {', '.join(SETS)} (or --list)")
    if a.deadline_s is not None and a.deadline_s <= 0:
        p.error(f"--deadline-s must be positive, got {a.deadline_s}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.list:
        for name in a.names or SETS:
            print(f"{name}: {SETS[name].description}")
            for step in SETS[name].steps:
                print(f"  {step.name:<28} {step.command}")
        return 0
    if a.dry_run:
        for name in a.names:
            for step in SETS[name].steps:
                check(step)
            if SETS[name].server is not None:
                check(Step(f"{name}-server", SETS[name].server, 1))
                _port(SETS[name].server)
        print(f"ok: {sum(len(SETS[n].steps) for n in a.names)} commands")
        return 0
    a.out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (a.deadline_s if a.deadline_s is not None else float("inf"))
    outcomes = [o for name in a.names for o in run_set(name, SETS[name], a.out_dir, deadline)]
    print("\n" + "\n".join(f"{o.name:<28} {o.status:>8} {o.seconds:6.0f}s" for o in outcomes))
    return 0 if all(o.status == "0" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
