"""Run the README's commands as written, from the repository root, and report each one's exit
status and time. Bounded: each command has a time limit, `serve run` is stopped with Ctrl-C.

    python load_tests/readme_commands.py          # the Serve block (serve run, curl, serve status,
                                                  # the Python client snippet, eval --endpoint) and
                                                  # the commands that take a few minutes at most
    python load_tests/readme_commands.py --all    # every command, the embedded model's training
                                                  # and `make test` included (hours on 2 cores)

`tests/test_readme.py` checks every command statically in CI (it parses, its config composes, its
script and flags exist); this script is the check that runs them.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

# Commands run by default: seconds to minutes each on 2 cores. Everything else needs --all.
SHORT = ("asyncrl train model=tiny", "asyncrl generate", "asyncrl data example", "load_tests/faults.py --quick")
# The Serve block: run while `serve run` serves.
WITH_SERVE = ("curl ", "serve status", "asyncrl eval --endpoint", "asyncrl scale")
ADMIN_TOKEN = "secret"  # the README's scaling commands use it


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", open(README).read(), re.S)


def readme_commands() -> list[str]:
    """Every shell command of the README's bash blocks, in order, comments removed."""
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"(^|\s+)#(\s.*)?$", "", line).strip()  # the README's comments: "  # ..."
            if command:
                commands.append(command)
    return commands


def readme_python() -> list[str]:
    return _blocks("python")


def _run(command: str, limit_s: float, env: dict | None = None) -> tuple[int | str, float, str]:
    start = time.monotonic()
    try:
        out = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=limit_s,
                             env={**os.environ, **(env or {})})
        return out.returncode, time.monotonic() - start, (out.stdout + out.stderr)[-600:]
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""


def _wait_for_serve(url: str, limit_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).json().get("step", 0) >= 1:
                return True
        except Exception:
            pass
        time.sleep(2.0)
    return False


def run_serve_block(commands: list[str], limit_s: float, report: list) -> None:
    serve_run = next(c for c in commands if ".venv/bin/serve run" in c)
    # Its own process group: Ctrl-C reaches it as it would from a terminal.
    process = subprocess.Popen(serve_run, shell=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True, env={**os.environ, "ASYNCRL_ADMIN_TOKEN": ADMIN_TOKEN})
    start = time.monotonic()
    try:
        ready = _wait_for_serve("http://127.0.0.1:8000/train/status", 600)
        report.append((serve_run, "serving" if ready else "not ready", time.monotonic() - start, ""))
        if not ready:
            return
        for command in commands:
            if any(key in command for key in WITH_SERVE):
                report.append((command, *_run(command, limit_s)))
        for snippet in readme_python():
            rc, seconds, tail = _run(f"{shlex.quote(sys.executable)} -c {shlex.quote(snippet)}", limit_s)
            report.append(("(README's Python client snippet)", rc, seconds, tail))
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also the long commands (hours)")
    parser.add_argument("--limit-s", type=float, default=900.0, help="time limit of one command")
    args = parser.parse_args()
    commands = readme_commands()
    report: list = []
    run_serve_block(commands, args.limit_s, report)
    for command in commands:
        if ".venv/bin/serve run" in command or any(key in command for key in WITH_SERVE) \
                or "readme_commands.py" in command:  # run above, or this script itself
            continue
        if command.startswith("docker") and shutil.which("docker") is None:
            report.append((command, "skipped: no docker here", 0.0, ""))
        elif args.all or any(key in command for key in SHORT):
            report.append((command, *_run(command, args.limit_s * (8 if args.all else 1))))
        else:
            report.append((command, "not run (--all)", 0.0, ""))
    if args.all and any("ray start" in r[0] and r[1] == 0 for r in report):
        _run(".venv/bin/ray stop", 120)  # the README's cluster head, started above
    width = max(len(r[0]) for r in report)
    for command, status, seconds, tail in report:
        print(f"{command:<{width}}  {status!s:>16}  {seconds:7.1f} s")
        if status not in (0, "serving") and not str(status).startswith(("skipped", "not run")) and tail:
            print("    " + tail.strip().replace("\n", "\n    "))
    failed = [r for r in report if r[1] not in (0, "serving") and not str(r[1]).startswith(("skipped", "not run"))]
    print(f"{len(report) - len(failed)} of {len(report)} ok" + (f"; failed: {len(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
