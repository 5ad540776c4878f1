"""A sandboxed process from its start to its end (`asyncrl.rewards.sandbox` builds the command):
its stdin fed from a thread, its stdout and stderr read and capped, and all of it killed at the
wall-clock limit or its end: its process group, and through `kill_escaped` (the sandbox's cgroup)
whatever left that group (setsid). A reward call that stops (`asyncrl.rewards.calls`) kills it at
once, and `CallStopped` says so: a program cut short is no verdict on it."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from asyncrl.rewards.calls import current_call


@dataclass
class Ended:
    returncode: int | None  # None: killed at the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    wall_s: float


def supervise(command: list[str], cwd: str, env: dict, preexec, stdin: str, wall_s: float, max_output_bytes: int,
              kill_escaped: Callable[[], None] | None = None) -> Ended:
    call = current_call()
    call.check()
    start = time.monotonic()
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd, env=env, start_new_session=True, preexec_fn=preexec)
    out, err, flags = [], [], {}
    threads = [threading.Thread(target=_read_capped, args=(proc.stdout, max_output_bytes, out, flags), daemon=True),
               threading.Thread(target=_read_capped, args=(proc.stderr, max_output_bytes, err, flags), daemon=True),
               threading.Thread(target=_write_stdin, args=(proc.stdin, stdin.encode("utf-8", errors="replace")), daemon=True)]
    for t in threads:
        t.start()
    forget = call.on_stop(lambda: _kill_group(proc.pid))
    timed_out = False
    try:
        proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        forget()
        _kill_group(proc.pid)  # unshare dies -> --kill-child ends the namespace
        if kill_escaped is not None:
            kill_escaped()
        proc.wait()
    for t in threads:
        t.join(timeout=2)
    call.check()
    return Ended(returncode=None if timed_out else proc.returncode,
                 stdout=b"".join(out).decode("utf-8", errors="replace"),
                 stderr=b"".join(err).decode("utf-8", errors="replace"),
                 timed_out=timed_out, output_truncated=bool(flags.get("truncated")), wall_s=time.monotonic() - start)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(stream, cap: int, out: list, flags: dict) -> None:
    total = 0
    while True:
        chunk = stream.read(8192)
        if not chunk:
            return
        if total < cap:
            out.append(chunk[: cap - total])
        total += len(chunk)
        if total > cap:
            flags["truncated"] = True


def _write_stdin(stream, data: bytes) -> None:
    try:
        stream.write(data)
    except (BrokenPipeError, OSError, ValueError):
        pass  # the program ended or closed its stdin: what it did not read does not matter
    finally:
        try:
            stream.close()
        except (BrokenPipeError, OSError):
            pass
