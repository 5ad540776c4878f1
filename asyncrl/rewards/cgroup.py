"""One cgroup per sandbox: memory and process-count limits over all of a sandbox's processes
together (rlimits bind each process alone: six children held 2.4 GB under a 512 MB rlimit), and a
kill that reaches every process in it, `setsid()` or not.

cgroup v2 where its `memory` and `pids` controllers can be enabled below us, else the v1
hierarchies of those controllers; neither (no root, no delegation) = no cgroup, and the sandbox
falls back to rlimits and its PID namespace. `cgroup_layout()` says which.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import time

_COUNTER = itertools.count()


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, options) of every cgroup mount, from /proc/self/mountinfo."""
    out = []
    try:
        lines = open("/proc/self/mountinfo", encoding="utf-8").read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and tail and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[4], tail[0], set(tail[-1].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """controller -> this process's cgroup path (v1), and "" -> its v2 path."""
    paths = {}
    try:
        for line in open("/proc/self/cgroup", encoding="utf-8").read().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    except OSError:
        pass
    return paths


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _v2_base() -> str | None:
    """A v2 directory under which memory and pids can be delegated to children, or None."""
    own = _own_paths().get("")
    for mount, fstype, _ in _mounts():
        if fstype != "cgroup2" or own is None:
            continue
        base = os.path.join(mount, own.lstrip("/"))
        try:
            available = set(open(os.path.join(base, "cgroup.controllers")).read().split())
            if not {"memory", "pids"} <= available:
                continue
            # Controllers can only be handed to children of a cgroup that holds no process itself:
            # a parent of our own for every sandbox, created once.
            _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
            parent = os.path.join(base, "asyncrl-sandboxes")
            os.makedirs(parent, exist_ok=True)
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
            return parent
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def cgroup_layout() -> dict:
    """{"version": 2, "base": dir} or {"version": 1, "memory": dir, "pids": dir}, or {} when this
    process cannot create cgroups. Checked by creating and removing one."""
    if os.geteuid() != 0 and not os.environ.get("ASYNCRL_SANDBOX_CGROUP"):
        return {}
    base = _v2_base()
    if base:
        layout = {"version": 2, "base": base}
    else:
        own, layout = _own_paths(), {"version": 1}
        for mount, fstype, options in _mounts():
            for controller in ("memory", "pids"):
                if fstype == "cgroup" and controller in options and controller in own:
                    layout[controller] = os.path.join(mount, own[controller].lstrip("/"))
        if "memory" not in layout or "pids" not in layout:
            return {}
    try:
        probe = SandboxCgroup.create(64 << 20, 8, layout)
        probe.remove()
    except OSError:
        return {}
    return layout


class SandboxCgroup:
    def __init__(self, dirs: list[str], version: int):
        self.dirs, self.version = dirs, version

    @classmethod
    def create(cls, memory_bytes: int, max_pids: int, layout: dict | None = None) -> "SandboxCgroup":
        layout = cgroup_layout() if layout is None else layout
        name = f"sandbox-{os.getpid()}-{next(_COUNTER)}"
        if layout["version"] == 2:
            path = os.path.join(layout["base"], name)
            os.mkdir(path)
            group = cls([path], 2)
            try:
                _write(os.path.join(path, "memory.max"), str(memory_bytes))
                try:
                    _write(os.path.join(path, "memory.swap.max"), "0")
                except OSError:
                    pass  # no swap accounting: memory.max alone
                _write(os.path.join(path, "pids.max"), str(max_pids))
            except OSError:
                group.remove()
                raise
            return group
        memory, pids = os.path.join(layout["memory"], f"asyncrl-{name}"), os.path.join(layout["pids"], f"asyncrl-{name}")
        os.mkdir(memory)
        group = cls([memory], 1)
        try:
            os.mkdir(pids)
            group.dirs.append(pids)
            _write(os.path.join(memory, "memory.limit_in_bytes"), str(memory_bytes))
            try:
                _write(os.path.join(memory, "memory.memsw.limit_in_bytes"), str(memory_bytes))
            except OSError:
                pass  # no swap accounting
            _write(os.path.join(pids, "pids.max"), str(max_pids))
        except OSError:
            group.remove()
            raise
        return group

    def attach(self, pid: int = 0) -> None:
        """Move `pid` (0: the calling process) in; its children are born inside. Called between
        fork and exec of the sandbox's first process, so nothing it starts is ever outside."""
        pid = pid or os.getpid()
        for path in self.dirs:
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def pids(self) -> set[int]:
        found = set()
        for path in self.dirs:
            try:
                found |= {int(p) for p in open(os.path.join(path, "cgroup.procs")).read().split()}
            except (OSError, ValueError):
                pass
        return found

    def memory_peak(self) -> int | None:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                return int(open(os.path.join(self.dirs[0], name)).read())
            except (OSError, ValueError):
                continue
        return None

    def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process inside until none is left (a fork racing the kill is caught by
        the next pass)."""
        if self.version == 2:
            try:
                _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill()
        for path in self.dirs:
            for _ in range(100):  # a killed process leaves the cgroup a moment after it dies
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
