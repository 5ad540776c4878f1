"""Running untrusted programs (policy-written code) in a throwaway sandbox.

What the program sees is an allow-list, not the host with parts hidden: a new root holding only
the interpreter, its standard library and the shared libraries they load (all read-only), /dev's
null/zero/random, a private /proc and /tmp, and its own work directory (a size-capped tmpfs with
the test files copied in). Nothing else of the host exists for it: not the project, not a sibling
checkout, not a dataset's answers or a run's checkpoints.

Layers:
* **Namespaces**: new mount, PID, network (a down loopback only), IPC and UTS namespaces, made by
  `unshare` as root, or, where that is refused (a container's seccomp profile), inside a new user
  namespace, which works unprivileged. The sandbox's PID 1 is a small init (`LAUNCHER`) that
  builds the root, starts the program and reaps every orphan; when the program ends, PID 1 exits
  and the kernel kills whatever is left (`setsid()` escapes nothing).
* **No privilege**: as root the program runs as a uid of its own (one per sandbox, so process
  limits and signals never reach another sandbox); in a user namespace it keeps uid 0 there with
  an empty capability bounding set. `no_new_privs` in both.
* **A seccomp filter** (`asyncrl.rewards.sandbox_seccomp`), installed in the program's process
  just before its exec: EPERM for what a test program never needs and an escape would (ptrace,
  mount, unshare/setns and namespace flags to clone, kernel modules, eBPF, keyrings, sockets other
  than AF_UNIX, ...). Where libseccomp or the kernel's support is missing it is `off (why)`, logged,
  and the rest still applies.
* **One cgroup per sandbox** (`asyncrl.rewards.cgroup`): memory and process count over all its
  processes together, and a kill that reaches all of them. Where this process cannot create one
  (Docker, most non-root hosts) memory is limited per process only (64 processes of 512 MB each),
  so `run_program` refuses with `SandboxUnavailable` unless the caller opted in
  (`SandboxLimits.allow_no_cgroup`, or `ASYNCRL_SANDBOX_ALLOW_NO_CGROUP=1`), and says so loudly when it runs.
* **Dies with its caller**: the sandbox's first process gets a parent-death signal (SIGKILL), so a
  killed reward endpoint leaves no program running (in namespaces, its PID 1 and everything under
  it go with it).
* **rlimits** per process (CPU seconds, address space, file size, open files) and a wall-clock
  timeout; stdout/stderr read up to a cap; stdin written from its own thread, so a program that
  never reads cannot block the caller.
* **Clean environment**: only PATH/LANG/HOME.

With no namespaces at all there is no isolation to speak of; `run_program` then refuses with
`SandboxUnavailable` unless the caller opted in (`SandboxLimits.allow_unisolated`, or
`ASYNCRL_SANDBOX_ALLOW_UNISOLATED=1`), and says so loudly when it does run.

`probe_isolation()` says which layers this machine supports (`seccomp`: "on" or "off (why)"); callers
and tests read it, and each `SandboxResult.isolation` says which ran.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import itertools
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from asyncrl.rewards.cgroup import SandboxCgroup, cgroup_layout
from asyncrl.rewards.sandbox_init import LAUNCHER
from asyncrl.rewards.sandbox_seccomp import SeccompFilter, install_filter, seccomp_filter
from asyncrl.rewards.supervisor import supervise

log = logging.getLogger(__name__)

# Sandbox uids, one per sandbox run by this process: far above any real account.
_UID_BASE = 1_000_000
_UIDS = itertools.count()
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a child between fork and exec only calls it
ISOLATION_MODES = ("auto", "namespaces", "user_namespaces", "unisolated")


class SandboxUnavailable(RuntimeError):
    """No isolation can be had here and the caller did not opt in to running code without it."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0
    cpu_s: int = 6  # a backstop above wall_s: the wall clock normally ends a runaway first
    memory_mb: int = 512  # the whole sandbox (a cgroup) where cgroups work; else each process
    file_size_mb: int = 8
    disk_mb: int = 64  # the work directory and /tmp, each a tmpfs of this size
    max_processes: int = 64
    max_open_files: int = 64
    max_output_bytes: int = 64 << 10
    allow_paths: tuple[str, ...] = ()  # more host paths the program may read (e.g. a package dir)
    isolation: str = "auto"  # auto | namespaces | user_namespaces | unisolated
    allow_unisolated: bool = False  # run with rlimits alone where no namespace can be made
    allow_no_cgroup: bool = False  # run where no cgroup can be made (memory then limited per process)


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
    (a plain interpreter with nothing installed into it), else this process's base interpreter.
    Only its standard library is visible inside; never a venv's packages."""
    configured = os.environ.get("ASYNCRL_SANDBOX_PYTHON")
    if configured:
        return configured
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and os.stat(os.path.realpath(candidate)).st_mode & 0o005 == 0o005:
            return os.path.realpath(candidate)
    return os.path.realpath(sys.executable)


