"""Running untrusted programs (policy-written code) in a throwaway sandbox process.

Layers, each independent of the others:
* **Limits** (setrlimit in the child): CPU seconds, address space, file size, open files, processes;
  a wall-clock timeout kills the whole process group; stdout/stderr are read up to a cap.
* **Clean environment**: only PATH/LANG/HOME; the parent's secrets are not inherited.
* **Namespaces** (when `unshare` works here, as root or with user namespaces): a new network namespace
  (no interface but a down loopback: nothing to connect to), a new PID namespace (the child cannot
  see or signal other processes; killing its init ends every descendant, so fork bombs die with it)
  and a new mount namespace in which the project directory, the home directory and the caller's
  extra paths are hidden under empty tmpfs mounts and /tmp and /dev/shm are private throwaway
  tmpfs mounts. As root the program then runs as `nobody`, so the process limit binds and it cannot
  write to anything it does not own.

`probe_isolation()` says which layers this machine supports; callers and tests read it.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

NOBODY_UID = 65534


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0
    cpu_s: int = 6  # a backstop above wall_s: the wall clock normally ends a runaway first
    memory_mb: int = 512
    file_size_mb: int = 8
    max_processes: int = 64
    max_open_files: int = 64
    max_output_bytes: int = 64 << 10
    hide_paths: tuple[str, ...] = ()  # more paths to hide, beyond the project and home directories


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    output_truncated: bool = False
    wall_s: float = 0.0
    isolation: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sandbox_python() -> str:
    """The interpreter that runs untrusted code: ASYNCRL_SANDBOX_PYTHON, else the system python3
    (readable by `nobody`, unlike a pyenv under /root), else this process's base interpreter. Never
    the project's venv, which is hidden inside the sandbox."""
    configured = os.environ.get("ASYNCRL_SANDBOX_PYTHON")
    if configured:
        return configured
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and os.stat(os.path.realpath(candidate)).st_mode & 0o005 == 0o005:
            return os.path.realpath(candidate)
    return os.path.realpath(sys.executable)


@functools.lru_cache(maxsize=1)
def probe_isolation() -> dict:
    """Which layers work on this machine: namespaces via `unshare`, and dropping to `nobody`."""
    unshare = shutil.which("unshare")
    namespaces = False
    if unshare:
        try:
            namespaces = subprocess.run(
                [unshare, "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "true"],
                capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            namespaces = False
    return {"namespaces": namespaces, "drop_to_nobody": os.geteuid() == 0, "unshare": unshare}


# Runs as the sandbox's PID 1 inside the new namespaces (as root there), hides paths, then becomes
# the untrusted program. Only the standard library; argv[1] is a JSON job description.
_LAUNCHER = r"""
import json, os, resource, subprocess, sys
job = json.loads(sys.argv[1])
workdir = os.open(job["workdir"], os.O_RDONLY)
def mount_tmpfs(path, size, mode):
    if os.path.isdir(path):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s,mode=%s,nosuid,nodev" % (size, mode), "tmpfs", path],
                       check=True)
for path in job["hide"]:
    mount_tmpfs(path, "1k", "0755")  # empty and read-only for the program
for path in ("/tmp", "/dev/shm", "/var/tmp"):
    mount_tmpfs(path, "64m", "1777")  # private scratch space, gone with the sandbox
# The work directory lived under the old /tmp: bring it back at a fixed path in the new one.
os.makedirs("/tmp/work")
subprocess.run(["mount", "--bind", "/proc/%d/fd/%d" % (os.getpid(), workdir), "/tmp/work"], check=True)
os.chdir("/tmp/work")
job["env"]["HOME"] = "/tmp/work"
for name, value in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if job["uid"] is not None:
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
os.execve(job["argv"][0], job["argv"], job["env"])
"""


def _rlimits(limits: SandboxLimits) -> dict[str, int]:
    return {
        "RLIMIT_CPU": limits.cpu_s,
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_FSIZE": limits.file_size_mb << 20,
        "RLIMIT_NOFILE": limits.max_open_files,
        "RLIMIT_NPROC": limits.max_processes,
        "RLIMIT_CORE": 0,
    }


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


def run_program(files: dict[str, str], argv: list[str], stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Write `files` into a fresh directory and run `argv` (argv[0] "python" means the sandbox
    interpreter) there with `stdin`. Never raises for anything the program does."""
    iso = probe_isolation()
    workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
    try:
        for name, text in files.items():
            path = os.path.join(workdir, name)
            if os.path.dirname(os.path.abspath(path)) != workdir:
                raise ValueError(f"sandbox file name {name!r} must be a plain name")
            with open(path, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
        argv = [sandbox_python() if argv[0] == "python" else argv[0], *argv[1:]]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1"}
        uid = NOBODY_UID if iso["drop_to_nobody"] else None
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
            for name in files:
                os.chown(os.path.join(workdir, name), uid, uid)
        if iso["namespaces"]:
            home = os.path.expanduser("~")
            hide = [p for p in {project_root(), home, *limits.hide_paths}
                    if p and os.path.isdir(p) and not workdir.startswith(p.rstrip("/") + "/")
                    and not sandbox_python().startswith(p.rstrip("/") + "/")]
            job = {"workdir": workdir, "hide": sorted(hide), "limits": _rlimits(limits), "uid": uid,
                   "argv": argv, "env": env}
            command = [iso["unshare"], "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
                       sandbox_python(), "-I", "-c", _LAUNCHER, json.dumps(job)]
            preexec = None
        else:
            command = argv
            rl = _rlimits(limits)
            if uid is None:
                rl.pop("RLIMIT_NPROC")  # per-user: would throttle the caller's own processes too

            def preexec():
                for name, value in rl.items():
                    resource.setrlimit(getattr(resource, name), (value, value))
                if uid is not None:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
        start = time.monotonic()
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=workdir, env=env, start_new_session=True, preexec_fn=preexec)
        out, err, flags = [], [], {}
        readers = [threading.Thread(target=_read_capped, args=(proc.stdout, limits.max_output_bytes, out, flags), daemon=True),
                   threading.Thread(target=_read_capped, args=(proc.stderr, limits.max_output_bytes, err, flags), daemon=True)]
        for t in readers:
            t.start()
        try:
            proc.stdin.write(stdin.encode("utf-8", errors="replace"))
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: forks included
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        for t in readers:
            t.join(timeout=2)
        return SandboxResult(
            returncode=None if timed_out else proc.returncode,
            stdout=b"".join(out).decode("utf-8", errors="replace"),
            stderr=b"".join(err).decode("utf-8", errors="replace"),
            timed_out=timed_out, output_truncated=bool(flags.get("truncated")),
            wall_s=time.monotonic() - start, isolation=dict(iso),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