@functools.lru_cache(maxsize=4)
def interpreter_paths(python: str) -> tuple[str, ...]:
    """The host paths an interpreter needs: itself, its standard library (lib-dynload included)
    and the directories of the shared libraries it and its extension modules load (from `ldd`)."""
    info = json.loads(subprocess.run(
        [python, "-I", "-S", "-c",
         "import json, sys, sysconfig; print(json.dumps([sys.executable, sysconfig.get_path('stdlib'), "
         "sysconfig.get_path('platstdlib'), sysconfig.get_config_var('DESTSHARED') or '']))"],
        capture_output=True, text=True, timeout=30, check=True).stdout)
    paths = {python, *[p for p in info if p]}
    objects = [os.path.realpath(python), *glob.glob(os.path.join(info[3] or info[1], "*.so"))]
    ldd = subprocess.run(["ldd", *objects], capture_output=True, text=True, timeout=30).stdout if shutil.which("ldd") else ""
    for line in ldd.splitlines():
        for token in line.replace("=>", " ").split():
            if token.startswith("/") and os.path.exists(token):
                paths.add(os.path.dirname(token))  # the directory: libraries load their own deps from it
    return tuple(sorted(paths))


def _tree(paths: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(symlinks to recreate, real paths to bind) so that every path in `paths` resolves inside
    the new root as it does on the host (e.g. /lib64 -> usr/lib64 for the dynamic loader)."""
    links, binds = {}, set()
    pending = list(paths)
    while pending:
        path = os.path.normpath(pending.pop())
        parts, current = path.strip("/").split("/"), "/"
        for i, part in enumerate(parts):
            current = os.path.join(current, part)
            if os.path.islink(current):
                target = os.readlink(current)
                links[current] = target
                rest = os.path.join(*parts[i + 1:]) if i + 1 < len(parts) else ""
                resolved = os.path.normpath(os.path.join(os.path.dirname(current), target, rest))
                pending.append(resolved)
                break
        else:
            if os.path.exists(path):
                binds.add(path)
    # A path under another bound directory comes with it.
    kept = [p for p in sorted(binds) if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in binds)]
    return sorted(links.items()), kept




def _unshare_command(mode: str) -> list[str]:
    unshare = shutil.which("unshare")
    if not unshare:
        raise SandboxUnavailable("no `unshare` on this machine (util-linux)")
    user = ["--user", "--map-root-user"] if mode == "user_namespaces" else []
    return [unshare, *user, "--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child"]


@functools.lru_cache(maxsize=8)
def _mode_works(mode: str, python: str) -> bool:
    """Does a full sandbox start in `mode` here? Tried once with a trivial program."""
    if mode == "namespaces" and os.geteuid() != 0:
        return False
    try:
        result = _run(mode, {}, [python, "-I", "-S", "-c", "print('ok')"], "", SandboxLimits(wall_s=20), python)
    except (OSError, SandboxUnavailable, subprocess.SubprocessError):
        return False
    return result.returncode == 0 and result.stdout.strip() == "ok"


def probe_isolation(python: str | None = None) -> dict:
    """Which layers work on this machine: the namespace mode `auto` picks, cgroups, and the
    seccomp filter ("on", or "off (why)")."""
    python = python or sandbox_python()
    modes = [m for m in ("namespaces", "user_namespaces") if _mode_works(m, python)]
    layout = cgroup_layout()
    return {"mode": modes[0] if modes else "none", "modes": modes, "namespaces": bool(modes),
            "user_namespaces": "user_namespaces" in modes, "cgroups": layout.get("version", 0),
            "seccomp": seccomp_filter().state}


def _resolve_mode(limits: SandboxLimits, python: str) -> str:
    if limits.isolation not in ISOLATION_MODES:
        raise ValueError(f"sandbox isolation {limits.isolation!r}; expected one of {ISOLATION_MODES}")
    if limits.isolation != "auto":
        return limits.isolation
    modes = probe_isolation(python)["modes"]
    if modes:
        return modes[0]
    if limits.allow_unisolated or os.environ.get("ASYNCRL_SANDBOX_ALLOW_UNISOLATED") == "1":
        _warn_unisolated(seccomp_filter().state)
        return "unisolated"
    raise SandboxUnavailable(
        "cannot isolate untrusted code here: neither `unshare` as root nor a user namespace works (a container's "
        "seccomp profile refuses both; in Docker, add --cap-add SYS_ADMIN). Run where one works, or opt in to "
        "running code rewards without isolation (code_allow_unisolated=true on the reward endpoint, or "
        "ASYNCRL_SANDBOX_ALLOW_UNISOLATED=1)")


def _check_cgroup(limits: SandboxLimits) -> None:
    """No cgroup here: refuse, unless the caller opted in (then say so, once, loudly)."""
    if cgroup_layout():
        return
    if limits.allow_no_cgroup or os.environ.get("ASYNCRL_SANDBOX_ALLOW_NO_CGROUP") == "1":
        _warn_no_cgroup(limits.memory_mb, limits.max_processes)
        return
    raise SandboxUnavailable(
        f"no memory cgroup can be made here (not root, no delegated cgroup: Docker and most hosts), so a "
        f"sandbox's memory would be limited per process only: {limits.max_processes} processes of "
        f"{limits.memory_mb} MB each. Run where cgroups work (root, or a delegated cgroup v2 subtree with "
        f"ASYNCRL_SANDBOX_CGROUP=1), or opt in (code_allow_no_cgroup=true on the reward endpoint, "
        f"environment.allow_no_cgroup=true, or ASYNCRL_SANDBOX_ALLOW_NO_CGROUP=1)")


@functools.lru_cache(maxsize=1)
def _warn_no_cgroup(memory_mb: int, max_processes: int) -> None:
    log.error("RUNNING POLICY-WRITTEN CODE WITHOUT A MEMORY CGROUP: memory is limited per process only "
              "(%d processes of %d MB each can be held at once). You opted in.", max_processes, memory_mb)


def _parent_death_signal(parent: int) -> None:
    """In the child before exec: SIGKILL when the process that started it dies (its thread, in
    fact: the one that runs the sandbox and waits for it). If the parent is gone already, exit."""
    if _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0):  # PR_SET_PDEATHSIG
        os._exit(125)
    if os.getppid() != parent:
        os._exit(125)


@functools.lru_cache(maxsize=2)
def _warn_unisolated(seccomp: str) -> None:
    reach = "reach the network, " if seccomp != "on" else "use its Unix sockets, "
    log.error("RUNNING POLICY-WRITTEN CODE WITHOUT ISOLATION: it can read this machine's files, %sand signal this "
              "user's processes. Only resource limits and the seccomp filter (%s) apply. You opted in.", reach, seccomp)


def _rlimits(limits: SandboxLimits) -> dict[str, int]:
    return {
        "RLIMIT_CPU": limits.cpu_s,
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_FSIZE": limits.file_size_mb << 20,
        "RLIMIT_NOFILE": limits.max_open_files,
        "RLIMIT_CORE": 0,
    }


def _new_uid() -> int:
    """A uid no other sandbox of this machine holds now: this process's block, then a counter."""
    return _UID_BASE + os.getpid() % 4096 * 4096 + next(_UIDS) % 4096


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        try:
            count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
        except OSError:
            pass
    return count


def run_program(files: dict[str, str], argv: list[str], stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Put `files` in a fresh work directory and run `argv` (argv[0] "python" means the sandbox
    interpreter) there with `stdin`. Never raises for anything the program does; raises
    `SandboxUnavailable` when it cannot isolate it and the caller did not opt out of isolation."""
    python = sandbox_python()
    for name in files:
        if not name or os.path.basename(name) != name or name in (".", ".."):
            raise ValueError(f"sandbox file name {name!r} must be a plain name")
    argv = [python if argv[0] == "python" else argv[0], *argv[1:]]
    mode = _resolve_mode(limits, python)
    _check_cgroup(limits)
    return _run(mode, files, argv, stdin, limits, python)


def _run(mode: str, files: dict[str, str], argv: list[str], stdin: str, limits: SandboxLimits, python: str) -> SandboxResult:
    staging = tempfile.mkdtemp(prefix="asyncrl-sandbox-")  # 0700, ours: the program never sees it
    cgroup = None
    seccomp = seccomp_filter()
    try:
        os.makedirs(os.path.join(staging, "files"))
        for name, text in files.items():
            with open(os.path.join(staging, "files", name), "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/work", "PYTHONDONTWRITEBYTECODE": "1"}
        rlimits = _rlimits(limits)
        if cgroup_layout():
            # Memory of every process together, tmpfs pages included; process count likewise.
            cgroup = SandboxCgroup.create((limits.memory_mb + 2 * limits.disk_mb) << 20, limits.max_processes + 2)
        if mode == "unisolated":
            cwd = os.path.join(staging, "files")
            command, preexec = argv, _unisolated_preexec(limits, rlimits, staging, cgroup, seccomp)
            env["HOME"] = cwd
        else:
            uid = _new_uid() if mode == "namespaces" else None
            if uid is not None or cgroup is None:
                # uid of its own: the limit is this sandbox's alone. In a user namespace without a
                # cgroup the uid is the caller's: allow what already runs, plus the sandbox's share.
                rlimits["RLIMIT_NPROC"] = limits.max_processes + (0 if uid is not None else _processes_of(os.getuid()))
            links, binds = _tree([*interpreter_paths(python), *limits.allow_paths])
            hidden = [p for b in binds for p in glob.glob(os.path.join(b, "*-packages"))]
            job = {"root": os.path.join(staging, "root"), "files": os.path.join(staging, "files"), "binds": binds,
                   "links": links, "hidden": hidden, "disk_mb": limits.disk_mb, "limits": rlimits, "uid": uid,
                   "argv": argv, "env": env, "seccomp": seccomp.program.hex() if seccomp.on else None}
            command = [*_unshare_command(mode), python, "-I", "-S", "-c", LAUNCHER, json.dumps(job)]
            cwd, preexec = "/", _namespaced_preexec(cgroup, os.getpid())
        ended = supervise(command, cwd, env, preexec, stdin, limits.wall_s, limits.max_output_bytes,
                          kill_escaped=cgroup.kill if cgroup is not None else None)
        return SandboxResult(returncode=ended.returncode, stdout=ended.stdout, stderr=ended.stderr,
                             timed_out=ended.timed_out, output_truncated=ended.output_truncated,
                             wall_s=ended.wall_s,
                             isolation={"mode": mode, "cgroup": cgroup is not None, "seccomp": seccomp.state})
    finally:
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(staging, ignore_errors=True)


def _namespaced_preexec(cgroup: SandboxCgroup | None, parent: int):
    """`unshare`'s: into the cgroup; killed with its caller (then `--kill-child` ends the namespace)."""
    def preexec():
        if cgroup is not None:
            cgroup.attach()
        _parent_death_signal(parent)
    return preexec


def _unisolated_preexec(limits: SandboxLimits, rlimits: dict[str, int], staging: str, cgroup: SandboxCgroup | None,
                        seccomp: SeccompFilter):
    """Resource limits and the seccomp filter (the caller opted in to no namespaces); as root, also a
    uid of its own and the cgroup."""
    uid = _new_uid() if os.geteuid() == 0 else None
    parent = os.getpid()
    if uid is not None:
        rlimits = {**rlimits, "RLIMIT_NPROC": limits.max_processes}
        os.chmod(staging, 0o711)  # the program may enter its own directory, not list the staging one
        for path in [os.path.join(staging, "files"), *glob.glob(os.path.join(staging, "files", "*"))]:
            os.chown(path, uid, uid)

    def preexec():
        if cgroup is not None:
            cgroup.attach()
        for name, value in rlimits.items():
            resource.setrlimit(getattr(resource, name), (value, value))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _parent_death_signal(parent)  # after the uid change, which would clear it
        if seccomp.on and install_filter(_LIBC, seccomp.program):  # asked for and refused: never run without it
            os.write(2, b"sandbox setup failed: the seccomp filter could not be installed\n")
            os._exit(125)
    return preexec
